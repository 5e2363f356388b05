"""The installed OpenRLHF's entropy convention, read from its version: a distribution's metadata
written to a folder on `sys.path` stands for an installed release."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.client.conventions import openrlhf_tempered_entropy, release_of


def install(folder: Path, version: str) -> None:
    """What `pip install openrlhf==version` leaves for importlib.metadata to find."""
    info = folder / f"openrlhf-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: openrlhf\nVersion: {version}\n")


@pytest.mark.parametrize(
    ("version", "tempered"),
    [
        ("0.10.4", False),
        ("0.11.0", False),
        ("0.11.0.post1", False),
        ("0.11.1", True),
        ("0.11.2", True),
        ("0.12.0rc1", True),
        ("1.0", True),
    ],
)
def test_openrlhf_from_0_11_1_tempers_its_entropy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version: str, tempered: bool
) -> None:
    install(tmp_path, version)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert openrlhf_tempered_entropy() is tempered


def test_without_openrlhf_the_current_convention() -> None:
    """The test environment has no openrlhf on its path (test_releases imports it from a folder
    outside it): the entropy of logits / T."""
    assert openrlhf_tempered_entropy() is True


def test_release_of() -> None:
    assert release_of("0.11.1") == (0, 11, 1)
    assert release_of(" 0.11.0.post2") == (0, 11, 0)
    assert release_of("dev") is None

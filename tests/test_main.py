"""python -m service: the command line and LOGPROBD_* environment build the same Settings."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from service.__main__ import _parser
from service.settings import Settings
from tests.support import ROOT


def test_every_setting_has_a_flag() -> None:
    args = _parser().parse_args(
        ["serve", "--model", "/m", "--port", "9000", "--device", "cpu", "--dtype", "bfloat16",
         "--max-batch-tokens", "4096", "--host", "0.0.0.0", "--attention", "sdpa"]
    )  # fmt: skip
    overrides = {k: v for k, v in vars(args).items() if k != "command" and v is not None}
    settings = Settings(**overrides)
    assert settings.model == Path("/m")
    assert settings.port == 9000
    assert settings.dtype == "bfloat16"
    assert settings.max_batch_tokens == 4096
    assert settings.attention == "sdpa"
    shown = subprocess.run(
        [sys.executable, "-m", "service", "serve", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for name in Settings.model_fields:
        assert f"--{name.replace('_', '-')}" in shown
        assert f"LOGPROBD_{name.upper()}" in shown


def test_environment_sets_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOGPROBD_MAX_BATCH_TOKENS", "2048")
    monkeypatch.setenv("LOGPROBD_DEVICE", "cpu")
    settings = Settings()
    assert settings.max_batch_tokens == 2048
    assert settings.device == "cpu"


def test_bad_choice_is_rejected() -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--dtype", "float64"])


def test_serve_exits_non_zero_when_the_model_cannot_load(tmp_path: Path) -> None:
    """A directory that passes the start's checks (it has a config.json) but does not load: exit 1."""
    (tmp_path / "config.json").write_text('{"model_type": "no-such-architecture"}')
    done = subprocess.run(
        [sys.executable, "-m", "service", "serve", "--model", str(tmp_path), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1
    assert "model failed to load" in done.stderr
    assert "no-such-architecture" in done.stderr


def test_nothing_imports_the_entry_point() -> None:
    """`python -m service` is the top of the import graph: the docs renderer and every other module
    take the command line's flags from service/flags.py, so no import circle runs through it."""
    importers = []
    for path in sorted((ROOT / "service").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [alias.name for alias in node.names] if isinstance(node, ast.Import)
                else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            )  # fmt: skip
            if "service.__main__" in names:
                importers.append(path.relative_to(ROOT).as_posix())
    assert importers == []
    rendered = subprocess.run(
        [sys.executable, "-c",
         "import sys; from service.configdoc import render_configuration; render_configuration(); "
         "print('service.__main__' in sys.modules)"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert rendered == "False\n"

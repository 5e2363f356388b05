"""Every name the documentation gives for an object the chart creates is a name the chart renders.

The pages install the chart as release `rl` in namespace `train` (deploying.md's `helm install`), as
tests/support/chart.py renders it. Read from README.md and docs/ (the benchmark history excepted: it
records what was, not what is): `kubectl` references such as `deployment/rl-logprobd`, Service DNS
names (`rl-logprobd.train.svc`), a claim's `claimName`, a `service="..."` label, names written with
a `<release>` placeholder, and any other `rl-logprobd...` name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support import ROOT
from tests.support.chart import NAMESPACE, RELEASE, VALUES_FILES, render

PAGES = [
    ROOT / "README.md",
    *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "benchmark-history.md"),
]
KINDS = {"deployment": "Deployment", "service": "Service", "svc": "Service", "pvc": "PersistentVolumeClaim"}

KUBECTL_REF = re.compile(r"\b(deployment|service|svc|pvc)/([a-z0-9][a-z0-9-]*)")
DNS_NAME = re.compile(r"\b([a-z0-9][a-z0-9-]*)\.([a-z0-9][a-z0-9-]*)\.svc\b")
CLAIM = re.compile(r'"claimName":\s*"([^"]+)"')
SERVICE_LABEL = re.compile(r'\bservice="([^"]+)"')
PLACEHOLDER = re.compile(r"<release>(-[a-z0-9-]*[a-z0-9])")
RELEASE_NAME = re.compile(rf"(?<![\w.-]){RELEASE}-logprobd[a-z0-9-]*")


def rendered() -> set[tuple[str, str]]:
    """(kind, name) of every object the chart renders with any CI values file."""
    return {(m["kind"], m["metadata"]["name"]) for path in VALUES_FILES for m in render(path)}


def named_in(text: str) -> list[tuple[str | None, str, str]]:
    """(kind or None for any kind, name, as written) of every chart object the text names."""
    found: list[tuple[str | None, str, str]] = []
    for line in (line for line in text.splitlines() if "kubectl " in line):
        found += [(KINDS[m.group(1)], m.group(2), m.group()) for m in KUBECTL_REF.finditer(line)]
    for m in DNS_NAME.finditer(text):
        name, namespace = m.groups()
        found.append(
            ("Service", name if namespace == NAMESPACE else f"{name} in namespace {namespace}", m.group())
        )
    found += [("PersistentVolumeClaim", m.group(1), m.group()) for m in CLAIM.finditer(text)]
    found += [("Service", m.group(1), m.group()) for m in SERVICE_LABEL.finditer(text)]
    found += [(None, RELEASE + m.group(1), m.group()) for m in PLACEHOLDER.finditer(text)]
    found += [(None, m.group(), m.group()) for m in RELEASE_NAME.finditer(text)]
    return found


def test_the_pages_install_the_release_the_tests_render() -> None:
    deploying = (ROOT / "docs" / "deploying.md").read_text()
    assert f"helm install {RELEASE} ./helm/logprobd -n {NAMESPACE} " in deploying


def wrong_names(text: str, objects: set[tuple[str, str]]) -> list[str]:
    names = {name for _, name in objects}
    return [
        f"{written!r}: no {kind or 'object'} named {name!r}"
        for kind, name, written in named_in(text)
        if (kind, name) not in objects and not (kind is None and name in names)
    ]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_object_name_in_the_docs_is_rendered(page: Path) -> None:
    assert wrong_names(page.read_text(), rendered()) == []


def test_the_names_are_found_and_a_wrong_one_is_caught() -> None:
    """The reader sees what deploying.md names, and a name the chart does not render fails."""
    deploying = {(kind, name) for kind, name, _ in named_in((ROOT / "docs" / "deploying.md").read_text())}
    assert {
        ("Deployment", "rl-logprobd"),
        ("Service", "rl-logprobd"),
        ("Service", "rl-logprobd-replicas"),
        ("PersistentVolumeClaim", "rl-logprobd-models"),
    } <= deploying
    objects = rendered()
    for text in (
        "the headless Service, `<release>-replicas`",
        'resolve_replicas("logprobd-replicas.rl.svc.cluster.local", 8000)',
        "kubectl -n train port-forward service/rl-replicas 8000:8000",
        '{"claimName": "rl-models"}',
        "the volume rl-logprobd-model",
    ):
        assert len(wrong_names(text, objects)) == 1, text

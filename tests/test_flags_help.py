"""`serve --help` and docs/configuration.md list the settings in the same groups (settings.GROUPS:
model, scoring, batching, memory, HTTP, weights, operations), every setting in exactly one, from a
real `python -m service serve --help`."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from service.settings import GROUPS, Settings
from tests.support import ROOT


def test_every_setting_is_in_exactly_one_group() -> None:
    names = [name for group in GROUPS for name in group.names]
    assert sorted(names) == sorted(Settings.model_fields)
    assert [group.title for group in GROUPS] == [
        "model", "scoring", "batching", "memory", "HTTP", "weights", "operations"
    ]  # fmt: skip


def help_sections() -> dict[str, list[str]]:
    """`serve --help`'s sections: heading -> the flags listed under it, in order."""
    shown = subprocess.run(
        [sys.executable, "-m", "service", "serve", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "COLUMNS": "100"},
    ).stdout
    sections: dict[str, list[str]] = {}
    heading = ""
    for line in shown.splitlines():
        if re.match(r"^\S.*:$", line):
            heading = line[:-1]
            sections[heading] = []
        elif match := re.match(r"^  (--[a-z0-9-]+)", line):
            sections[heading].append(match.group(1))
    return sections


def test_help_lists_each_group_under_its_heading_in_order() -> None:
    sections = help_sections()
    assert list(sections) == ["options", *(f"{group.title} settings" for group in GROUPS)]
    for group in GROUPS:
        want = [f"--{name.replace('_', '-')}" for name in group.names]
        assert sections[f"{group.title} settings"] == want


def test_the_configuration_page_has_the_same_groups() -> None:
    page = (ROOT / "docs" / "configuration.md").read_text()
    headings = re.findall(r"^## (.+)$", page, re.MULTILINE)
    assert headings == [group.title[0].upper() + group.title[1:] for group in GROUPS]
    for group, part in zip(GROUPS, re.split(r"^## .+$", page, flags=re.MULTILINE)[1:], strict=True):
        flags = re.findall(r"^\| `(--[a-z0-9-]+)", part, re.MULTILINE)
        assert flags == [f"--{name.replace('_', '-')}" for name in group.names]

"""A suite's result file as BENCHMARKS.md's table of `section` shows it: the CPU smoke tests check
that what a suite writes is what the page reads."""

from __future__ import annotations

from pathlib import Path

from benchmarks.page.layout import Entry
from benchmarks.page.results import Sources, load
from benchmarks.page.tables import SECTIONS


def page_rows(section: str, path: Path) -> list[list[str]]:
    """The cells of each row of `section`'s table for the result file at `path` (header and rule left
    out)."""
    suite, render = SECTIONS[section]
    lines = render([Entry(load(path, suite))], Sources())
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines if line.startswith("| ")]
    return rows[2:]

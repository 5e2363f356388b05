"""BENCHMARKS.md from template.md and the result files current.toml names.

    python -m benchmarks.page            # writes BENCHMARKS.md
    python -m benchmarks.page --check    # exits 1, saying where, when BENCHMARKS.md is not what it writes

template.md is the page's hand-written part: its headings and a few lines each. Each `{{name}}` in it
is replaced: a section of current.toml by its table (tables.py), `{{stacks}}` by the stacks the cited
files ran on and `{{sources}}` by the table of the cited files (date, commit, stack, command). Every
section of current.toml must be placed and every marker known, so nothing is cited that is not shown.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
import tomllib
from pathlib import Path
from typing import Any

from benchmarks.page.layout import Entry
from benchmarks.page.results import PageError, Sources, read
from benchmarks.page.tables import SECTIONS

HERE = Path(__file__).resolve().parent
PAGE = HERE.parents[1] / "BENCHMARKS.md"
MARKER = re.compile(r"^\{\{(\w+)\}\}$", re.MULTILINE)
DERIVED = {
    "run_load": "run",
    "distribution_json": "distribution",
    "replay_json": "replay",
}  # tables of another section's files


def entries(current: dict[str, Any], section: str) -> list[Entry]:
    """The files current.toml names for `section`, read; for a derived section, those of the section it
    reads, without their notes (which that section's table carries)."""
    suite = SECTIONS[section][0]
    named = current.get(DERIVED.get(section, section), [])
    own = section not in DERIVED
    return [
        Entry(read(e["file"], suite), e.get("models"), e.get("note") if own else None, e.get("scenarios"))
        for e in named
    ]


def render(template: str, current: dict[str, Any]) -> str:
    """The page: every marker of `template` replaced."""
    unknown = set(current) - set(SECTIONS)
    if unknown:
        raise PageError(f"current.toml: no table for {sorted(unknown)}")
    placed = set(MARKER.findall(template))
    unplaced = set(current) - placed
    if unplaced:
        raise PageError(f"template.md: no marker for {sorted(unplaced)}")
    sources = Sources()
    tables: dict[str, str] = {}
    for name in MARKER.findall(template):  # in page order, so sources are listed as first cited
        if name in SECTIONS:
            tables[name] = "\n".join(SECTIONS[name][1](entries(current, name), sources))
        elif name not in ("stacks", "sources"):
            raise PageError(f"template.md: unknown marker {{{{{name}}}}}")
    tables["stacks"] = "\n".join(sources.stacks_lines())
    tables["sources"] = "\n".join(sources.table())
    return MARKER.sub(lambda m: tables[m.group(1)], template)


def build() -> str:
    current = tomllib.loads((HERE / "current.toml").read_text())
    return render((HERE / "template.md").read_text(), current)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.page", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with BENCHMARKS.md; write nothing")
    parser.add_argument("--output", type=Path, default=PAGE)
    args = parser.parse_args(argv)
    page = build()
    if not args.check:
        args.output.write_text(page)
        print(f"{args.output}: {page.count(chr(10))} lines", file=sys.stderr)
        return 0
    found = args.output.read_text() if args.output.is_file() else ""
    if found == page:
        return 0
    diff = difflib.unified_diff(
        found.splitlines(), page.splitlines(), str(args.output), "generated", lineterm=""
    )
    print("\n".join(list(diff)[:40]), file=sys.stderr)
    print(f"{args.output} is stale: run `python -m benchmarks.page`", file=sys.stderr)
    return 1

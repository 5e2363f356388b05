"""How a section's table is laid out: the files named for it (Entry), a renderer made from a header and
a function giving each file's rows (renderer), the notes under it, and the cells that recur across
suites (a variant's ms with its share of the floor or its cost, a count, a ratio, yes or no). The
suites' own cells are tables.py's and serving.py's."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from benchmarks.page.results import NONE, Result, Sources, figure, ms, pct, signed, table


@dataclass(frozen=True)
class Entry:
    """One file named for a section, the models of it shown (all where None), the scenarios of a
    model shown (all where None; the prefix cache's), and a note."""

    result: Result
    models: list[str] | None = None
    note: str | None = None
    scenarios: list[str] | None = None

    def rows(self) -> dict[str, Any]:
        return self.result.models(self.models)


Cells = Callable[[Entry], Iterator[list[str]]]  # a file's rows, without the GPU and the link
Render = Callable[[list[Entry], Sources], list[str]]


def renderer(header: str, cells: Cells) -> Render:
    """A section's renderer: `header`'s columns (GPU first, the result last), a row per `cells`. A
    column whose name ends in `:` is right-aligned (a number)."""
    names = ["GPU", *header.split(" | "), "result:"]
    right = {i for i, name in enumerate(names) if name.endswith(":")}
    names = [name.removesuffix(":") for name in names]
    right.discard(len(names) - 1)

    def render(entries: list[Entry], sources: Sources) -> list[str]:
        rows = [[e.result.gpu, *row, sources.cite(e.result)] for e in entries for row in cells(e)]
        return [*table(names, rows, right), *notes(entries)]

    return render


def notes(entries: list[Entry]) -> list[str]:
    """Each note once, after the GPUs and models it is about."""
    about: dict[str, list[str]] = {}
    for e in entries:
        if e.note:
            rows = about.setdefault(e.note, [])
            rows += [row for m in e.rows() if (row := f"{e.result.gpu} {m}") not in rows]
    return ["", *(f"- {', '.join(rows)}: {note}" for note, rows in about.items())] if about else []


def count(value: float | None) -> str:
    return NONE if (v := figure(value)) is None else f"{v:,.0f}"


def ratio(value: float | None) -> str:
    """Three decimals and a multiplication sign (1.001, then U+00D7)."""
    return NONE if (v := figure(value)) is None else f"{v:.3f}\N{MULTIPLICATION SIGN}"


def ms_of(variant: dict[str, Any] | None, fraction: str = "floor_fraction") -> str:
    """A variant's ms and, in brackets, its share of the floor (`fraction`)."""
    return NONE if variant is None else f"{ms(variant['ms'])} ({pct(variant.get(fraction))})"


def over(variant: dict[str, Any] | None, cost: str) -> str:
    """A variant's ms and, in brackets, its cost over the variant it is measured against."""
    return NONE if variant is None else f"{ms(variant['ms'])} ({signed(variant.get(cost))})"


def yes(flag: bool) -> str:
    return "yes" if flag else "**no**"

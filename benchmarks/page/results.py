"""The result files BENCHMARKS.md cites: reading one (its provenance checked), how a figure is written,
and the two tables every figure points into: the stacks the files ran on and the files themselves.

A result file (benchmarks/harness.py) starts with `suite`, `device`, `gpus`, `date`, `commit`,
`command` and `versions`; a file that lacks one is refused, so no figure reaches the page without
them. Files are named relative to benchmarks/results/.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parents[1] / "results"
LINK_ROOT = "benchmarks/results"  # links are relative to the repository root, where BENCHMARKS.md is
PROVENANCE = ("suite", "device", "date", "commit", "command", "versions")
NONE = "\N{EN DASH}"


class PageError(ValueError):
    """A result file or the page's inputs do not say what the page needs."""


@dataclass(frozen=True)
class Result:
    """One result file, as read."""

    file: str  # relative to benchmarks/results/
    data: dict[str, Any]

    @property
    def link(self) -> str:
        return f"[{self.file}]({LINK_ROOT}/{self.file})"

    @property
    def gpu(self) -> str:
        """`H100`, `H200`, or `2 x H100` (with a multiplication sign) for a run over several GPUs."""
        name = str(self.data["device"])
        found = re.search(r"\b([A-Z]\d{2,4})\b", name)
        short = found.group(1) if found else name
        gpus = int(self.data.get("gpus", 1))
        return f"{gpus} \N{MULTIPLICATION SIGN} {short}" if gpus > 1 else short

    def models(self, only: list[str] | None = None) -> dict[str, Any]:
        """The file's `models` in its order, only those named where `only` is given (a suite of one
        model, as startup's, has its `model` and nothing else)."""
        models: dict[str, Any] = (
            self.data["models"] if "models" in self.data else {self.data["model"]: self.data}
        )
        missing = [m for m in only or [] if m not in models]
        if missing:
            raise PageError(f"{self.file}: no model {missing}")
        return {k: v for k, v in models.items() if only is None or k in only}


def read(file: str, suite: str) -> Result:
    """The result file `file` (under benchmarks/results/), which must be of `suite` and say where it
    came from."""
    return load(RESULTS / file, suite)


def load(path: Path, suite: str) -> Result:
    """The result file at `path` (named relative to benchmarks/results/ where it lies there), checked
    as read() checks it."""
    if not path.is_file():
        raise PageError(f"{path}: no such result file")
    data = json.loads(path.read_text())
    name = path.relative_to(RESULTS).as_posix() if path.is_relative_to(RESULTS) else path.name
    missing = [key for key in PROVENANCE if not data.get(key)]
    if missing:
        raise PageError(f"{name}: no {', '.join(missing)} (benchmarks/harness.py's provenance)")
    if data["suite"] != suite:
        raise PageError(f"{name}: a result of {data['suite']}, not {suite}")
    return Result(name, data)


# --- how a figure is written ---------------------------------------------------------------------


def figure(value: float | None) -> float | None:
    """`value`, or None where it is no figure: absent, or NaN (what a suite writes for a ratio to a
    variant it did not run)."""
    return None if value is None or math.isnan(value) else value


def ms(value: float | None) -> str:
    return NONE if (v := figure(value)) is None else f"{v:,.1f}"


def pct(value: float | None) -> str:
    return NONE if (v := figure(value)) is None else f"{v * 100:.1f} %"


def signed(value: float | None) -> str:
    return NONE if (v := figure(value)) is None else f"{v * 100:+.1f} %".replace("-", "\N{MINUS SIGN}")


def times(value: float | None) -> str:
    return NONE if (v := figure(value)) is None else f"{v:.2f}\N{MULTIPLICATION SIGN}"


def number(value: float | None, digits: int = 3) -> str:
    return NONE if (v := figure(value)) is None else f"{v:.{digits}g}"


def table(header: list[str], rows: list[list[str]], right: set[int] | None = None) -> list[str]:
    """A markdown table; the columns numbered in `right` right-aligned."""
    align = ["---:" if i in (right or set()) else "---" for i in range(len(header))]
    return [f"| {' | '.join(cells)} |" for cells in [header, align, *rows]]


# --- the stacks and the sources ------------------------------------------------------------------------


def cuda(versions: dict[str, str]) -> str | None:
    """The CUDA torch was built with: its `cuda` entry, or torch's local version (+cu130: 13.0)."""
    if "cuda" in versions:
        return versions["cuda"]
    found = re.search(r"\+cu(\d+)(\d)$", versions.get("torch", ""))
    return f"{found.group(1)}.{found.group(2)}" if found else None


def stack(versions: dict[str, str]) -> str:
    """`torch X, transformers Y, triton Z, Python W, CUDA V, `hopper` extra (...)`, what is known."""
    parts = [
        f"{label} {versions[key]}"
        for label, key in (("torch", "torch"), ("transformers", "transformers"), ("triton", "triton"))
        if key in versions
    ]
    if "python" in versions:
        parts.append(f"Python {versions['python']}")
    if built := cuda(versions):
        parts.append(f"CUDA {built}")
    extra = [
        f"{label} {versions[key]}" for label, key in (("flash-attn 4", "flash-attn-4"),) if key in versions
    ]
    if "quack-kernels" in versions:
        quack = f"quack-kernels {versions['quack-kernels']}"
        if "nvidia-cutlass-dsl" in versions:
            quack += f" on nvidia-cutlass-dsl {versions['nvidia-cutlass-dsl']}"
        extra.append(quack)
    if extra:
        parts.append(f"`hopper` extra ({', '.join(extra)})")
    elif "extras" in versions:  # named where it ran, its packages' versions not recorded
        parts.append(f"`{versions['extras']}` extra")
    if "liger-kernel" in versions:
        parts.append(f"liger-kernel {versions['liger-kernel']}")
    return ", ".join(parts)


def short(commit: str) -> str:
    """A commit as the page names it: a full hash's first 7 digits (what follows them, `+dirty`, kept)."""
    return re.sub(r"^([0-9a-f]{7})[0-9a-f]{33}\b", r"\1", commit)


@dataclass
class Sources:
    """The files the page cites, in the order it first cites them, and the stacks they ran on."""

    cited: dict[str, Result] = field(default_factory=dict)

    def cite(self, result: Result) -> str:
        self.cited.setdefault(result.file, result)
        return result.link

    def stacks(self) -> dict[str, str]:
        """Each distinct stack and its label, S1, S2, ... in order of citation."""
        labels: dict[str, str] = {}
        for result in self.cited.values():
            labels.setdefault(stack(result.data["versions"]), f"S{len(labels) + 1}")
        return labels

    def stacks_lines(self) -> list[str]:
        return [f"- **{label}**: {text}" for text, label in self.stacks().items()]

    def table(self) -> list[str]:
        labels = self.stacks()
        rows = [
            [
                r.link,
                r.gpu,
                str(r.data["date"]),
                f"`{short(str(r.data['commit']))}`",
                labels[stack(r.data["versions"])],
                f"`{r.data['command']}`",
            ]
            for r in self.cited.values()
        ]
        return table(["result", "GPU", "date", "commit", "stack", "command"], rows)

"""The cells of the tables about a server's life rather than one round's scoring: weight reload, weight
pushes under load, tensor parallel and start-up, each reading the keys its suite writes
(benchmarks/<suite>.py) and nothing else; tables.py lays them out."""

from __future__ import annotations

from collections.abc import Iterator

from benchmarks.page.layout import Entry, count, yes
from benchmarks.page.results import NONE, ms, pct


def reload(e: Entry) -> Iterator[list[str]]:
    for r in e.result.data["rows"]:
        exact = r["correct"] and r["scores_changed"] and r["back_exact"]
        yield [
            r["model"], r["mode"], f"{r['bytes'] / 2**30:.2f}", f"{r['stage_s']:.2f}", ms(r["pause_ms"]),
            f"{r['extra_peak_gib']:.2f}", yes(exact),
        ]  # fmt: skip


def push_soak(e: Entry) -> Iterator[list[str]]:
    """One row a soak: its pushes, the scoring pause of each against the target, the answers checked
    bit for bit against their version's scores, what failed, scoring during pushes and between, and
    the soak's verdict (benchmarks/soak_check.py: no failed push and no wrong answer)."""
    d = e.result.data
    s, pushes, pause, answers = d["settings"], d["pushes"], d["pause"], d["answers"]
    during, between = (count(d["scoring"][k]["tokens_per_s"]) for k in ("during_pushes", "between_pushes"))
    wrong = [answers[k] for k in ("errors", "mismatched", "unknown_version", "unchecked")]
    yield [
        s["model"], s["backend"], f"{s['mode']}, {s['load_format']}{stages(s.get('stages', 1))}",
        f"{pushes['done']} ({pushes['failed']})",
        f"{pushes['push_s_p50']:.2f} / {pushes['push_s_max']:.2f}",
        f"{ms(pause['p50_ms'])} / {ms(pause['max_ms'])} (≤ {pause['target_ms']:g})",
        f"{count(answers['checked'])} ({len(answers['per_version'])})", " / ".join(map(str, wrong)),
        f"{during} / {between}",
        yes(d["ok"]),
    ]  # fmt: skip


def stages(count: int) -> str:
    """A soak's pipeline stages, as its mode cell ends ("" for one)."""
    return f", {count} stages" if count > 1 else ""


def tp(e: Entry) -> Iterator[list[str]]:
    for r in e.result.data["runs"]:
        yield [
            r["model"], r["workload"], str(r["tensor_parallel_size"]), ms(r["ms"]),
            f"{r['tokens_per_s']:,.0f}",
            pct(r["floor_fraction"]), f"`{r['kernels']}`",
        ]  # fmt: skip


STARTUP_PHASES = ("build decoders", "warm-up scoring", "CUDA graphs")  # benchmarks.startup's, not all


def startup(e: Entry) -> Iterator[list[str]]:
    fresh = str(e.result.data["cache_dir"]).startswith("fresh")  # else the caches were given
    for n, start in enumerate(e.result.data["starts"]):
        phases, compiles = start["phases_s"], start["compiles"]
        seconds = [NONE if (s := phases.get(k)) is None else f"{s:.1f}" for k in STARTUP_PHASES]
        counted = [f"{compiles[k]['count']} ({compiles[k]['seconds']:.1f} s)" for k in ("triton", "cute")]
        caches = "warm" if n else "cold" if fresh else "as given"
        yield [e.result.data["model"], caches, f"{start['ready_s']:.1f}", *seconds, *counted]

"""Each section's table, from the result files benchmarks/page/current.toml names for it: one function
per section giving a file's rows, reading the keys its suite writes (benchmarks/<suite>.py) and
nothing else. Every row starts with the GPU and ends with the link to its file; an entry's `note`
follows the table. In a header, a column whose name ends in `:` is right-aligned (a number)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from benchmarks.page.results import NONE, Result, Sources, ms, number, pct, signed, table, times


@dataclass(frozen=True)
class Entry:
    """One file named for a section, the models of it shown (all where None), and a note."""

    result: Result
    models: list[str] | None = None
    note: str | None = None

    def rows(self) -> dict[str, Any]:
        return self.result.models(self.models)


Cells = Callable[[Entry], Iterator[list[str]]]  # a file's rows, without the GPU and the link
Render = Callable[[list[Entry], Sources], list[str]]


def _render(header: str, cells: Cells) -> Render:
    """A section's renderer: `header`'s columns (GPU first, the result last), a row per `cells`."""
    names = ["GPU", *header.split(" | "), "result:"]
    right = {i for i, name in enumerate(names) if name.endswith(":")}
    names = [name.removesuffix(":") for name in names]
    right.discard(len(names) - 1)

    def render(entries: list[Entry], sources: Sources) -> list[str]:
        rows = [[e.result.gpu, *row, sources.cite(e.result)] for e in entries for row in cells(e)]
        return [*table(names, rows, right), *_notes(entries)]

    return render


def _notes(entries: list[Entry]) -> list[str]:
    """Each note once, after the GPUs and models it is about."""
    about: dict[str, list[str]] = {}
    for e in entries:
        if e.note:
            rows = about.setdefault(e.note, [])
            rows += [row for m in e.rows() if (row := f"{e.result.gpu} {m}") not in rows]
    return ["", *(f"- {', '.join(rows)}: {note}" for note, rows in about.items())] if about else []


def _count(value: int | None) -> str:
    return NONE if value is None else f"{value:,}"


def _ms_of(variant: dict[str, Any] | None, fraction: str = "floor_fraction") -> str:
    return NONE if variant is None else f"{ms(variant['ms'])} ({pct(variant.get(fraction))})"


def _over(variant: dict[str, Any], cost: str) -> str:
    return f"{ms(variant['ms'])} ({signed(variant[cost])})"


def _yes(flag: bool) -> str:
    return "yes" if flag else "**no**"


def _run(e: Entry) -> Iterator[list[str]]:
    for name, m in e.rows().items():
        v = m["variants"]
        yield [
            name, ms(m["floor_ms"]), ms(v["engine"]["ms"]), ms(v["http"]["ms"]),
            pct(m["floor_fraction_http"]),
            _ms_of(v.get("http_plain")), _ms_of(v.get("http_plain_8proc")), ms(v["naive"]["ms"]),
            times(m["speedup_vs_naive"]),
            f"{v['http']['peak_memory_gib']:.1f} ({v['naive']['peak_memory_gib']:.1f})",
            f"{number(m['max_abs_diff_bf16'])} ({number(m['max_abs_diff_bf16_naive_peer'])})",
        ]  # fmt: skip


def _run_load(e: Entry) -> Iterator[list[str]]:
    for name, m in e.rows().items():
        if ld := m.get("load"):
            yield [
                name, f"{ld['offered_requests_per_s']:.1f}", f"{ld['requests_per_s']:.1f}",
                f"{ld['tokens_per_s']:,.0f}", ms(ld["p50_ms"]), ms(ld["p99_ms"]), f"{ld['seconds']:g}",
            ]  # fmt: skip


def _grpo(e: Entry) -> Iterator[list[str]]:
    for name, m in e.rows().items():
        for w, r in m["workloads"].items():
            v = r["variants"]
            on = v["sharing_on"]
            yield [
                name, w, f"{r['tokens']:,}", f"{r['unique_tokens']:,}", ms(v.get("naive", {}).get("ms")),
                ms(v["sharing_off"]["ms"]), ms(on["ms"]), times(r.get("speedup_sharing")),
                pct(on["unique_floor_fraction"]), ms(v.get("sharing_on_grouped", {}).get("ms")),
                _count(on.get("computed_tokens")),
            ]  # fmt: skip


CLIENT = {"plain": "one process", "plain-processes": "a process per rank", "frames": "logprobd client"}


def _plain(e: Entry) -> Iterator[list[str]]:
    client = CLIENT[e.result.data["settings"]["client"]]
    for name, m in e.rows().items():
        for w, r in m["workloads"].items():
            v = r["variants"]
            on, grouped = v["sharing_on"], v.get("sharing_on_grouped")
            yield [
                name,
                w,
                client,
                _ms_of(on, "unique_floor_fraction"),
                _ms_of(grouped, "unique_floor_fraction"),
            ]


def _long(e: Entry) -> Iterator[list[str]]:
    for name, m in e.rows().items():
        chunked, whole = m["chunked"], m["whole"]
        yield [
            name, f"{sum(m['long_tokens']):,}", _ms_of(chunked), _ms_of(whole),
            f"{m['chunked_vs_whole']:.3f}",
            ms(m["naive"].get("ms")), f"{chunked['memory']['peak_gib']:.2f}",
            number(chunked["max_abs_diff_vs_float32"]),
        ]  # fmt: skip


def long_extra(entries: list[Entry]) -> list[str]:
    """The long suite's one long sequence and its fairness load, a line each, where a file has them."""
    lines = []
    for e in entries:
        for name, m in e.rows().items():
            if one := m.get("single"):
                lines.append(
                    f"- {e.result.gpu}, {name}, one sequence of {one['tokens']:,} tokens: "
                    f"{ms(one['ms'])} ms, {pct(one['floor_fraction'])} of the floor, "
                    f"peak {one['memory']['peak_gib']:.2f} GiB."
                )
            if fair := m.get("fairness"):
                alone, mixed = fair["alone"], fair["with_long_stream"]
                lines.append(
                    f"- {e.result.gpu}, {name}, short requests beside a stream of long ones: p50 / p99 "
                    f"{ms(alone['short_p50_ms'])} / {ms(alone['short_p99_ms'])} ms alone, "
                    f"{ms(mixed['short_p50_ms'])} / {ms(mixed['short_p99_ms'])} ms beside it "
                    f"(p99 {times(fair['p99_ratio'])})."
                )
    return ["", *lines] if lines else []


def _invariance(e: Entry) -> Iterator[list[str]]:
    for name, m in e.rows().items():
        for w, r in m["workloads"].items():
            off = "yes" if r["bitwise_off"] else "no"
            yield [name, w, ms(r["ms_off"]), ms(r["ms_on"]), signed(r["cost"]), _yes(r["bitwise_on"]), off]


def _moe(e: Entry) -> Iterator[list[str]]:
    for name, m in e.rows().items():
        http = m["variants"]["http"]
        yield [
            name, ms(http["ms"]), f"{http['tokens_per_s']:,.0f}", pct(http["floor_fraction"]),
            f"+{pct(http['slowest_over_median'])}", ms(m["variants"]["fused"]["ms"]), f"{m['ready_s']:.1f}",
        ]  # fmt: skip


def _float32(m: dict[str, Any], variant: str) -> str:
    found = (m.get("max_abs_diff_vs_float32") or {}).get(variant)
    return NONE if found is None else f"{number(found['max'])} / {number(found['mean'])}"


def _moe_peers(e: Entry) -> Iterator[list[str]]:
    for name, m in e.rows().items():
        v = m["variants"]
        yield [
            name, ms(v["http"]["ms"]), ms(v["transformers_grouped_mm"]["ms"]),
            ms(v["transformers_eager"]["ms"]),
            times(m["speedup_vs_transformers"]), _float32(m, "fused"), _float32(m, "grouped_mm"),
        ]  # fmt: skip


def _replay(e: Entry) -> Iterator[list[str]]:
    for name, m in e.rows().items():
        v = m["variants"]
        yield [
            name, _ms_of(v["live"]), _over(v["record"], "cost_over_live"),
            _over(v["replay"], "cost_over_live"),
            number(m["route_bytes_per_entry"], 6), number(m["replay_vs_live_max_abs_diff"]),
            f"{m['replay_exact_agreement_min']:.3f}",
        ]  # fmt: skip


def _distribution(e: Entry) -> Iterator[list[str]]:
    for name, m in e.rows().items():
        v, t = m["grpo-short"]["variants"], m["teacher"]
        yield [
            name, ms(v["plain"]["ms"]), signed(v["top_logprobs_100"]["cost_over_plain"]),
            signed(v["top_logprobs_1000"]["cost_over_plain"]), signed(v["processed"]["cost_over_plain"]),
            _ms_of(t), _ms_of(t.get("tokenizer")), f"{t['peak_gib_over_weights']:.2f}",
        ]  # fmt: skip


def _reload(e: Entry) -> Iterator[list[str]]:
    for r in e.result.data["rows"]:
        exact = r["correct"] and r["scores_changed"] and r["back_exact"]
        yield [
            r["model"], r["mode"], f"{r['bytes'] / 2**30:.2f}", f"{r['stage_s']:.2f}", ms(r["pause_ms"]),
            f"{r['extra_peak_gib']:.2f}", _yes(exact),
        ]  # fmt: skip


def _tp(e: Entry) -> Iterator[list[str]]:
    for r in e.result.data["runs"]:
        yield [
            r["model"], r["workload"], str(r["tensor_parallel_size"]), ms(r["ms"]),
            f"{r['tokens_per_s']:,.0f}",
            pct(r["floor_fraction"]), f"`{r['kernels']}`",
        ]  # fmt: skip


STARTUP_PHASES = ("build decoders", "warm-up scoring", "CUDA graphs")  # benchmarks.startup's, not all


def _startup(e: Entry) -> Iterator[list[str]]:
    fresh = str(e.result.data["cache_dir"]).startswith("fresh")  # else the caches were given
    for n, start in enumerate(e.result.data["starts"]):
        phases, compiles = start["phases_s"], start["compiles"]
        seconds = [NONE if (s := phases.get(k)) is None else f"{s:.1f}" for k in STARTUP_PHASES]
        counted = [f"{compiles[k]['count']} ({compiles[k]['seconds']:.1f} s)" for k in ("triton", "cute")]
        caches = "warm" if n else "cold" if fresh else "as given"
        yield [e.result.data["model"], caches, f"{start['ready_s']:.1f}", *seconds, *counted]


_LONG = _render(
    "model | tokens: | chunked, default budget (of the floor): | whole (budget 32,768): | chunked / whole: "
    "| naive peer: | peak GiB, chunked: | max \\|Δ\\| vs fp32:",
    _long,
)


def long(entries: list[Entry], sources: Sources) -> list[str]:
    return [*_LONG(entries, sources), *long_extra(entries)]


# section of current.toml -> (the suite its files come from, its renderer)
SECTIONS: dict[str, tuple[str, Render]] = {
    "run": ("run", _render(
        "model | floor ms: | engine in-process: | HTTP, logprobd client: | of the floor: "
        "| plain JSON, one process (of the floor): | plain JSON, a process per rank: | naive peer: "
        "| speed-up vs naive: | peak GiB (naive): | max \\|Δ\\| vs fp32 (naive):",
        _run,
    )),
    "run_load": ("run", _render(
        "model | offered req/s: | achieved req/s: | tokens/s: | p50 ms: | p99 ms: | s:", _run_load
    )),
    "grpo": ("grpo", _render(
        "model | workload | tokens sent: | unique: | naive peer: | sharing off: | sharing on: | on / off: "
        "| of the unique-token floor: | grouped form: | computed tokens:",
        _grpo,
    )),
    "plain": ("grpo", _render(
        "model | workload | client | ms (of the unique-token floor): | grouped form:", _plain
    )),
    "long": ("long", long),
    "invariance": ("invariance", _render(
        "model | workload | mode off ms: | mode on ms: | cost: | bitwise on | bitwise off", _invariance
    )),
    "moe": ("moe", _render(
        "shape | HTTP ms: | tokens/s: | of the floor: | slowest round: | in-process ms: | ready s:", _moe
    )),
    "moe_peers": ("moe", _render(
        "shape | fused MoE, HTTP ms: | transformers, `grouped_mm` experts: | transformers, `eager`: "
        "| speed-up: | \\|Δ\\| vs fp32, max / mean: | transformers' \\|Δ\\|:",
        _moe_peers,
    )),
    "replay": ("replay", _render(
        "model | live ms (of the floor): | record ms (cost): | replay ms (cost): | bytes per route entry: "
        "| replay vs live \\|Δ\\|: | lowest agreement:",
        _replay,
    )),
    "distribution": ("distribution", _render(
        "model | GRPO round, plain ms: | top-100: | top-1000: | processed: | teacher call ms (of the floor): "
        "| with a tokenizer: | teacher's peak GiB over the weights:",
        _distribution,
    )),
    "reload": ("reload", _render(
        "model | mode | GiB: | stage s: | pause ms: | extra GPU peak GiB: | exact", _reload
    )),
    "tp": ("tp", _render(
        "model | workload | tensor parallel: | ms: | tokens/s: | of the floor: | kernels", _tp
    )),
    "startup": ("startup", _render(
        "model | caches | ready s: | build decoders s: | warm-up s: | CUDA graphs s: | Triton compiles: "
        "| CuTe DSL compiles:",
        _startup,
    )),
}  # fmt: skip

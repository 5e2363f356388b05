"""Each section's table, from the result files benchmarks/page/current.toml names for it: one function
per section giving a file's rows, reading the keys its suite writes (benchmarks/<suite>.py) and
nothing else (the scoring suites' here, the server's life in serving.py), and SECTIONS, each
section's suite and renderer (layout.py). Every row starts with the GPU and ends with the link to its
file; an entry's `note` follows the table. In a header, a column whose name ends in `:` is
right-aligned (a number)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from benchmarks.page import serving
from benchmarks.page.layout import Entry, Render, count, ms_of, over, ratio, renderer, yes
from benchmarks.page.results import NONE, Sources, ms, number, pct, signed, times


def _run(e: Entry) -> Iterator[list[str]]:
    for name, m in e.rows().items():
        v = m["variants"]
        yield [
            name, ms(m["floor_ms"]), ms(v["engine"]["ms"]), ms(v["http"]["ms"]),
            pct(m["floor_fraction_http"]),
            ms_of(v.get("http_plain")), ms_of(v.get("http_plain_8proc")), ms(v["naive"]["ms"]),
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
                count(on.get("computed_tokens")),
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
                ms_of(on, "unique_floor_fraction"),
                ms_of(grouped, "unique_floor_fraction"),
            ]


def _long(e: Entry) -> Iterator[list[str]]:
    for name, m in e.rows().items():
        chunked, whole = m["chunked"], m["whole"]
        yield [
            name, f"{sum(m['long_tokens']):,}", ms_of(chunked), ms_of(whole),
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
            yield [name, w, ms(r["ms_off"]), ms(r["ms_on"]), signed(r["cost"]), yes(r["bitwise_on"]), off]


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
            name, ms_of(v["live"]), over(v["record"], "cost_over_live"),
            over(v["replay"], "cost_over_live"),
            number(m["route_bytes_per_entry"], 6), number(m["replay_vs_live_max_abs_diff"]),
            f"{m['replay_exact_agreement_min']:.3f}",
        ]  # fmt: skip


ROUTE_FORMS = ("record_base64", "replay_base64", "record_lists", "replay_lists")


def _replay_json(e: Entry) -> Iterator[list[str]]:
    for name, m in e.rows().items():
        v = m["variants"]
        if "live_json" not in v:
            continue
        yield [name, ms_of(v["live_json"]), *(over(v.get(k), "cost_over_live") for k in ROUTE_FORMS)]
        if "server_span_ms" in v["live_json"]:  # --timeline: the last rounds split
            yield [f"{name}, {SPLIT_ROW}", *(_split(v.get(k)) for k in ("live_json", *ROUTE_FORMS))]


SPLIT_ROW = "last round: server / clients, ms"


def _split(v: dict[str, Any] | None) -> str:
    """A JSON variant's last round (--timeline): the server's span / the plain clients' rest, ms; where
    the clients timed themselves, of the rest the longest body's encoding and the last answer's parse."""
    if v is None or "server_span_ms" not in v:
        return NONE
    own = [f"encoding {ms(v['encode_ms_max'])}"] if "encode_ms_max" in v else []
    own += [f"parse {ms(v['last_parse_ms'])}"] if "last_parse_ms" in v else []
    of_it = f" ({', '.join(own)})" if own else ""
    return f"{ms(v['server_span_ms'])} / {ms(v['outside_server_ms'])}{of_it}"


def _of(variant: dict[str, Any] | None, key: str) -> Any:
    """`variant[key]`, or None where the variant was not run."""
    return None if variant is None else variant.get(key)


def _distribution(e: Entry) -> Iterator[list[str]]:
    for name, m in e.rows().items():
        v, t = m["grpo-short"]["variants"], m["teacher"]
        costs = [signed(_of(v.get(k), "cost_over_plain")) for k in ("top_logprobs_100", "top_logprobs_1000")]
        yield [
            name, ms(_of(v.get("plain"), "ms")), *costs, signed(_of(v.get("processed"), "cost_over_plain")),
            ms_of(t), ms_of(t.get("tokenizer")), f"{t['answer_bytes'] / 1e6:.1f}",
            f"{t['peak_gib_over_weights']:.2f}",
        ]  # fmt: skip
        if "server_ms" in t:  # --timeline: the last call split; its prompts in-process, no HTTP
            teacher = f"{ms(t['server_ms'])} / {ms(t['client_before_ms'] + t['client_after_ms'])}"
            if "client_join_ms" in t:  # of the clients' part: httpx joining the answer's pieces
                teacher += f" (join {ms(t['client_join_ms'])})"
            yield [
                f"{name}, {SPLIT_ROW}",
                *[NONE] * 4,
                teacher,
                f"in-process {ms(t['in_process_ms'])}{_helper(t.get('helper'))}",
                NONE,
                NONE,
            ]


def _helper(helper: dict[str, Any] | None) -> str:
    """logprobd's helper to TRL's dict (`teacher.helper`), ms and its fraction of the floor."""
    return "" if helper is None else f"; helper {ms(helper['ms'])} ({helper['floor_fraction'] * 100:.1f} %)"


JSON_FORMS = ("top_logprobs_100_json", "top_logprobs_100_base64", "top_logprobs_1000_json",
              "top_logprobs_1000_base64", "processed_json")  # fmt: skip


def _distribution_json(e: Entry) -> Iterator[list[str]]:
    """The GRPO round from a plain JSON client, where the file has it (`--json-forms`): each variant
    over plain JSON, and the logprobd client's top-K rounds beside them."""
    client = CLIENT.get(str(e.result.data["settings"].get("json_client")), "")
    for name, m in e.rows().items():
        if (forms := m["grpo-short"].get("json")) is None:
            continue
        frames = m["grpo-short"]["variants"]
        yield [
            name, client, ms_of(forms["plain_json"], "unique_floor_fraction"),
            *(over(forms.get(k), "cost_over_plain_json") for k in JSON_FORMS),
            " / ".join(ms(_of(frames.get(k), "ms")) for k in ("top_logprobs_100", "top_logprobs_1000")),
        ]  # fmt: skip
        if "server_span_ms" in forms["plain_json"]:  # --timeline: the last rounds split
            yield [
                f"{name}, {SPLIT_ROW}",
                client,
                *(_split(forms.get(k)) for k in ("plain_json", *JSON_FORMS)),
                NONE,
            ]


def _prefix_cache(e: Entry) -> Iterator[list[str]]:
    for name, m in e.rows().items():
        for scenario, r in m["scenarios"].items():
            if e.scenarios is not None and scenario not in e.scenarios:
                continue
            on, off = r["variants"].get("cache_on"), r["variants"].get("cache_off")
            yield [
                name, scenario, count(r["unique_tokens"]), ms_of(on, "unique_floor_fraction"),
                ratio(_of(on, "computed_per_unique")), count(_of(on, "cached_tokens")),
                ms_of(off, "unique_floor_fraction"), ratio(_of(off, "computed_per_unique")),
                signed(r.get("slowdown_cache_on")),
            ]  # fmt: skip


_LONG = renderer(
    "model | tokens: | chunked, default budget (of the floor): | whole (budget 32,768): | chunked / whole: "
    "| naive peer: | peak GiB, chunked: | max \\|Δ\\| vs fp32:",
    _long,
)


def long(entries: list[Entry], sources: Sources) -> list[str]:
    return [*_LONG(entries, sources), *long_extra(entries)]


# section of current.toml -> (the suite its files come from, its renderer)
SECTIONS: dict[str, tuple[str, Render]] = {
    "run": ("run", renderer(
        "model | floor ms: | engine in-process: | HTTP, logprobd client: | of the floor: "
        "| plain JSON, one process (of the floor): | plain JSON, a process per rank: | naive peer: "
        "| speed-up vs naive: | peak GiB (naive): | max \\|Δ\\| vs fp32 (naive):",
        _run,
    )),
    "run_load": ("run", renderer(
        "model | offered req/s: | achieved req/s: | tokens/s: | p50 ms: | p99 ms: | s:", _run_load
    )),
    "grpo": ("grpo", renderer(
        "model | workload | tokens sent: | unique: | naive peer: | sharing off: | sharing on: | on / off: "
        "| of the unique-token floor: | grouped form: | computed tokens:",
        _grpo,
    )),
    "plain": ("grpo", renderer(
        "model | workload | client | ms (of the unique-token floor): | grouped form:", _plain
    )),
    "long": ("long", long),
    "invariance": ("invariance", renderer(
        "model | workload | mode off ms: | mode on ms: | cost: | bitwise on | bitwise off", _invariance
    )),
    "moe": ("moe", renderer(
        "shape | HTTP ms: | tokens/s: | of the floor: | slowest round: | in-process ms: | ready s:", _moe
    )),
    "moe_peers": ("moe", renderer(
        "shape | fused MoE, HTTP ms: | transformers, `grouped_mm` experts: | transformers, `eager`: "
        "| speed-up: | \\|Δ\\| vs fp32, max / mean: | transformers' \\|Δ\\|:",
        _moe_peers,
    )),
    "replay": ("replay", renderer(
        "model | live ms (of the floor): | record ms (cost): | replay ms (cost): | bytes per route entry: "
        "| replay vs live \\|Δ\\|: | lowest agreement:",
        _replay,
    )),
    "replay_json": ("replay", renderer(
        "model | live, plain JSON ms (of the floor): | record, base64: | replay, base64: | record, lists: "
        "| replay, lists:",
        _replay_json,
    )),
    "prefix_cache": ("prefix_cache", renderer(
        "model | scenario | unique tokens: | cache on, ms (of the unique-token floor): | computed / unique: "
        "| cached tokens: | cache off, ms (of the floor): | computed / unique, off: | on vs off:",
        _prefix_cache,
    )),
    "distribution": ("distribution", renderer(
        "model | GRPO round, plain ms: | top-100: | top-1000: | processed: | teacher call ms (of the floor): "
        "| with a tokenizer: | teacher's answer MB: | teacher's peak GiB over the weights:",
        _distribution,
    )),
    "distribution_json": ("distribution", renderer(
        "model | client | plain JSON ms (of the unique-token floor): | top-100 as lists: "
        "| top-100 as base64: | top-1000 as lists: | top-1000 as base64: | processed: "
        "| logprobd client, top-100 / top-1000 ms:",
        _distribution_json,
    )),
    "reload": ("reload", renderer(
        "model | mode | GiB: | stage s: | pause ms: | extra GPU peak GiB: | exact", serving.reload
    )),
    "push_soak": ("push_soak", renderer(
        "model | backend | mode | pushes (failed): | push s, p50 / max: | pause ms, p50 / max (target): "
        "| answers checked bitwise (versions): | errors / mismatched / unknown / unchecked "
        "| scoring tokens/s, during / between pushes: | ok",
        serving.push_soak,
    )),
    "tp": ("tp", renderer(
        "model | workload | tensor parallel: | ms: | tokens/s: | of the floor: | kernels", serving.tp
    )),
    "startup": ("startup", renderer(
        "model | caches | ready s: | build decoders s: | warm-up s: | CUDA graphs s: | Triton compiles: "
        "| CuTe DSL compiles:",
        serving.startup,
    )),
}  # fmt: skip

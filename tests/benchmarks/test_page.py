"""BENCHMARKS.md is what `python -m benchmarks.page` writes from the result files it cites, and every
figure on it comes from one of them."""

from __future__ import annotations

import importlib
import json
import re
import shlex
import tomllib
from pathlib import Path

import pytest

from benchmarks.page import build
from benchmarks.page.layout import Entry, notes
from benchmarks.page.results import (
    NONE,
    PROVENANCE,
    RESULTS,
    PageError,
    Result,
    Sources,
    load,
    read,
    short,
    stack,
)
from benchmarks.page.tables import SECTIONS
from tests.benchmarks.page_rows import page_rows

ROOT = Path(__file__).resolve().parents[2]
CURRENT = tomllib.loads((ROOT / "benchmarks/page/current.toml").read_text())


def test_benchmarks_md_is_the_generated_page() -> None:
    assert build.main(["--check"]) == 0, "BENCHMARKS.md is stale: run `python -m benchmarks.page`"


def test_the_page_is_at_most_300_lines() -> None:
    assert (ROOT / "BENCHMARKS.md").read_text().count("\n") <= 300


def test_every_result_file_named_is_cited_and_linked() -> None:
    page = (ROOT / "BENCHMARKS.md").read_text()
    named = {e["file"] for entries in CURRENT.values() for e in entries}
    linked = set(re.findall(r"\]\(benchmarks/results/([^)]+)\)", page))
    assert named == linked
    assert all((RESULTS / f).is_file() for f in linked)


def _suite_argv(command: str) -> tuple[str, list[str]]:
    """The suite module and its arguments in a cited command (an environment variable, or the probe
    that wrapped the run, in front of it left out)."""
    words = [w for w in shlex.split(command) if not re.fullmatch(r"[A-Z_]+=\S*", w)]
    at = next(i for i, w in enumerate(words) if re.fullmatch(r"benchmarks\.(?!probes\.)\w+", w))
    return words[at], words[at + 1 :]


def test_every_cited_command_is_one_its_suite_runs_today() -> None:
    for entries in CURRENT.values():
        for e in entries:
            data = json.loads((RESULTS / e["file"]).read_text())
            module, argv = _suite_argv(data["command"])
            assert module == f"benchmarks.{data['suite']}", e["file"]
            importlib.import_module(module).parser().parse_args(argv)  # exits on an argument it lacks


def _result(tmp_path: Path, **data: object) -> Path:
    path = tmp_path / "r.json"
    path.write_text(json.dumps(data))
    return path


def test_a_file_without_its_provenance_is_refused(tmp_path: Path) -> None:
    whole: dict[str, object] = {"suite": "reload", "device": "NVIDIA H200", "date": "2026-11-21"}
    whole["commit"] = "abc1234"
    whole |= {"command": "python -m benchmarks.reload", "versions": {"torch": "2.11.0+cu130"}, "rows": []}
    assert load(_result(tmp_path, **whole), "reload").gpu == "H200"
    for key in PROVENANCE:
        with pytest.raises(PageError, match=key):
            load(_result(tmp_path, **{k: v for k, v in whole.items() if k != key}), "reload")
    with pytest.raises(PageError, match="not tp"):
        load(_result(tmp_path, **whole), "tp")
    with pytest.raises(PageError, match="no such"):
        read("no-such-file.json", "run")


def test_a_stack_names_what_the_file_records_and_no_more() -> None:
    full = {"torch": "2.11.0+cu130", "transformers": "5.17.0", "triton": "3.6.0", "python": "3.12.3"}
    full |= {"flash-attn-4": "4.0.0b36", "quack-kernels": "0.6.4", "nvidia-cutlass-dsl": "4.6.2"}
    assert stack(full) == (
        "torch 2.11.0+cu130, transformers 5.17.0, triton 3.6.0, Python 3.12.3, CUDA 13.0, `hopper` extra "
        "(flash-attn 4 4.0.0b36, quack-kernels 0.6.4 on nvidia-cutlass-dsl 4.6.2)"
    )
    assert (
        stack({"torch": "2.11.0+cu128", "extras": "hopper"})
        == "torch 2.11.0+cu128, CUDA 12.8, `hopper` extra"
    )
    assert stack({"torch": "2.11.0", "cuda": "13.0"}) == "torch 2.11.0, CUDA 13.0"


def test_the_figures_are_the_files_numbers() -> None:
    """The first table's row of the H200's 0.5B is latest.json's, figure by figure."""
    result = read("latest.json", "run")
    m = result.data["models"]["qwen2.5-0.5b"]
    sources = Sources()
    (row,) = [
        line for line in SECTIONS["run"][1]([Entry(result, ["qwen2.5-0.5b"])], sources) if "0.5b" in line
    ]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:6] == [
        "H200",
        "qwen2.5-0.5b",
        f"{m['floor_ms']:,.1f}",
        f"{m['variants']['engine']['ms']:,.1f}",
        f"{m['variants']['http']['ms']:,.1f}",
        f"{m['floor_fraction_http'] * 100:.1f} %",
    ]
    assert cells[-1] == "[latest.json](benchmarks/results/latest.json)"
    assert list(sources.cited) == ["latest.json"]


def test_a_marker_without_a_table_or_a_section_without_a_marker_is_refused() -> None:
    with pytest.raises(PageError, match="unknown marker"):
        build.render("{{nothing}}\n", {})
    with pytest.raises(PageError, match="no marker"):
        build.render("{{sources}}\n", {"reload": [{"file": "reload-h200-2026-11-21.json"}]})
    with pytest.raises(PageError, match="no table"):
        build.render("{{sources}}\n", {"nothing": []})


def _rows(section: str, file: str) -> list[list[str]]:
    """The cells of each row of `section`'s table for the cited result file `file`."""
    return page_rows(section, RESULTS / file)


PREFIX_CACHE = "h200-2026-11-29-s49/prefix-cache-7b-9b90841.json"


def test_the_prefix_cache_rows_are_the_files_numbers_and_a_variant_not_run_is_a_dash() -> None:
    scenarios = read(PREFIX_CACHE, "prefix_cache").data["models"]["qwen2.5-7b"]["scenarios"]
    rows = {row[2]: row for row in _rows("prefix_cache", PREFIX_CACHE)}
    assert list(rows) == list(scenarios)
    split = scenarios["split-grpo"]
    on, off = split["variants"]["cache_on"], split["variants"]["cache_off"]
    assert rows["split-grpo"][:-1] == [
        "H200",
        "qwen2.5-7b",
        "split-grpo",
        f"{split['unique_tokens']:,}",
        f"{on['ms']:,.1f} ({on['unique_floor_fraction'] * 100:.1f} %)",
        f"{on['computed_per_unique']:.3f}\N{MULTIPLICATION SIGN}",
        f"{on['cached_tokens']:,.0f}",
        f"{off['ms']:,.1f} ({off['unique_floor_fraction'] * 100:.1f} %)",
        f"{off['computed_per_unique']:.3f}\N{MULTIPLICATION SIGN}",
        f"{(on['ms'] / off['ms'] - 1) * 100:+.1f} %".replace("-", "\N{MINUS SIGN}"),
    ]
    assert rows["split-grpo"][4:6] == [
        "1,036.9 (81.1 %)",
        "1.001\N{MULTIPLICATION SIGN}",
    ]  # as the run's log printed them
    assert "cache_off" not in scenarios["grpo-long"]["variants"]  # the run was cut before it
    assert rows["grpo-long"][7:10] == [NONE] * 3


def test_the_push_soak_row_is_the_files_numbers() -> None:
    file = "h200-2026-12-01-s69/push-soak-1gpu-2stages-baaf0ce.json"
    data = read(file, "push_soak").data
    ((gpu, model, backend, mode, pushes, push_s, pause, answers, wrong, _, ok, link),) = _rows(
        "push_soak", file
    )
    assert (gpu, model, backend) == ("H200", "qwen2.5-1.5b", "gloo")  # one GPU
    assert mode == "swap, flattened, 2 stages"
    assert pushes == f"{data['pushes']['done']} (0)"
    assert push_s == f"{data['pushes']['push_s_p50']:.2f} / {data['pushes']['push_s_max']:.2f}"
    assert (
        pause
        == f"{data['pause']['p50_ms']:.1f} / {data['pause']['max_ms']:.1f} (≤ 50)"
        == "20.4 / 24.6 (≤ 50)"
    )
    assert answers == f"{data['answers']['checked']:,} ({len(data['answers']['per_version'])})"
    assert (wrong, ok) == ("0 / 0 / 0 / 0", "yes")
    assert link.endswith(f"(benchmarks/results/{file})")
    one = _rows("push_soak", "h200-2026-12-01-s69/push-soak-1gpu-1stage-baaf0ce.json")[0]
    assert one[3] == "swap, flattened"  # a soak of one stage says nothing of stages


def test_the_distribution_json_forms_are_the_files_numbers_beside_its_other_rows() -> None:
    file = "h200-2026-11-29-s58/distribution-7b-h11-87ae7eb.json"
    short = read(file, "distribution").data["models"]["qwen2.5-7b"]["grpo-short"]
    forms, frames = short["json"], short["variants"]
    ((*cells, _),) = _rows("distribution_json", file)
    assert cells[2:4] == ["a process per rank", f"{forms['plain_json']['ms']:,.1f} (85.8 %)"]
    costs = [forms[f"top_logprobs_100_{form}"] for form in ("json", "base64")]
    assert cells[4:6] == [f"{v['ms']:,.1f} ({v['cost_over_plain_json'] * 100:+.1f} %)" for v in costs]
    assert cells[4:8] == ["531.1 (+24.2 %)", "460.4 (+7.7 %)", NONE, NONE]  # top-1000 not run
    assert cells[8:] == [NONE, f"{frames['top_logprobs_100']['ms']:.1f} / {NONE}"]
    ((_, _, plain, top100, top1000, processed, teacher, *_),) = _rows("distribution", file)
    assert (
        frames["top_logprobs_100"]["cost_over_plain"] != frames["top_logprobs_100"]["cost_over_plain"]
    )  # NaN
    assert [plain, top100, top1000, processed] == [NONE] * 4  # no plain round: no figure, not "nan"
    assert teacher == "1,012.9 (63.5 %)"
    # a file without the JSON forms has no row in their table
    assert _rows("distribution_json", "h200-2026-11-26-804101c/distribution.json") == []


def test_the_route_json_forms_are_the_files_costs_over_plain_json() -> None:
    file = "h200-2026-11-29-s58/replay-json-48l-h11-87ae7eb.json"
    variants = read(file, "replay").data["models"]["qwen3-30b-a3b"]["variants"]
    ((_, model, live, *forms, _),) = _rows("replay_json", file)
    assert model == "qwen3-30b-a3b"
    assert live == f"{variants['live_json']['ms']:,.1f} (68.2 %)"
    assert forms == ["712.7 (+10.5 %)", "840.2 (+30.3 %)", "1,123.6 (+74.2 %)", "907.6 (+40.7 %)"]
    # a replay file without the JSON forms has no row in their table
    assert _rows("replay_json", "h100x2-2026-11-25-b907030/replay.json") == []


def test_a_derived_table_leaves_the_notes_to_the_section_it_reads() -> None:
    current = {
        "distribution": [{"file": "h200-2026-11-29-s58/distribution-7b-h11-87ae7eb.json", "note": "NOTED"}]
    }
    page = build.render("{{distribution}}\n\n{{distribution_json}}\n\n{{sources}}\n", current)
    assert page.count("NOTED") == 1


def test_a_full_commit_hash_is_shown_as_its_first_seven_digits() -> None:
    full = "9b90841779f92098acf07949b44c217b7e140667"
    assert [short(full), short(full + "+dirty"), short("047621c")] == ["9b90841", "9b90841+dirty", "047621c"]


def test_a_note_on_a_suite_of_one_model_names_that_model() -> None:
    data = {"suite": "startup", "device": "NVIDIA H200", "model": "qwen3-30b-a3b", "starts": []}
    entry = Entry(Result("s.json", data), None, "a note")
    assert notes([entry]) == ["", "- H200 qwen3-30b-a3b: a note"]

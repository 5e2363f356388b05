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
from benchmarks.page.results import PROVENANCE, RESULTS, PageError, Sources, load, read, stack
from benchmarks.page.tables import SECTIONS, Entry

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

"""CPU smoke tests of the weight-push benchmarks. benchmarks.push: a tiny model pushed over gloo to a
real server, per mode and format, then saved and reloaded (the pushes' scores equal the reload's
bitwise); a trainer that stalls mid-bucket is given up after the group's timeout, and a new group
pushes again; a mixture of experts without the reload. benchmarks.push_soak: scorers through pushes,
every answer equal to its version's canonical scores; its checker fails forged answers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import push, push_soak, soak_check
from tests.benchmarks.page_rows import page_rows
from tests.support import models


@pytest.mark.slow
def test_push_benchmark_runs_end_to_end_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "push.json"
    argv = ["--model", "tiny", "--device", "cpu", "--dtype", "float32", "--backend", "gloo"]
    argv += [
        "--bucket-mib",
        "0.05",
        "--save-dir",
        str(tmp_path),
        "--output",
        str(out),
        "--push-timeout-s",
        "5",
    ]
    assert push.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["push_equals_reload_bitwise"] is True
    stall = report["stall"]
    assert (stall["status"], stall["still_served"], stall["pushed_after"]) == (400, True, True)
    assert 5 <= stall["given_up_s"] < 5 + 15
    runs = report["runs"]
    assert [(r["how"], r["mode"]) for r in runs] == [
        ("push", "swap"), ("push", "swap"), ("push", "copy"), ("push", "copy"),
        ("save_pretrained + reload", "swap"), ("save_pretrained + reload", "copy"),
    ]  # fmt: skip
    assert [r.get("flattened") for r in runs[:4]] == [False, True, False, True]
    assert all(r["push_s"] > 0 and r["pause_ms"] >= 0 for r in runs)
    assert all(r["extra_peak_gib"] is None for r in runs)  # no GPU to watch


def test_buckets_keep_the_order_and_the_limit() -> None:
    named = [(str(i), torch.zeros(n, dtype=torch.uint8)) for i, n in enumerate([3, 4, 9, 1, 1])]
    got = [[name for name, _ in bucket] for bucket in push.buckets(named, 8)]
    assert got == [["0", "1"], ["2"], ["3", "4"]]  # a tensor over the limit goes alone


@pytest.mark.slow
def test_push_benchmark_of_a_mixture_of_experts_without_the_reload_baseline(tmp_path: Path) -> None:
    out = tmp_path / "push.json"
    argv = ["--model", "tiny-moe", "--device", "cpu", "--dtype", "float32", "--backend", "gloo"]
    argv += ["--bucket-mib", "0.05", "--modes", "swap", "--no-reload-baseline", "--push-timeout-s", "5"]
    assert push.main([*argv, "--save-dir", str(tmp_path), "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["push_equals_reload_bitwise"] is None  # nothing reloaded to compare with
    assert [(r["how"], r["mode"], r["flattened"]) for r in report["runs"]] == [
        ("push", "swap", False), ("push", "swap", True),
    ]  # fmt: skip
    assert (report["stall"]["still_served"], report["stall"]["pushed_after"]) == (True, True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["push.json"]  # the one checkpoint, removed


@pytest.mark.slow
def test_the_soak_scores_concurrently_through_pushes_and_checks_every_answer_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    argv = ["--model", "tiny", "--device", "cpu", "--dtype", "float32", "--backend", "gloo"]
    argv += ["--seconds", "6", "--every-s", "2", "--clients", "3", "--probe-tokens", "32", "256"]
    argv += ["--stages", "2"]  # each version pushed by two pipeline stages, a group each, at once
    assert push_soak.main([*argv, "--bucket-mib", "0.05", "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    settings = report["settings"]
    assert (report["suite"], settings["mode"], settings["stages"]) == ("push_soak", "swap", 2)
    assert (report["ok"], report["failures"]) == (True, [])
    pushes, answers = report["pushes"], report["answers"]
    assert (pushes["done"], pushes["failed"]) == (2, 0)  # at 2 s and 4 s of 6
    assert [p["version"] for p in pushes["each"]] == ["soak-1", "soak-2"]
    assert all(p["applies"] == 1 and 0 < p["push_s"] <= p["call_s"] for p in pushes["each"])
    assert (answers["errors"], answers["mismatched"], answers["unknown_version"], answers["unchecked"]) == (
        0, 0, 0, 0,
    )  # fmt: skip
    assert set(answers["per_version"]) <= {"soak-0", "soak-1", "soak-2"}
    assert answers["checked"] == sum(answers["per_version"].values()) > 20
    pause = report["pause"]
    assert (pause["max_ms"], pause["target_ms"]) == (max(p["pause_ms"] for p in pushes["each"]), 50)
    for window in ("during_pushes", "between_pushes"):
        scoring = report["scoring"][window]
        assert min(scoring["answers"], scoring["tokens_per_s"]) > 0  # scoring went on during pushes
        assert 0 < scoring["latency_ms_p50"] <= scoring["latency_ms_max"]
    ((_, model, backend, mode, done, _, pause_cells, answers_cells, wrong, _, ok, _),) = page_rows(
        "push_soak", out
    )
    assert (model, backend, mode, done, wrong, ok) == (
        "tiny",
        "gloo",
        "swap, flattened, 2 stages",
        "2 (0)",
        "0 / 0 / 0 / 0",
        "yes",
    )
    assert pause_cells.endswith("(≤ 50)")
    assert answers_cells == f"{answers['checked']:,} ({len(answers['per_version'])})"


def test_pipeline_stages_hold_their_layers_and_every_tensor_once() -> None:
    model = models.build("qwen2", seed=0, num_hidden_layers=3)
    named = [name for name, _ in model.named_parameters()]
    parts = [[name for name, _ in part] for part in push_soak.stage_tensors(model, 2)]
    assert sorted(parts[0] + parts[1]) == sorted(named)
    assert {n.split(".")[2] for n in parts[0] if ".layers." in n} == {"0", "1"}  # layer k on stage k * 2 // 3
    assert {n.split(".")[2] for n in parts[1] if ".layers." in n} == {"2"}
    assert "model.embed_tokens.weight" in parts[0]
    assert [n for n in parts[1] if ".layers." not in n] == ["model.norm.weight"]  # its head is tied
    assert [[n for n, _ in part] for part in push_soak.stage_tensors(model, 1)] == [named]


def test_a_push_run_counts_the_gpus_it_holds() -> None:
    one, two = (
        push.parser().parse_args(["--trainer-gpu", "0", "--server-gpu", "0"]),
        push.parser().parse_args([]),
    )
    assert (push.gpus(one), push.gpus(two)) == (1, 2)  # trainer and server on one GPU; on GPUs 0 and 1


def probe(index: int, version: str, rows: soak_check.Rows, status: int = 200) -> soak_check.Answer:
    return soak_check.Answer(index, 0.0, 1.0, status, version if status == 200 else None, rows, 10)


def test_the_soak_check_fails_an_answer_whose_scores_differ_from_its_versions() -> None:
    checker = soak_check.Checker()
    for version in ("soak-0", "soak-1"):
        checker.pushed(version)
    checker.know("soak-0", [(b"a0", b"b0"), (b"c0",)])
    checker.add(probe(0, "soak-0", (b"a0", b"b0")))
    checker.add(probe(1, "soak-1", (b"c1",)))  # its canonical scores come later
    checker.add(probe(0, "soak-1", (b"a1", b"b0")))  # one row on the old weights: a mixed answer
    checker.know("soak-1", [(b"a1", b"b1"), (b"c1",)])
    verdict = checker.finish()
    assert verdict.checked == {"soak-0": 1, "soak-1": 1}
    assert verdict.mismatched == [
        "probe 0 on 'soak-1': rows [1] differ from its canonical scores (2 rows, 2 canonical)"
    ]
    assert not verdict.ok


def test_the_soak_check_fails_errors_unknown_versions_unchecked_answers_and_alike_versions() -> None:
    def error(c: soak_check.Checker) -> list[str]:
        c.add(probe(0, "soak-0", (), status=503))
        return c.finish().errors

    def unknown(c: soak_check.Checker) -> list[str]:
        c.add(probe(0, "soak-9", (b"a0",)))  # never pushed
        return c.finish().unknown

    def unchecked(c: soak_check.Checker) -> dict[str, int]:
        c.pushed("soak-1")
        c.add(probe(0, "soak-1", (b"a1",)))  # its canonical scores never come
        return c.finish().unchecked

    def alike(c: soak_check.Checker) -> list[str]:
        c.pushed("soak-1")
        c.know("soak-1", [(b"a0",)])  # as soak-0's: an answer on either would pass for the other
        return c.finish().errors

    for case in (error, unknown, unchecked, alike):
        checker = soak_check.Checker()
        checker.pushed("soak-0")
        checker.know("soak-0", [(b"a0",)])
        checker.add(probe(0, "soak-0", (b"a0",)))
        assert checker.finish().ok, case.__name__  # nothing wrong before
        assert case(checker), case.__name__
        assert not checker.finish().ok, case.__name__


def test_the_soak_timeline_splits_answers_between_pushes_and_outside() -> None:
    push_window = soak_check.PushWindow("soak-1", 2.0, 3.0, 0.9, 0.001, 1)

    def answer(sent: float, answered: float) -> soak_check.Answer:
        return soak_check.Answer(0, sent, answered, 200, "soak-1", (), 100)

    answers = [answer(0.0, 0.5), answer(0.5, 1.5), answer(1.8, 2.2), answer(2.2, 2.4), answer(2.9, 3.6)]
    got = soak_check.timeline(answers, [push_window], 0.0, 4.0)
    during, between = got["during_pushes"], got["between_pushes"]
    assert (during["seconds"], between["seconds"]) == (1.0, 3.0)
    assert (during["answers"], between["answers"]) == (2, 3)  # answered at 2.2 and 2.4 within [2, 3]
    assert (during["answers_per_s"], between["answers_per_s"]) == (2.0, 1.0)
    assert (during["tokens_per_s"], between["tokens_per_s"]) == (200.0, 100.0)
    # in flight during the push: 1.8-2.2, 2.2-2.4, 2.9-3.6 (400, 200, 700 ms); outside: 500, 1000 ms
    assert during["latencies"] == 3
    assert (during["latency_ms_p50"], during["latency_ms_max"]) == pytest.approx((400, 700))
    assert (between["latency_ms_p50"], between["latency_ms_max"]) == pytest.approx((750, 1000))
    # gaps between answers: 0.5-1.5 (outside), 1.5-2.2, 2.2-2.4, 2.4-3.6 (overlapping the push)
    assert (during["longest_gap_ms"], between["longest_gap_ms"]) == pytest.approx((1200, 1000))

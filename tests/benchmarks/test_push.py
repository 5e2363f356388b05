"""CPU smoke test of the weight-push benchmark: a tiny model pushed over gloo to a real server, per
mode and format, then saved and reloaded (the pushes' scores equal the reload's bitwise); a trainer
that stalls mid-bucket is given up after the group's timeout, and a new group pushes again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import push


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
        "10",
    ]
    assert push.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["push_equals_reload_bitwise"] is True
    stall = report["stall"]
    assert (stall["status"], stall["still_served"], stall["pushed_after"]) == (400, True, True)
    assert 10 <= stall["given_up_s"] < 10 + 15
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

"""examples/push_loop.py against a real replica (tests/support/pushing.py): each step's weights serve
once pushed, and the replica's scores of the rollout, pinned to them, equal the trainer's own forward
of the weights it just trained; the old log-probs it trained against were the previous step's."""

from __future__ import annotations

import json

import pytest

from examples import push_loop
from tests.support.pushing import ADMIN, Replicas, version


def test_three_steps_each_pushed_and_scored_pinned(
    push_replicas: Replicas, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = push_replicas.checkpoints["policy"]
    argv = ["--url", push_replicas.main, "--admin-key", ADMIN, "--model", str(policy), "--backend", "gloo"]
    assert push_loop.main([*argv, "--steps", "3", "--lr", "0.05"]) == 0
    steps = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [s["version"] for s in steps] == ["step-1", "step-2", "step-3"]
    for s in steps:
        assert s["max_abs_diff"] < 1e-4, s
        assert s["moved"] > 1e-2, s
        assert s["bytes"] > 0
    assert version(push_replicas.main) == "step-3"

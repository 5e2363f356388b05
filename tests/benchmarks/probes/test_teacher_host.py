"""benchmarks.probes.teacher_host: InstantEngine answers the completions path as PackedScorer's host copy
does (each row's K ids distinct, the action's rank and log-prob those of its slot where it is among
them), and the benchmark runs end to end on a small call, over HTTP from both clients."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from benchmarks.probes import teacher_host
from benchmarks.probes.host_path import VOCAB, InstantEngine
from service.http.completions.plan import plan_completion
from service.http.completions.schemas import CompletionRequest
from service.normalise import ModelLimits


def test_instant_engine_answers_every_position_as_the_head_does() -> None:
    engine = InstantEngine()
    body = teacher_host.teacher_body(3, 200, 20, engine.info.model)
    limits = ModelLimits(vocab_size=VOCAB, max_sequence_tokens=4096, max_top_logprobs=100)
    plan = plan_completion(CompletionRequest.model_validate(body), limits, engine.info.model, 100)
    scores = engine.launch(plan.jobs).result()
    among = 0
    for job, s in zip(plan.jobs, scores, strict=True):
        assert s.top_ids is not None
        assert s.top_logprobs is not None
        assert s.ranks is not None
        assert s.drawn is not None  # shows_text: the plan draws
        assert s.top_ids.shape == (job.actions.shape[0], 20)
        assert all(len(set(row)) == 20 for row in s.top_ids.tolist())
        assert (np.diff(s.top_logprobs, axis=1) <= 0).all()
        tokens = job.targets
        rows = np.arange(tokens.shape[0])
        inside = s.ranks <= 20
        slot = np.minimum(s.ranks, 20) - 1
        np.testing.assert_array_equal(s.top_ids[rows, slot][inside], tokens[inside])
        np.testing.assert_array_equal(s.logprobs[inside], s.top_logprobs[rows, slot][inside])
        assert not (s.top_ids[~inside] == tokens[~inside, None]).any()
        assert (s.logprobs[~inside] < s.top_logprobs[~inside, -1]).all()
        among += int(inside.sum())
    assert 0.5 < among / sum(int(j.actions.shape[0]) for j in plan.jobs) < 0.7


def test_a_small_teacher_call_runs_end_to_end(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--prompts", "2", "--tokens", "300", "--k", "5", "--reps", "1"]
    assert teacher_host.main(argv) == 0
    out: dict[str, Any] = json.loads(capsys.readouterr().out)
    size = out["stages_ms"]["answer_mb"] * 1e6
    for client in ("subprocess", "in_process"):
        call = out["http"][client]
        assert call["ms"] > call["headers_ms"] > 0
        assert abs(call["bytes"] - size) < 0.01 * size  # the same call's answer (the engine's numbers vary)

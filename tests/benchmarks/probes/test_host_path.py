"""benchmarks.probes.host_path with top_logprobs: InstantEngine's answer goes through the engine's own
collect, and a framed round reads back, as logprobd's client reads it, the engine's ids and log-probs
at every action of every row."""

from __future__ import annotations

import time

import numpy as np

from benchmarks.probes.host_path import VOCAB, InstantEngine, _Timed, bodies_of, client_read
from benchmarks.workload import Sample
from service.answer.layout import answer
from service.core.jobs import SequenceJob
from service.normalise import ModelLimits, normalise
from service.wire.arrays import parse_frame, to_frame


def test_a_framed_round_with_top_logprobs_reads_back_the_engines_blocks() -> None:
    rng = np.random.default_rng(0)
    samples = [
        Sample(prompt=rng.integers(0, VOCAB, 5).tolist(), response=rng.integers(0, VOCAB, n).tolist())
        for n in (3, 7, 1, 4, 2, 6, 5, 8)
    ]
    engine = InstantEngine()
    limits = ModelLimits(vocab_size=VOCAB, max_sequence_tokens=64)
    for body in bodies_of(samples, True, 6):
        plan = normalise(parse_frame(body), limits)
        scores = engine.launch(plan.jobs).result()
        got = client_read(to_frame(answer(plan, scores, engine.info, {"policy": "initial"})))
        assert got.top_ids is not None
        assert got.top_logprobs is not None
        for row, s, job in zip(got.top_ids, scores, plan.jobs, strict=True):
            assert s.top_ids is not None
            assert row.shape == (job.actions.shape[0], 6)
            assert row.tolist() == s.top_ids.tolist()
        for block, s in zip(got.top_logprobs, scores, strict=True):
            assert s.top_logprobs is not None
            np.testing.assert_array_equal(block, s.top_logprobs)


def test_a_simulated_device_runs_one_micro_batch_at_a_time() -> None:
    """device_ms: each micro-batch's scores ready that long after the previous one's (the device is
    busy until then), so the second of two launched at once is ready one device time after the first,
    and its scores are not given before."""
    engine = InstantEngine(device_ms=60)
    job = SequenceJob(np.arange(8, dtype=np.int64), np.arange(4, 8, dtype=np.int64), 1.0, False)
    began = time.perf_counter()
    first, second = engine.launch([job]), engine.launch([job])
    assert isinstance(first, _Timed)
    assert isinstance(second, _Timed)
    assert abs(second.ready_at - first.ready_at - 0.060) < 1e-9
    assert first.ready_at - began >= 0.060
    (scores,) = second.result()
    assert time.perf_counter() >= second.ready_at
    assert scores.logprobs.shape == (4,)

"""The engine's launch/collect split: micro-batches queued back to back each get their own scores,
and a launch queues the work without waiting for the device (on CUDA)."""

from __future__ import annotations

import dataclasses
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from service.core.jobs import SequenceJob
from service.engine.scorer.engine import PackedScorer
from tests.support import models
from tests.support.device import TOLERANCE, TOLERANCES, eager, settings_for
from tests.support.reference import expected

pytestmark = pytest.mark.parity  # make test-gpu runs it again on cuda in each dtype


def _jobs(seed: int, lengths: tuple[int, ...] = (9, 23, 40)) -> list[SequenceJob]:
    rng = random.Random(seed)
    return [
        SequenceJob(
            tokens=np.asarray([rng.randrange(3, models.VOCAB) for _ in range(n)], dtype=np.int64),
            actions=np.arange(n // 2, n, dtype=np.int64),
            temperature=1.0,
            return_entropy=True,
        )
        for n in lengths
    ]


def _want(path: Path, jobs: list[SequenceJob]) -> list[list[float]]:
    request = {
        "input_ids": [job.tokens.tolist() for job in jobs],
        "num_actions": [len(j.actions) for j in jobs],
    }
    return expected(eager(path), request).logprobs


@pytest.fixture(scope="module")
def engine(model_dirs: dict[str, Path]) -> PackedScorer:
    scorer = PackedScorer.from_config(settings_for(model_dirs["qwen2"]).engine_config())
    scorer.warm_up()
    return scorer


def test_micro_batches_launched_back_to_back_keep_their_own_scores(
    engine: PackedScorer, model_dirs: dict[str, Path]
) -> None:
    first_jobs, second_jobs = _jobs(1), _jobs(2, (31, 7))
    first = engine.launch(first_jobs)
    second = engine.launch(second_jobs)  # queued behind the first before either is collected
    got_second, got_first = second.result(), first.result()  # collected out of order
    for got, jobs in ((got_first, first_jobs), (got_second, second_jobs)):
        want = _want(model_dirs["qwen2"], jobs)
        assert len(got) == len(jobs)
        for scores, job, w in zip(got, jobs, want, strict=True):
            assert scores.logprobs.shape == (len(job.actions),)
            assert scores.entropy is not None
            assert scores.entropy.shape == (len(job.actions),)
            np.testing.assert_allclose(scores.logprobs, w, atol=TOLERANCE)


def test_results_are_independent_of_later_launches(engine: PackedScorer) -> None:
    """A collected answer does not alias the host buffers a later micro-batch fills."""
    jobs = _jobs(3)
    scores = engine.score(jobs)
    kept = [s.logprobs.copy() for s in scores]
    for seed in range(4, 8):
        engine.score(_jobs(seed))
    for s, k in zip(scores, kept, strict=True):
        np.testing.assert_array_equal(s.logprobs, k)


@pytest.fixture(scope="module")
def cuda_engine(model_dirs: dict[str, Path]) -> PackedScorer:
    """On cuda in bf16 (float32 attention is the per-sequence SDPA fallback, which reads the
    boundaries on the host)."""
    scorer = PackedScorer.from_config(
        settings_for(model_dirs["qwen2"], device="cuda", dtype="bfloat16").engine_config()
    )
    scorer.warm_up()
    return scorer


@pytest.mark.gpu
@pytest.mark.parametrize("asks", ["log-probs", "teacher"])
def test_launch_returns_while_the_device_is_still_busy(
    cuda_engine: PackedScorer, model_dirs: dict[str, Path], asks: str
) -> None:
    """Nothing in a launch waits for the device: not the plain scoring, nor a teacher's asks (top-K
    at every position and a draw one past the last token), whose head copies which rows draw."""
    jobs = _jobs(9)
    if asks == "teacher":
        jobs = [
            dataclasses.replace(j, actions=np.arange(1, j.num_tokens + 1), top_logprobs=5, draw_seed=3)
            for j in jobs
        ]
        cuda_engine.launch(jobs).result()  # the head's kernels compiled first (Triton compiles on the host)
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # type: ignore[no-untyped-call]  # ~1 s of GPU clock cycles on the stream
    start = time.perf_counter()
    launched = cuda_engine.launch(jobs)  # packing, copies to the device, kernels: all queued behind the sleep
    took = time.perf_counter() - start
    assert launched.done is not None
    assert not launched.done.query()  # type: ignore[no-untyped-call]
    assert took < 0.3
    got = launched.result()
    if asks == "teacher":
        assert all(s.drawn is not None and s.top_ids is not None for s in got)
        return
    for scores, w in zip(got, _want(model_dirs["qwen2"], jobs), strict=True):
        np.testing.assert_allclose(scores.logprobs, w, atol=TOLERANCES["bfloat16"])


class _GemmShapes(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """The (op, operand shapes) of every matrix product run under it."""

    OPS = frozenset({"linear", "matmul", "mm", "addmm", "addmm_", "bmm", "mv", "addmv", "dot"})

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.seen: set[tuple[str, tuple[tuple[int, ...], ...]]] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if name in self.OPS:
            shapes = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
            self.seen.add((name, shapes))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("decoder", ["fused", "transformers"])
def test_the_warm_up_meets_every_gemm_shape_a_micro_batch_takes(
    model_dirs: dict[str, Path], decoder: str
) -> None:
    scorer = PackedScorer.from_config(
        settings_for(
            model_dirs["qwen2"], max_batch_tokens=384, logits_chunk_rows=256, decoder=decoder
        ).engine_config()
    )
    with _GemmShapes() as met:
        scorer.meet_shapes()
    rng = random.Random(11)
    with _GemmShapes() as scoring:
        for _ in range(12):
            lengths: list[int] = []
            while sum(lengths) < 200:
                lengths.append(rng.randrange(4, 90))
            scorer.score(_jobs(rng.randrange(1000), tuple(lengths)))
    assert scoring.seen
    assert scoring.seen <= met.seen, scoring.seen - met.seen

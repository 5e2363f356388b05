"""The prefix cache on a GPU in bfloat16 (marked gpu; `make test-gpu`, or on the GPU host
`python -m pytest tests/engine/cache/test_gpu.py -m gpu`): the CUDA graphs write the pools through
their static index while the fast attention kernel reads gathered cached keys; split GRPO groups
score within bf16 noise of the same engine with the cache off, their cached tokens exact; and in
batch-invariant mode the bits are the same with and without hits."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from service.batcher import Batcher, Scored
from service.core.cache_plan import BLOCK
from service.core.jobs import SequenceJob
from service.engine.decoder.graphs import GraphedDecoder
from service.engine.scorer.engine import PackedScorer
from service.metrics import Metrics
from service.settings import Settings
from tests.support import models

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return models.save("qwen2", tmp_path_factory.mktemp("gpu-cache") / "qwen2", max_position_embeddings=4096)


def _groups(seed: int, count: int, samples: int) -> list[list[SequenceJob]]:
    """Request s holds sample s of every group (a GRPO group split over trainer ranks)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, models.VOCAB, int(rng.integers(300, 700))) for _ in range(count)]
    out = []
    for s in range(samples):
        jobs = []
        for prompt in prompts:
            response = np.concatenate(([3 + s], rng.integers(3, models.VOCAB, int(rng.integers(20, 120)))))
            tokens = np.concatenate((prompt, response)).astype(np.int64)
            jobs.append(SequenceJob(tokens, np.arange(prompt.shape[0], tokens.shape[0]), 1.0, True))
        out.append(jobs)
    return out


def _scored_in_turn(
    engine: PackedScorer, settings: Settings, requests: list[list[SequenceJob]]
) -> list[Scored]:
    async def main() -> list[Scored]:
        batcher = Batcher.from_settings(engine, settings, Metrics())
        batcher.start()
        try:
            return [await batcher.score(jobs) for jobs in requests]
        finally:
            await batcher.stop()

    return asyncio.run(main())


def _engine(path: Path, **extra: Any) -> tuple[PackedScorer, Settings]:
    settings = Settings(model=path, device="cuda", dtype="bfloat16", max_batch_tokens=4096, **extra)
    engine = PackedScorer.from_config(settings.engine_config())
    engine.warm_up()
    assert engine.prefix_cache is not None
    return engine, settings


def test_split_groups_read_the_cache_within_bf16_noise_of_computing_them(qwen2: Path) -> None:
    engine, settings = _engine(qwen2)
    requests = _groups(0, 6, 4)
    on = _scored_in_turn(engine, settings, requests)
    engine.flush_cache()
    off = _scored_in_turn(engine, settings.model_copy(update={"prefix_cache": False}), requests)
    for s, (got, want) in enumerate(zip(on, off, strict=True)):
        prompts = sum(int(job.actions[0]) // BLOCK * BLOCK for job in requests[s])
        assert got.cached_tokens == (0 if s == 0 else prompts)
        assert want.cached_tokens == 0
        diffs = np.concatenate(
            [np.abs(a.logprobs - b.logprobs) for a, b in zip(got.scores, want.scores, strict=True)]
        )
        assert float(diffs.mean()) < 0.02
        assert float(diffs.max()) < 0.25
    forward = engine.served.policy.forward
    if isinstance(forward, GraphedDecoder) and forward.disabled is None:
        assert forward.graphs > 0  # micro-batches that only wrote the pool replayed graphs


def test_batch_invariant_bits_with_and_without_hits(qwen2: Path) -> None:
    engine, settings = _engine(qwen2, batch_invariant=True)
    requests = _groups(1, 4, 3)
    hits = _scored_in_turn(engine, settings, requests)
    assert hits[-1].cached_tokens > 0
    engine.flush_cache()
    cold = _scored_in_turn(engine, settings.model_copy(update={"prefix_cache": False}), requests)
    for got, want in zip(hits, cold, strict=True):
        for a, b in zip(got.scores, want.scores, strict=True):
            assert a.logprobs.tobytes() == b.logprobs.tobytes()
            assert a.entropy is not None
            assert b.entropy is not None
            assert a.entropy.tobytes() == b.entropy.tobytes()

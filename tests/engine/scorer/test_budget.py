"""The micro-batch token budget the engine runs and reports: max_batch_tokens as set, else the default
for its policy and device (engine/config.py's batch_budget), which the server's batcher then takes."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import numpy as np
import pytest

from service.batcher import Batcher
from service.core.jobs import SequenceJob
from service.engine.config import BATCH_TOKENS, MOE_BATCH_TOKENS, batch_budget
from service.engine.contract import SHAPE_STEP
from service.engine.scorer.engine import PackedScorer
from service.metrics import Metrics
from service.settings import Settings
from tests.support.device import settings_for
from tests.support.fakes import FakeEngine

pytestmark = pytest.mark.parity  # make test-gpu runs it again on cuda, where a mixture of experts differs


def test_unset_the_budget_is_larger_for_a_mixture_of_experts_on_a_gpu_only() -> None:
    assert (BATCH_TOKENS, MOE_BATCH_TOKENS) == (16384, 24576)
    assert batch_budget(None, moe_on_gpu=False) == BATCH_TOKENS
    assert batch_budget(None, moe_on_gpu=True) == MOE_BATCH_TOKENS
    assert batch_budget(4096, moe_on_gpu=True) == batch_budget(4096, moe_on_gpu=False) == 4096


def test_the_default_graph_limit_holds_every_graph_of_an_moe_policys_default_budget() -> None:
    """Live, shared-prefix, recording and replaying graphs, one each per padded size: past the limit
    the idle time's routed graphs would be dropped and their micro-batches run eagerly."""
    assert Settings().cuda_graph_limit >= 4 * MOE_BATCH_TOKENS // SHAPE_STEP


@pytest.mark.parametrize("architecture", ["qwen2", "qwen3_moe", "mixtral"])
def test_the_engine_reports_the_budget_it_runs(model_dirs: dict[str, Path], architecture: str) -> None:
    config = settings_for(model_dirs[architecture]).engine_config()
    assert config.max_batch_tokens is None
    engine = PackedScorer.from_config(config)
    on_gpu = engine.info.device.startswith("cuda")
    sparse = architecture != "qwen2"
    assert engine.info.max_batch_tokens == (MOE_BATCH_TOKENS if sparse and on_gpu else BATCH_TOKENS)
    assert (engine.info.moe is not None) == sparse
    set_ = PackedScorer.from_config(dataclasses.replace(config, max_batch_tokens=512))
    assert set_.info.max_batch_tokens == 512


def test_the_batcher_takes_the_engines_budget_where_the_setting_is_unset() -> None:
    """A fake engine that runs micro-batches of 8 tokens: three sequences of 5 go one a micro-batch,
    unless max_batch_tokens is set to hold them all."""
    jobs = [
        SequenceJob(np.arange(1, 6, dtype=np.int64), np.arange(2, 5, dtype=np.int64), 1.0, False)
        for _ in range(3)
    ]

    def micro_batches(settings: Settings) -> list[list[int]]:
        engine = FakeEngine()
        engine.info = dataclasses.replace(engine.info, max_batch_tokens=8)

        async def go() -> None:
            batcher = Batcher.from_settings(engine, settings, Metrics())
            batcher.start()
            await batcher.score(jobs)
            await batcher.stop()

        asyncio.run(go())
        return engine.batches

    assert micro_batches(Settings()) == [[5], [5], [5]]
    assert micro_batches(Settings(max_batch_tokens=16)) == [[5, 5, 5]]

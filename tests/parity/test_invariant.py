"""Batch-invariant mode (--batch-invariant): a sequence's scores are bitwise the same however it is
batched, on every architecture of the parity suite (the mixtures of experts in both decoders), in
float32 and bfloat16, on the CPU.

On a GPU (LOGPROBD_TEST_DEVICE=cuda LOGPROBD_TEST_DTYPE=bfloat16) the same cases run on cuda in that
dtype with the fast attention kernel; `-m "not slow"` picks the GPU subset (qwen2, dense, and
qwen3_moe, the fused experts: sharing on vs off, a group split over concurrent requests, chunks
under two budgets, two budgets' replicas, restarts and a reload back), the rest is marked slow there.

On these tiny CPU models the default path happens to be invariant too (the GEMM libraries pick one
kernel for every row count the packing makes); what the mode removes is shown on a GEMM alone, whose
rows do change with the call's shape, and on the GPU by benchmarks.invariance (BENCHMARKS.md).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from service.batcher import Batcher, Scored
from service.core.jobs import SequenceJob, SequenceScores
from service.engine.contract import ReloadOrder
from service.engine.ops import fixed_tile
from service.engine.ops.attention import blocked_kernel
from service.engine.ops.gate_up import quack_available
from service.engine.scorer import build
from service.engine.scorer.engine import PackedScorer
from service.engine.strategies.gemm import GEMM_ROWS, FixedRows
from service.metrics import Metrics
from service.settings import Settings
from tests.engine.strategies.twin import BlockedTiles
from tests.support import critics, models
from tests.support.device import DEVICE, DTYPE, settings_for
from tests.support.servers import running

ON_CPU = DEVICE == "cpu"
DTYPES = ("float32", "bfloat16") if ON_CPU else (DTYPE,)
# on the GPU: the dense decoder and the fused experts; the other architectures are marked slow there
GPU_SUBSET = ("qwen2", "qwen3_moe")


def _gpu_slow(served: str) -> tuple[pytest.MarkDecorator, ...]:
    return () if ON_CPU or served in GPU_SUBSET else (pytest.mark.slow,)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("invariant")
    out = {name: models.save(name, root / name, max_position_embeddings=4096) for name in models.EVERY}
    out["ref"] = models.save("qwen2", root / "ref", seed=7, max_position_embeddings=4096)
    out["critic"] = critics.save("openrlhf", root / "critic")
    return out


def _jobs(seed: int, count: int, low: int, high: int, *, wants: bool = False) -> list[SequenceJob]:
    """`count` random sequences of low..high tokens; `wants`: values and reference log-probs too."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        n = int(rng.integers(low, high))
        tokens = rng.integers(0, models.VOCAB, n).astype(np.int64)
        actions = np.arange(n // 3, n, dtype=np.int64)
        out.append(SequenceJob(tokens, actions, 0.7, True, return_values=wants, return_ref=wants))
    return out


def _score(
    engine: PackedScorer, settings: Settings, batches: list[list[SequenceJob]]
) -> list[list[SequenceScores]]:
    """Each batch a request, all sent at once to the server's batcher."""

    async def main() -> list[list[SequenceScores]]:
        batcher = Batcher.from_settings(engine, settings, Metrics())
        batcher.start()
        try:
            answers = await asyncio.gather(*(batcher.score(b) for b in batches))
            return [a.scores for a in answers]
        finally:
            await batcher.stop()

    return asyncio.run(main())


def _bits(scores: SequenceScores) -> list[bytes]:
    return [
        a.tobytes()
        for a in (scores.logprobs, scores.entropy, scores.values, scores.ref_logprobs)
        if a is not None
    ]


def _engine(path: Path, dtype: str, **extra: Any) -> tuple[PackedScorer, Settings]:
    settings = Settings(
        model=path, device=DEVICE, dtype=dtype, max_batch_tokens=2048, batch_invariant=True, **extra
    )
    engine = PackedScorer.from_config(settings.engine_config())
    engine.warm_up()
    assert engine.info.batch_invariant
    if not ON_CPU and dtype != "float32" and quack_available(torch.device(DEVICE)):
        # one call per GEMM, no padding to 1024 rows, where the fused decoder runs every GEMM over
        # tokens; transformers' own forward (gemma2, phi3, a `/transformers` MoE) keeps 1024-row calls
        fused = engine.info.decoder == "fused"
        assert engine.info.gemm == ("fixed-tiles-quack" if fused else "fixed-rows-1024")
    return engine, settings


def test_blocked_gemms_give_each_row_the_same_bits_whatever_the_row_count() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 256, generator=gen)
    w = torch.randn(384, 256, generator=gen)
    b = torch.randn(384, generator=gen)
    gemm = FixedRows(GEMM_ROWS)
    rows = gemm.rows
    whole = gemm.linear(x, w, b)
    for n in (rows, 2 * rows, 3 * rows):
        assert torch.equal(gemm.linear(x[:n], w, b), whole[:n])
        gated = gemm.by_rows(lambda t: F.silu(F.linear(t, w)), x[:n])
        assert torch.equal(gated, gemm.by_rows(lambda t: F.silu(F.linear(t, w)), x)[:n])
    acc = torch.zeros(2 * rows, 384)
    gemm.accumulate(acc, x[: 2 * rows], w)
    single = torch.zeros(rows, 384)
    gemm.accumulate(single, x[rows : 2 * rows], w)
    assert torch.equal(acc[rows:], single)  # a block's bits do not depend on the blocks before it


SERVED = [*models.EVERY, *(f"{name}/transformers" for name in models.MOE_ARCHITECTURES)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("served", [pytest.param(s, marks=_gpu_slow(s)) for s in SERVED])
def test_a_sequence_scores_the_same_bits_however_it_is_batched(
    dirs: dict[str, Path], served: str, dtype: str
) -> None:
    """`name/transformers`: a mixture of experts in transformers' own modules (moe/transformers_blocks.py)."""
    name, _, decoder = served.partition("/")
    engine, settings = _engine(dirs[name], dtype, decoder=decoder or "auto")
    if name in models.MOE_ARCHITECTURES:
        assert engine.info.decoder == (decoder or "fused")
    target = _jobs(1, 1, 300, 301)[0]
    long = _jobs(2, 1, 3000, 3001)[0]  # past the budget: chunks of 1024 tokens
    others = _jobs(3, 14, 20, 400)
    (alone,), (long_alone,) = _score(engine, settings, [[target], [long]])
    seen = {
        "first": _score(engine, settings, [[target, *others]])[0][0],
        "middle": _score(engine, settings, [[*others[:6], target, *others[6:]]])[0][6],
        "last, split from its request": _score(engine, settings, [[*others, *others, target]])[0][-1],
    }
    concurrent = _score(
        engine, settings, [others[:4], [*others[4:8], target], others[8:], [long, *others[:3]]]
    )
    seen["beside concurrent requests"] = concurrent[1][-1]
    for label, got in seen.items():
        assert _bits(got) == _bits(alone), label
    assert _bits(concurrent[3][0]) == _bits(long_alone), "a long sequence's chunks beside other requests"
    restarted, _ = _engine(dirs[name], dtype, decoder=decoder or "auto")
    assert _bits(_score(restarted, settings, [[target]])[0][0]) == _bits(alone), "after a restart"


@pytest.mark.parametrize("dtype", DTYPES)
def test_values_and_reference_log_probs_too_across_a_reload_back(dirs: dict[str, Path], dtype: str) -> None:
    engine, settings = _engine(dirs["qwen2"], dtype, ref_model=dirs["ref"], critic=dirs["critic"])
    target = _jobs(4, 1, 200, 201, wants=True)[0]
    others = _jobs(5, 10, 20, 250, wants=True) + _jobs(6, 4, 20, 250)
    (alone,) = _score(engine, settings, [[target]])[0]
    assert alone.values is not None
    assert alone.ref_logprobs is not None
    batched = _score(engine, settings, [[*others[:5], target, *others[5:]], others])[0][5]
    assert _bits(batched) == _bits(alone)
    for order in (ReloadOrder("policy", dirs["ref"], "v2"), ReloadOrder("policy", dirs["qwen2"], "v3")):
        engine.apply(engine.stage(order))
    reloaded = _score(engine, settings, [[*others[:3], target]])[0][-1]
    assert _bits(reloaded) == _bits(alone), "after a reload to other weights and back"


@pytest.mark.parametrize(("budget", "length"), [(64, 65), (128, 200), (1024, 1100)])
@pytest.mark.skipif(not ON_CPU, reason="float32 against float32 on the CPU; chunks on a GPU: below")
def test_a_long_sequence_under_a_small_budget_is_scored_in_chunks(
    dirs: dict[str, Path], budget: int, length: int
) -> None:
    """A chunk's packed row is padded to GEMM_ROWS rows whatever the budget, so a store keeps room for
    a whole step of filler past the sequence (it overflowed: a 500 for every chunked length under
    budgets of 64, 128 and 1,024). The chunks' scores equal the mode-off scores of the whole sequence."""
    on = Settings(
        model=dirs["qwen2"], device="cpu", dtype="float32", max_batch_tokens=budget, batch_invariant=True
    )
    engine = PackedScorer.from_config(on.engine_config())
    engine.warm_up()
    target, others = _jobs(4, 1, length, length + 1)[0], _jobs(5, 3, 20, 60)
    (alone,), (beside, *_) = _score(engine, on, [[target], [target, *others]])
    assert _bits(beside) == _bits(alone)
    off = Settings(model=dirs["qwen2"], device="cpu", dtype="float32", max_batch_tokens=4096)
    whole = PackedScorer.from_config(off.engine_config())
    (want,) = whole.score([target])
    np.testing.assert_allclose(alone.logprobs, want.logprobs, atol=1e-4, rtol=0)
    assert alone.entropy is not None
    assert want.entropy is not None
    np.testing.assert_allclose(alone.entropy, want.entropy, atol=1e-4, rtol=0)
    assert not engine._stores  # every chunk's store dropped after its last chunk


# ---- prefix sharing and chunks in the mode (ops/attention.py `invariant`) ---------------------------

# against float32 with the mode off: float32 every score as the parity suite; bfloat16 on average (a
# router's near-tie that bfloat16 flips moves a mixture of experts' score by up to a nat)
BOUND = {"float32": 1e-4, "bfloat16": 0.05}


def _group(seed: int, prompt: int, lengths: list[int]) -> list[SequenceJob]:
    """A GRPO-like group: one prompt, a response of each length; the first two responses share a
    second turn of 24 tokens too (a tree two levels deep). The responses are scored."""
    rng = np.random.default_rng(seed)
    head = rng.integers(0, models.VOCAB, prompt)
    turn = rng.integers(0, models.VOCAB, 24)
    out = []
    for i, n in enumerate(lengths):
        parts = [head, turn] if i < 2 else [head]
        tokens = np.concatenate([*parts, rng.integers(0, models.VOCAB, n)]).astype(np.int64)
        out.append(SequenceJob(tokens, np.arange(prompt, tokens.shape[0], dtype=np.int64), 0.7, True))
    return out


def _scored(engine: PackedScorer, settings: Settings, batches: list[list[SequenceJob]]) -> list[Scored]:
    """_score's answers whole (their computed tokens too)."""

    async def main() -> list[Scored]:
        batcher = Batcher.from_settings(engine, settings, Metrics())
        batcher.start()
        try:
            return list(await asyncio.gather(*(batcher.score(b) for b in batches)))
        finally:
            await batcher.stop()

    return asyncio.run(main())


_OFF: dict[str, list[SequenceScores]] = {}
# the quick cases: a sliding window (qwen2), a soft-cap in the transformers decoder (gemma2), the fused
# experts (qwen3_moe) and transformers' own (mixtral/transformers); the other cases are marked slow
QUICK = {("qwen2", "float32"), ("qwen2", "bfloat16"), ("gemma2", "bfloat16"), ("qwen3_moe", "bfloat16")}
QUICK |= {("mixtral/transformers", "float32")}
if not ON_CPU:
    QUICK = {(served, DTYPE) for served in GPU_SUBSET}
CASES = [
    pytest.param(served, dtype, marks=() if (served, dtype) in QUICK else pytest.mark.slow)
    for served in SERVED
    for dtype in DTYPES
]


@pytest.mark.parametrize(("served", "dtype"), CASES)
def test_shared_prefixes_and_chunks_give_each_sequence_its_bits_alone(
    dirs: dict[str, Path], served: str, dtype: str
) -> None:
    """Sharing on (the grouped form, a group split over concurrent requests among others and in
    another order, a group larger than the budget) and a long sequence in chunks under two budgets:
    every sequence scores the bits it scores alone, unshared and whole; within the parity bound of
    float32 with the mode off."""
    name, _, decoder = served.partition("/")
    engine, settings = _engine(dirs[name], dtype, decoder=decoder or "auto")
    forward = engine.served.policy.forward
    fused = build.fused_of(forward)
    # the experts in one call of every token, not 1024-token blocks (on a GPU: quack's, where installed)
    if fused is not None and fused.sparse and (ON_CPU or engine.info.moe_kernel == "quack"):
        assert all(layer.kernel.row_invariant for layer in fused.sparse_layers)
    if ON_CPU or dtype == "float32":  # either decoder runs it
        assert getattr(fused or forward, "attention", None) is blocked_kernel
        assert engine.info.attention_backend == "blocked"
    else:  # the fast kernel as it is (ops/attention.py `invariant`)
        assert engine.info.attention_backend not in {"sdpa", "blocked"}
    group = _group(7, 150, [40, 90, 20, 130, 60, 75])
    others = _jobs(8, 3, 20, 120)
    long = _jobs(9, 1, 700, 701)[0]
    alone = [engine.score([job])[0] for job in [*group, others[0], long]]
    assert settings.share_prefixes

    def budget(tokens: int) -> Settings:
        return settings.model_copy(update={"max_batch_tokens": tokens})

    grouped = _scored(engine, settings, [group])[0]
    assert grouped.computed_tokens < sum(job.num_tokens for job in group)  # the prompt ran once
    # sharing and the prefix cache off (the engine's cache holds the group by now: the runs below read
    # it, each sequence's bits the same with and without hits)
    apart = settings.model_copy(update={"share_prefixes": False, "prefix_cache": False})
    unshared = _scored(engine, apart, [group])[0]
    assert unshared.computed_tokens == sum(job.num_tokens for job in group)
    split = _scored(
        engine,
        settings,
        [[others[0], group[3], group[1]], [group[5], others[1], group[0]], [group[2], group[4], others[2]]],
    )
    small = _scored(engine, budget(256), [[*others[:2], *group[::-1]]])[0]
    assert sum(job.num_tokens for job in group) - 24 - 5 * 150 > 256  # larger than the budget, shared
    chunked_256 = _scored(engine, budget(256), [[long], group[:3]])
    chunked_512 = _scored(engine, budget(512), [group[3:], [others[0], long]])
    where = ((1, 2), (0, 2), (2, 0), (0, 1), (2, 1), (1, 0))  # group[j] is split[r].scores[i]
    seen = {
        "grouped": grouped.scores,
        "the same batch, sharing off": unshared.scores,
        "split over requests": [split[r].scores[i] for r, i in where],
        "group larger than the budget": small.scores[2:][::-1],
        "beside chunks": chunked_256[1].scores + chunked_512[0].scores,
    }
    for label, scores in seen.items():
        assert [_bits(s) for s in scores] == [_bits(s) for s in alone[:6]], label
    assert _bits(split[0].scores[0]) == _bits(alone[6]), "beside a split group"
    assert _bits(chunked_256[0].scores[0]) == _bits(alone[7]), "in chunks under a budget of 256"
    assert _bits(chunked_512[1].scores[1]) == _bits(alone[7]), "in chunks under a budget of 512"
    if served not in _OFF:
        off = Settings(model=dirs[name], device=DEVICE, dtype="float32", decoder=decoder or "auto")
        reference = PackedScorer.from_config(off.engine_config())
        _OFF[served] = [reference.score([job])[0] for job in [*group, long]]
    got = np.concatenate([s.logprobs for s in [*alone[:6], alone[7]]])
    want = np.concatenate([s.logprobs for s in _OFF[served]])
    error = np.abs(got - want)
    assert (error.max() if dtype == "float32" else error.mean()) <= BOUND[dtype]


REPLICAS = ["qwen3"] if ON_CPU else list(GPU_SUBSET)


@pytest.mark.parametrize("name", REPLICAS)
def test_replicas_with_other_budgets_give_the_same_bits(dirs: dict[str, Path], name: str) -> None:
    """Two servers, --max-batch-tokens 256 and 4096: a long sequence (chunked under one, whole under
    the other) and a shared group score the same bits."""
    group = _group(11, 120, [50, 30, 80])
    long = _jobs(12, 1, 900, 901)[0]
    answers = []
    for tokens in (256, 4096):
        settings = Settings(
            model=dirs[name], device=DEVICE, dtype="bfloat16", max_batch_tokens=tokens, batch_invariant=True
        )
        engine = PackedScorer.from_config(settings.engine_config())
        engine.warm_up()
        answers.append([s for a in _scored(engine, settings, [group, [long]]) for s in a.scores])
    assert [_bits(s) for s in answers[0]] == [_bits(s) for s in answers[1]]


@pytest.mark.skipif(not ON_CPU, reason="on a GPU the cases above run quack's fixed tiles themselves")
@pytest.mark.parametrize(("served", "dtype"), [("qwen2", "float32"), ("qwen3_moe", "bfloat16")])
def test_fixed_tile_gemms_keep_every_case(
    dirs: dict[str, Path], served: str, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mode as it runs where quack does (strategies/gemm.py FixedTiles: one call per GEMM, tokens
    padded to the shape step only), its kernel the CPU twin: the cases above keep their bits."""
    monkeypatch.setattr(fixed_tile, "choose", lambda device, dtype: BlockedTiles())
    engine, _ = _engine(dirs[served], dtype)
    assert engine.info.gemm == "fixed-tiles-blocked-twin"
    test_a_sequence_scores_the_same_bits_however_it_is_batched(dirs, served, dtype)
    test_shared_prefixes_and_chunks_give_each_sequence_its_bits_alone(dirs, served, dtype)


@pytest.mark.skipif(not ON_CPU, reason="the strategy a CPU resolves")
def test_info_says_how_the_gemms_run(dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    with running(settings_for(dirs["qwen2"], batch_invariant=True, dtype="float32")) as client:
        assert client.get("/info").json()["gemm"] == "fixed-rows-1024"
    with running(settings_for(dirs["qwen2"], dtype="float32")) as client:
        assert client.get("/info").json()["gemm"] == "one-call"
    monkeypatch.setattr(fixed_tile, "choose", lambda device, dtype: BlockedTiles())
    with running(settings_for(dirs["qwen2"], batch_invariant=True, dtype="float32")) as client:
        assert client.get("/info").json()["gemm"] == "fixed-tiles-blocked-twin"

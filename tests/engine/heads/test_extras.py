"""What rows ask beyond the log-prob (heads/extras.py) against tests/support/distribution.py's float64
reference: the top K with ties, vLLM's rank, candidates, processed log-probs under every sampler
setting, from the torch path, the fused path's torch twin (logits in, CPU) and the vocabulary-parallel
head; and the seeded draw: the same token however the rows are batched, drawn as often as softmax says.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from service.engine.batch.asks import Extras
from service.engine.heads import chunked
from service.engine.heads.base import ExtraScores, LogitTransform
from service.engine.heads.chunked import score_actions
from service.engine.heads.vocab_parallel import score_actions as sharded_scores
from service.engine.parallel import sharding
from service.engine.parallel.vocab_layers import VocabParallelHead
from tests.engine.parallel.thread_ranks import run_ranks
from tests.support import distribution as ref

VOCAB, HIDDEN = 60, 8
# (top_k, top_p, min_p): off, each alone, combined, and the edges (k = 1, k = V, p = 1, min_p = 0)
SAMPLERS = [
    (0, 1.0, 0.0),
    (5, 1.0, 0.0),
    (0, 0.9, 0.0),
    (0, 1.0, 0.1),
    (7, 0.8, 0.02),
    (1, 1.0, 0.0),
    (VOCAB, 0.5, 0.0),
    (3, 0.3, 0.3),
    (0, 0.999, 0.0),
    (0, 0.05, 0.0),
]


def _case(seed: int, rows: int) -> tuple[torch.nn.Linear, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    torch.nn.init.normal_(head.weight, std=1.0, generator=gen)
    head.weight.data[[4, 11, 12, 30]] = 0.0  # four tokens of equal logits (0) at every row: ties
    hidden = torch.randn(rows, HIDDEN, generator=gen)
    targets = torch.randint(0, VOCAB, (rows,), generator=gen)
    targets[::5] = 11  # a tied token's rank and processed log-prob
    return head, hidden, targets


def _extras(rows: int, top: int, asking: np.ndarray | None = None) -> Extras:
    picked = np.arange(rows) if asking is None else asking
    sampler = [SAMPLERS[i % len(SAMPLERS)] for i in picked]
    return Extras(
        rows=picked,
        index=torch.from_numpy(picked),
        top=top,
        candidates=torch.tensor([[11, 0, 59, 4]] * len(picked)),
        top_k=torch.tensor([s[0] for s in sampler]),
        top_p=torch.tensor([s[1] for s in sampler], dtype=torch.float32),
        min_p=torch.tensor([s[2] for s in sampler], dtype=torch.float32),
        seeds=torch.full((len(picked),), 1234),
        positions=torch.from_numpy(picked + 100),
        most_top_k=max(s[0] for s in sampler),
        least_top_k=min(s[0] for s in sampler),
        any_top_p=True,
    )


def _check(
    extras: Extras, got: ExtraScores | None, logits: np.ndarray, targets: torch.Tensor, t: np.ndarray
) -> None:
    assert got is not None
    for j, row in enumerate(extras.rows):
        k, p, m = SAMPLERS[int(row) % len(SAMPLERS)]
        want = ref.position(
            logits[row], int(targets[row]), temperature=float(t[row]), top=extras.top,
            candidates=[11, 0, 59, 4], top_k=k, top_p=p, min_p=m,
        )  # fmt: skip
        assert got.top_ids is not None
        assert got.top_logprobs is not None
        assert got.candidate_logprobs is not None
        assert got.processed is not None
        np.testing.assert_array_equal(got.top_ids[j].numpy(), want.top_ids)
        np.testing.assert_allclose(got.top_logprobs[j].numpy(), want.top_logprobs, atol=1e-5)
        assert int(got.ranks[j]) == want.rank
        np.testing.assert_allclose(got.candidate_logprobs[j].numpy(), want.candidates, atol=1e-5)
        processed = float(got.processed[j])
        if np.isinf(want.processed):
            assert processed == float("-inf"), (row, processed)
        else:
            assert abs(processed - want.processed) < 1e-5, (row, processed, want.processed)


@pytest.mark.parametrize("top", [1, 10, VOCAB])
@pytest.mark.parametrize("chunk_rows", [1, 7, 64])
@pytest.mark.parametrize("transform", [LogitTransform(), LogitTransform(scale=0.5, softcap=2.0)])
def test_extras_equal_the_float64_reference(top: int, chunk_rows: int, transform: LogitTransform) -> None:
    rows = 23
    head, hidden, targets = _case(top + chunk_rows, rows)
    t = np.asarray([0.7, 1.0, 1.3] * 7 + [1.0, 0.5], dtype=np.float64)
    extras = _extras(rows, top)
    with torch.no_grad():
        got = score_actions(
            hidden=hidden,
            targets=targets,
            inv_temperature=torch.from_numpy(1.0 / t).float(),
            lm_head=head,
            transform=transform,
            chunk_rows=chunk_rows,
            want_entropy=True,
            extras=extras,
        )
        logits = transform(head(hidden).float()).double().numpy()
    _check(extras, got.extras, logits, targets, t)


def test_rows_that_ask_nothing_cost_nothing_and_the_rest_keep_their_rows() -> None:
    """Only rows 2, 3, 9 ask: their extras equal the reference; without Extras none is computed."""
    rows = 12
    head, hidden, targets = _case(5, rows)
    extras = _extras(rows, 4, np.asarray([2, 3, 9]))
    with torch.no_grad():
        got = score_actions(
            hidden=hidden, targets=targets, inv_temperature=None, lm_head=head,
            transform=LogitTransform(), chunk_rows=4, want_entropy=False, extras=extras,
        )  # fmt: skip
        plain = score_actions(
            hidden=hidden, targets=targets, inv_temperature=None, lm_head=head,
            transform=LogitTransform(), chunk_rows=4, want_entropy=False,
        )  # fmt: skip
        logits = head(hidden).double().numpy()
    _check(extras, got.extras, logits, targets, np.ones(rows))
    assert plain.extras is None
    torch.testing.assert_close(got.logprobs, plain.logprobs, atol=0, rtol=0)  # the log-probs untouched


def test_the_fused_paths_twin_gives_the_same_extras() -> None:
    """The fused path computes extras from the chunk's logits (float32 logits: from_float_copy)."""
    rows = 17
    head, hidden, targets = _case(3, rows)
    extras = _extras(rows, 8)
    inv_t = torch.full((rows,), 1 / 0.8)
    with torch.no_grad():
        z = head(hidden)
        parts = chunked.from_float_copy(z, 0, rows, targets, inv_t, LogitTransform(), extras)
    _check(extras, parts[0], z.double().numpy(), targets, np.full(rows, 0.8))


@pytest.mark.parametrize("world", [2, 3])
def test_vocabulary_parallel_extras_equal_the_reference(world: int) -> None:
    rows = 19
    head, hidden, targets = _case(world, rows)
    extras = _extras(rows, 12)
    t = np.full(rows, 0.9)
    weight = head.weight.detach()

    def rank(r: int, shard: sharding.Shard) -> ExtraScores | None:
        start, end = sharding.vocabulary(VOCAB, world, r)
        part = VocabParallelHead(torch.nn.Parameter(weight[start:end].clone()), start, VOCAB, shard)
        with torch.no_grad():
            return sharded_scores(
                hidden=hidden, targets=targets, inv_temperature=torch.full((rows,), 1 / 0.9),
                lm_head=part, transform=LogitTransform(), chunk_rows=6, want_entropy=False, extras=extras,
            ).extras  # fmt: skip

    with torch.no_grad():
        logits = head(hidden).double().numpy()
    every = run_ranks(world, rank)
    for got in every:
        _check(extras, got, logits, targets, t)
        assert got is not None
        assert every[0] is not None
        assert got.drawn is not None
        assert every[0].drawn is not None
        assert torch.equal(got.drawn, every[0].drawn)


def test_draws_depend_on_seed_and_position_only_and_follow_softmax() -> None:
    """One row's distribution, drawn at 4000 (seed, position) pairs: each token's share is within
    5 standard errors of its probability; a draw is the same alone, in a batch, or in other chunks."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 12, generator=gen) * 1.5
    n = 4000
    x = logits.expand(n, -1).contiguous()
    rows = np.arange(n)
    extras = Extras(
        rows=rows, index=torch.from_numpy(rows),
        seeds=torch.arange(n) // 100, positions=torch.arange(n) % 100,
    )  # fmt: skip
    from service.engine.heads import extras as extra

    join = extra.Join(0, 12)
    drawn = extra.score(x, torch.logsumexp(x, 1), torch.zeros(n, dtype=torch.long), extras, join).drawn
    assert drawn is not None
    share = np.bincount(drawn.numpy(), minlength=12) / n
    p = torch.softmax(logits[0].double(), 0).numpy()
    assert np.all(np.abs(share - p) <= 5 * np.sqrt(p * (1 - p) / n) + 1e-3), (share, p)
    alone = extra.score(
        x[7:8], torch.logsumexp(x[7:8], 1), torch.zeros(1, dtype=torch.long), extras.part(7, 8), join
    )
    assert alone.drawn is not None
    assert int(alone.drawn[0]) == int(drawn[7])

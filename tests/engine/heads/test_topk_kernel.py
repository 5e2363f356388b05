"""The radix select over 16-bit logits (heads/topk_kernel.py) and the fused path's extras built on it
(heads/extras_radix.py) against the float32 torch path: extras.keys + torch.topk over the whole
tempered row, and chunked.from_float_copy (extras.score over a float32 copy).

Logits drawn from a few values (many ties, -0.0 beside +0.0), a flat row and random rows. On CPU the
kernels run in Triton's interpreter (tests/engine/interpreter.py); the GPU cases compare the compiled
kernels at Qwen2.5's vocabulary.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import numpy as np
import pytest
import torch

from service.engine.batch.asks import Extras
from service.engine.heads import chunked, extras_radix, topk_kernel
from service.engine.heads import extras as extra
from service.engine.heads.base import ExtraScores, LogitTransform
from service.engine.heads.chunked import score_actions
from tests.engine.interpreter import only_interpreted, run_interpreter_cases


def radix_chunk(  # noqa: PLR0917 (a chunk and what its rows ask, as chunked.from_float_copy takes them)
    z: torch.Tensor,
    start: int,
    end: int,
    targets: torch.Tensor,
    inv_t: torch.Tensor | None,
    transform: LogitTransform,
    extras: Extras,
) -> list[ExtraScores]:
    """The radix path's extras of one chunk of logits z (action rows [start, end)), as score_actions
    collects them over a call of that one chunk."""
    lo, hi = extras.span(start, end)
    radix = extras_radix.Collector(
        extras.part(lo, hi), targets, inv_t, transform.scale, start, end - start, lambda at: z
    )
    radix.chunk_of(z, start, end)
    return radix.done()


VALUES = [-7.0, -1.5, -0.0, 0.0, 0.5, 1.25, 2.0, 3.0]
SCALE = 0.5
# (top_k, top_p, min_p): off, each alone, combined, the edges; top_p < 1 with top_k 0 grows the prefix
Sampler = tuple[int, float, float]
SAMPLERS: list[Sampler] = [
    (0, 1.0, 0.0),
    (50, 0.9, 0.05),
    (0, 0.9, 0.0),
    (0, 1.0, 0.1),
    (7, 0.8, 0.02),
    (1, 1.0, 0.0),
    (10**6, 0.5, 0.0),
    (3, 0.3, 0.3),
    (0, 0.999, 0.0),
    (0, 0.05, 0.0),
]
# every row truncates by rank (0 < top_k < V): the survivors are the W found but for ties past them;
# top_p off the exact boundaries of a run of ties (top_p · ties an integer)
BOUNDED: list[Sampler] = [
    (50, 0.8537, 0.0),
    (7, 0.8, 0.02),
    (1, 1.0, 0.0),
    (3, 0.3, 0.3),
    (64, 0.97, 0.0),
    (30, 0.6231, 0.0),
    (50, 1.0, 0.05),
    (120, 0.4113, 0.001),
]


def logits(rows: int, vocab: int, dtype: torch.dtype, seed: int, device: str = "cpu") -> torch.Tensor:
    """[rows, vocab]: even rows from VALUES (ties everywhere, both zeros), odd rows random, row 2 flat."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, vocab, generator=gen) * 3
    z[::2] = torch.tensor(VALUES)[
        torch.randint(0, len(VALUES), (len(range(0, rows, 2)), vocab), generator=gen)
    ]
    if rows > 2:
        z[2] = 0.0
    return z.to(dtype).to(device)


def tempered(z: torch.Tensor, inv_t: torch.Tensor | None) -> torch.Tensor:
    """x as the torch path makes it: (float(z)·scale)·(1 / T)."""
    x = z.float().mul_(SCALE)
    return x.mul_(inv_t[:, None]) if inv_t is not None else x


def top_ids(x: torch.Tensor, k: int) -> torch.Tensor:
    """[r, k] the torch path's top k: extras.keys (x desc, id asc) and torch.topk."""
    vocab = x.shape[1]
    keys = extra.keys(x, torch.arange(vocab, device=x.device), vocab)
    return extra.decode(torch.topk(keys, k, dim=1).values, vocab)[0]


def ordered(x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """ids [r, W] (-1: none) sorted as the torch path orders them; -1 last."""
    at = ids.long().clamp(min=0)
    keys = extra.keys(x.gather(1, at), at, x.shape[1]).masked_fill(ids < 0, extra.LOWEST)
    return at.gather(1, torch.sort(keys, dim=1, descending=True).indices).masked_fill(
        torch.sort(keys, dim=1, descending=True).values == extra.LOWEST, -1
    )


def check_select(
    z: torch.Tensor, targets: torch.Tensor, inv_t: torch.Tensor | None, ks: list[int], digit: int = 8
) -> None:
    x = tempered(z, inv_t)
    rows = torch.arange(z.shape[0], device=z.device)
    x_target = x.gather(1, targets[:, None])
    for k in ks:
        found = topk_kernel.select(
            z, rows, targets, SCALE, inv_t, k, block=512 if z.shape[1] < 10**5 else 2048, digit=digit
        )
        assert found.ids is not None
        assert found.above is not None
        assert found.tied is not None
        assert found.ids.shape == (z.shape[0], k)
        assert torch.equal(ordered(x, found.ids), top_ids(x, k)), k
        # the K-th value: how many lie above it and how many equal it
        kth = torch.sort(x, dim=1, descending=True).values[:, k - 1 : k]
        assert torch.equal(found.above.long(), (x > kth).sum(1))
        assert torch.equal(found.tied.long(), (x == kth).sum(1))
        assert torch.equal(found.ranks, (x >= x_target).sum(1))  # vLLM's rank: ties count
        want = torch.logsumexp(x.double(), dim=1)
        torch.testing.assert_close(found.shift.double(), want, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_order_keys_follow_the_logits_and_tie_the_zeros(dtype: torch.dtype) -> None:
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    z = bits.view(dtype)
    z = z[~torch.isnan(z)]
    keys = topk_kernel.order_keys(z)
    by_value = torch.argsort(z.float(), stable=True)
    assert bool((keys[by_value].diff() >= 0).all())
    assert torch.equal(keys[by_value].diff() == 0, z.float()[by_value].diff() == 0)  # ties: both zeros only
    zeros = topk_kernel.order_keys(torch.tensor([-0.0, 0.0], dtype=dtype))
    assert int(zeros[0]) == int(zeros[1])


def test_kernel_cases_in_a_fresh_process() -> None:
    run_interpreter_cases(__file__)


@only_interpreted
@pytest.mark.parametrize(("dtype", "digit"), [(torch.bfloat16, 8), (torch.float16, 8), (torch.bfloat16, 4)])
@pytest.mark.parametrize("temperature", [False, True])
def test_interpreter_select_equals_torch_topk(dtype: torch.dtype, digit: int, temperature: bool) -> None:
    """K = 1, 7, past the values above a tied threshold, and V; 3001 columns: a partial last block."""
    rows, vocab = 6, 3001
    z = logits(rows, vocab, dtype, seed=1)
    gen = torch.Generator().manual_seed(2)
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    targets[0] = int((z[0] == 3.0).nonzero()[0, 0])  # a tied target at the top value
    targets[2] = 5  # the flat row: every token ties with it
    inv_t = 1.0 / (0.5 + torch.rand(rows, generator=gen)) if temperature else None
    above_top_value = int((z[0] == 3.0).sum())
    check_select(z, targets, inv_t, [1, 7, above_top_value + 3, vocab], digit)


@only_interpreted
@pytest.mark.parametrize("digit", [8, 4])
def test_interpreter_select_inside_and_past_the_window_below_the_largest_key(digit: int) -> None:
    """The select finds the K-th largest in one histogram of the 2^DIGIT order keys at and below the
    row's largest when they hold K keys; else by the radix passes. Row 0: every logit within 2^4 keys
    of the largest (window); row 1: 40 logits at 100, the rest far below (K > 40: past it); row 2:
    near zero, where order keys crowd (-0 and +0 tie)."""
    vocab = 2500
    gen = torch.Generator().manual_seed(9)
    near = torch.tensor([1.0, 1.0078125, 1.015625, 1.0234375], dtype=torch.bfloat16)  # 4 adjacent keys
    z = torch.empty(3, vocab, dtype=torch.bfloat16)
    z[0] = near[torch.randint(0, 4, (vocab,), generator=gen)]
    z[1] = (-torch.rand(vocab, generator=gen) * 100 - 1).to(torch.bfloat16)
    z[1, torch.randperm(vocab, generator=gen)[:40]] = 100.0
    z[2] = (torch.randn(vocab, generator=gen) * 1e-3).to(torch.bfloat16)
    z[2, :7] = torch.tensor([0.0, -0.0, 0.0, -0.0, 0.0, -0.0, 0.0], dtype=torch.bfloat16)
    targets = torch.tensor([3, int((z[1] == 100.0).nonzero()[0, 0]), 0])
    check_select(z, targets, None, [1, 39, 40, 41, 300, vocab], digit)


@only_interpreted
def test_interpreter_select_per_row_k() -> None:
    rows, vocab = 6, 1500
    z = logits(rows, vocab, torch.bfloat16, seed=3)
    targets = torch.zeros(rows, dtype=torch.long)
    ks = torch.tensor([0, 1, 7, vocab - 1, vocab, 400])
    found = topk_kernel.select(z, torch.arange(rows), targets, SCALE, None, ks, block=512)
    assert found.ids is not None
    assert found.ids.shape == (rows, vocab)
    x = tempered(z, None)
    for row, k in enumerate(ks.tolist()):
        got = ordered(x[row : row + 1], found.ids[row : row + 1])[0]
        assert int((got >= 0).sum()) == k
        assert torch.equal(got[:k], top_ids(x[row : row + 1], k)[0]) if k else True


@only_interpreted
def test_interpreter_select_of_some_rows_of_a_strided_chunk() -> None:
    z = logits(8, 2100, torch.bfloat16, seed=4)
    wide = torch.zeros(8, 2200, dtype=torch.bfloat16)
    wide[:, :2100] = z
    view = wide[:, :2100]  # row stride 2200
    rows = torch.tensor([5, 0, 3])
    found = topk_kernel.select(view, rows, torch.tensor([1, 2, 3]), SCALE, None, 9, block=512)
    assert found.ids is not None
    assert torch.equal(ordered(tempered(z[rows], None), found.ids), top_ids(tempered(z[rows], None), 9))


@only_interpreted
def test_interpreter_mass_sums_the_kept_tokens() -> None:
    rows, vocab = 5, 2500
    z = logits(rows, vocab, torch.float16, seed=5)
    inv_t = torch.tensor([1.0, 2.0, 0.5, 1.3, 0.9])
    x = tempered(z, inv_t)
    shift = torch.logsumexp(x, dim=1)
    floor = torch.tensor([0.0, 1e-4, 1e-3, 0.0, 1e-5])
    at = torch.tensor([0, 10, 20, 30, 40])
    least = topk_kernel.order_keys(z[torch.arange(rows), at])
    least[0] = 0  # every token
    got = topk_kernel.mass(z, torch.arange(rows), SCALE, inv_t, shift, floor, least, block=512)
    p = torch.exp(x.double() - shift[:, None].double())
    kth = torch.where(least > 0, x[torch.arange(rows), at], float("-inf"))
    want = (p * ((p >= floor[:, None].double()) & (x >= kth[:, None]))).sum(1)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def chunk_asks(
    rows: np.ndarray, vocab: int, top: int, device: str = "cpu", samplers: list[Sampler] = SAMPLERS
) -> Extras:
    sampler = [samplers[i % len(samplers)] for i in range(len(rows))]
    gen = torch.Generator().manual_seed(len(rows))
    return Extras(
        rows=rows,
        index=torch.from_numpy(rows).to(device),
        top=top,
        candidates=torch.randint(0, vocab, (len(rows), 5), generator=gen).to(device),
        top_k=torch.tensor([s[0] for s in sampler], device=device),
        top_p=torch.tensor([s[1] for s in sampler], dtype=torch.float32, device=device),
        min_p=torch.tensor([s[2] for s in sampler], dtype=torch.float32, device=device),
        most_top_k=max(s[0] for s in sampler),
        least_top_k=min(s[0] for s in sampler),
        any_top_p=True,
    )


def assert_same_extras(got: ExtraScores, want: ExtraScores) -> None:
    """Ids, ranks and kept decisions exactly; log-probs up to the shift's rounding; processed
    log-probs also up to the kept mass's (a float32 sum of up to V terms in the kernel's order
    against torch's: on a GPU at 152,064 tokens, 6.6e-5 on one row of 500)."""
    assert got.top_ids is not None
    assert want.top_ids is not None
    assert torch.equal(got.top_ids, want.top_ids)
    assert torch.equal(got.ranks, want.ranks)
    for a, b in [(got.top_logprobs, want.top_logprobs), (got.candidate_logprobs, want.candidate_logprobs)]:
        assert a is not None
        assert b is not None
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-6)
    assert got.processed is not None
    assert want.processed is not None
    assert torch.equal(torch.isinf(got.processed), torch.isinf(want.processed))
    torch.testing.assert_close(got.processed, want.processed, atol=1e-4, rtol=1e-6)
    assert got.drawn is None


@only_interpreted
def test_interpreter_draws_beside_the_radix_select_equal_the_float_copy_path() -> None:
    """A prompt's scored positions (top 5 at every row) and one row that also draws, as a completions
    call with max_tokens 1 asks: the other rows stay on the radix select, the drawing rows' draws
    come from their own float32 copy and equal the float copy path's, which serves every row."""
    rows, vocab = 13, 2000
    z = logits(rows, vocab, torch.bfloat16, seed=31)
    gen = torch.Generator().manual_seed(32)
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    inv_t = 1.0 / (0.5 + torch.rand(rows, generator=gen))
    asking = np.arange(1, rows)
    drawing = np.asarray([3, 11])  # into the asking rows: action rows 4 and 12, in two chunks
    seeds = torch.zeros(len(asking), dtype=torch.long)
    seeds[drawing] = torch.tensor([77, 78])
    asks = replace(
        chunk_asks(asking, vocab, 5),
        seeds=seeds,
        positions=torch.arange(len(asking)) + 40,
        drawing=drawing,
    )
    transform = LogitTransform(scale=SCALE)
    calls: list[int] = []
    real = extras_radix.Collector.chunk_of

    def counted(self: extras_radix.Collector, z: torch.Tensor, start: int, end: int) -> None:
        calls.append(start)
        real(self, z, start, end)

    with pytest.MonkeyPatch.context() as patch, torch.no_grad():
        patch.setattr(extras_radix.Collector, "chunk_of", counted)
        got = score_actions(
            hidden=torch.arange(rows, dtype=torch.float32)[:, None], targets=targets,
            inv_temperature=inv_t, lm_head=Stored(z), transform=transform, chunk_rows=4,
            want_entropy=False, fused=True, extras=asks,
        )  # fmt: skip
    assert calls == [0, 4, 8, 12]  # the radix select served every chunk
    want = chunked_reference(z, targets, inv_t, transform, asks, 4)
    assert got.extras is not None
    assert got.extras.drawn is not None
    assert want.drawn is not None
    assert torch.equal(got.extras.drawn[drawing], want.drawn[drawing])
    assert bool((np.delete(got.extras.drawn.numpy(), drawing) == -1).all())
    assert_same_extras(replace(got.extras, drawn=None), replace(want, drawn=None))


@only_interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("top", [1, 10, 2000])
def test_interpreter_fast_extras_equal_the_float_copy_path(dtype: torch.dtype, top: int) -> None:
    """Rows 2..11 of a chunk starting at action row 2 ask (the flat row's top-p prefix grows to V)."""
    vocab = 2000
    z = logits(12, vocab, dtype, seed=top)
    gen = torch.Generator().manual_seed(7)
    targets = torch.randint(0, vocab, (14,), generator=gen)
    targets[2::3] = int((z[0] == 3.0).nonzero()[0, 0])  # tied targets
    inv_t = 1.0 / (0.5 + torch.rand(14, generator=gen))
    asking = np.arange(2, 14)
    asks = chunk_asks(asking, vocab, top)
    transform = LogitTransform(scale=SCALE)
    args = (z, 2, 14, targets, inv_t, transform, asks)
    fast = extra.cat(radix_chunk(*args))  # one ExtraScores per group of asking rows
    assert_same_extras(fast, extra.cat(chunked.from_float_copy(*args)))


@only_interpreted
def test_interpreter_the_target_s_place_among_its_ties() -> None:
    """`before`: the tokens with the target's logit and a lower id (-0 ties +0), every row."""
    rows, vocab = 6, 1800
    z = logits(rows, vocab, torch.bfloat16, seed=40)
    gen = torch.Generator().manual_seed(41)
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    targets[0] = vocab - 1
    out = topk_kernel.Out.empty(rows, z.device)
    topk_kernel.launch(z, torch.arange(rows), targets, SCALE, None, torch.zeros(rows, dtype=torch.int32), out)
    keys = topk_kernel.order_keys(z)
    same = keys == keys.gather(1, targets[:, None])
    want = (same & (torch.arange(vocab)[None, :] < targets[:, None])).sum(1)
    assert torch.equal(out.before.long(), want)
    assert int(want[0]) > 100  # a tied row's last id: most of its ties before it


@only_interpreted
@pytest.mark.parametrize("top", [5, 100])
def test_interpreter_bounded_processed_equals_the_float_copy_path(
    monkeypatch: pytest.MonkeyPatch, top: int
) -> None:
    """Every row truncating by rank: the processed log-probs come from the W found, with no pass for
    the kept mass (the mass kernel never runs) and nothing read back; rows of ties hold survivors
    past the W (row 2 flat: all of them), targets among those ties kept or not by their place."""

    def no_pass(*args: object, **kwargs: object) -> None:
        raise AssertionError("the kept mass needs no pass over the row")

    monkeypatch.setattr(topk_kernel, "mass", no_pass)
    vocab = 2000
    z = logits(12, vocab, torch.bfloat16, seed=50 + top)
    gen = torch.Generator().manual_seed(51)
    targets = torch.randint(0, vocab, (14,), generator=gen)
    asking = np.arange(2, 14)
    asks = chunk_asks(asking, vocab, top, samplers=BOUNDED)
    assert extras_radix.bounded(asks, vocab)
    w = extras_radix.width(asks, vocab)  # 120 found (the largest top_k); ~250 ties of a tied row's largest
    assert w == 120
    # targets among the ties of the row's largest logit (asking row: index among them), past the W
    # found but in row 8
    places = {0: w + 50, 2: w + 1500, 4: -1, 6: w + 100, 8: 5}
    for at, place in places.items():
        ties = (z[at] == z[at].max()).nonzero()[:, 0]
        targets[2 + at] = ties[place]
    inv_t = 1.0 / (0.5 + torch.rand(14, generator=gen))
    args = (z, 2, 14, targets, inv_t, LogitTransform(scale=SCALE), asks)
    fast = extra.cat(radix_chunk(*args))
    want = extra.cat(chunked.from_float_copy(*args))
    assert_same_extras(fast, want)
    assert fast.processed is not None
    kept = torch.isfinite(fast.processed)[[0, 2, 4, 6, 8]].tolist()
    # of the ~134 ties past the W, top_p 0.8537 keeps ~97 (row 0's is the 50th), 0.97 ~127 (row 4's is
    # the last); top_p 1 keeps all (row 2: a flat row, row 6)
    assert kept == [True, True, False, True, True]


@only_interpreted
@pytest.mark.parametrize("top", [1, 100, 700])
def test_interpreter_gathered_top_lists_equal_the_float_copy_path(top: int) -> None:
    """Top lists without a sampler come from the keys gathered at or above each row's bound where
    they fit (random rows) and from the exact selection where they overflow (tied rows, the flat
    row); both equal the float copy path's."""
    vocab = 2000
    z = logits(12, vocab, torch.bfloat16, seed=60 + top)
    gen = torch.Generator().manual_seed(61)
    targets = torch.randint(0, vocab, (14,), generator=gen)
    inv_t = 1.0 / (0.5 + torch.rand(14, generator=gen))
    asks = replace(
        chunk_asks(np.arange(2, 14), vocab, top),
        top_k=None, top_p=None, min_p=None, most_top_k=0, least_top_k=0, any_top_p=False,
    )  # fmt: skip
    args = (z, 2, 14, targets, inv_t, LogitTransform(scale=SCALE), asks)
    counts: list[torch.Tensor] = []
    real = extras_radix._first

    def seen(batch: extras_radix.Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        assert batch.found is not None
        counts.append(batch.found.count > batch.found.ids.shape[1])
        return real(batch)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(extras_radix, "_first", seen)
        fast = extra.cat(radix_chunk(*args))
    want = extra.cat(chunked.from_float_copy(*args))
    over = torch.cat(counts).tolist()
    assert over[1::2] == [False] * 6  # random rows: their candidates fit
    assert all(over[0::2]) or top == 700  # tied rows overflow (at 700, two values' ties may fit)
    assert fast.top_ids is not None
    assert want.top_ids is not None
    assert torch.equal(fast.top_ids, want.top_ids)
    assert torch.equal(fast.ranks, want.ranks)
    for a, b in [(fast.top_logprobs, want.top_logprobs), (fast.candidate_logprobs, want.candidate_logprobs)]:
        assert a is not None
        assert b is not None
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-6)


@only_interpreted
def test_interpreter_score_actions_takes_the_radix_path_for_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    score = extras_radix.score

    def counted(*args: object, **kwargs: object) -> ExtraScores | None:
        calls.append(1)
        return score(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(extras_radix, "score", counted)
    gen = torch.Generator().manual_seed(8)
    head = torch.nn.Linear(16, 700, bias=False).to(torch.bfloat16)
    torch.nn.init.normal_(head.weight, std=0.5, generator=gen)
    hidden = torch.randn(9, 16, generator=gen).to(torch.bfloat16)
    targets = torch.randint(0, 700, (9,), generator=gen)
    asks = chunk_asks(np.asarray([0, 3, 4, 8]), 700, 5)
    run = partial(
        score_actions, hidden=hidden, targets=targets, inv_temperature=torch.full((9,), 1 / 0.8),
        lm_head=head, transform=LogitTransform(), chunk_rows=4, want_entropy=False, extras=asks,
    )  # fmt: skip
    with torch.no_grad():
        fused = run(fused=True)
        monkeypatch.setattr(extras_radix, "usable", lambda z, asks: False)
        copied = run(fused=True)
    assert len(calls) == 3  # chunks [0, 4), [4, 8), [8, 9) each hold asking rows
    assert fused.extras is not None
    assert copied.extras is not None
    assert_same_extras(fused.extras, copied.extras)


def test_float32_logits_and_draws_keep_the_float_copy_path() -> None:
    z = torch.zeros(2, 10)
    rows = np.arange(2)
    asks = Extras(rows=rows, index=torch.from_numpy(rows), top=2)
    assert not extras_radix.usable(z, asks)
    drawing = Extras(rows=rows, index=torch.from_numpy(rows), seeds=torch.zeros(2, dtype=torch.long))
    assert not extras_radix.usable(z.to(torch.bfloat16), drawing)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compiled_select_equals_torch_topk_on_cuda(dtype: torch.dtype) -> None:
    """Qwen2.5's vocabulary, 512 rows, K = 1, 100, 1000 and past a block of ties."""
    rows, vocab = 512, 152064
    z = logits(rows, vocab, dtype, seed=9, device="cuda")
    gen = torch.Generator().manual_seed(10)
    targets = torch.randint(0, vocab, (rows,), generator=gen).cuda()
    inv_t = (1.0 / (0.5 + torch.rand(rows, generator=gen))).cuda()
    check_select(z, targets, inv_t, [1, 100, 1000, int((z[0] == 3.0).sum()) + 5])


@pytest.mark.gpu
@pytest.mark.parametrize("top", [100, 1000])
@pytest.mark.parametrize("samplers", [SAMPLERS, BOUNDED], ids=["samplers", "bounded"])
def test_compiled_fast_extras_equal_the_float_copy_path_on_cuda(top: int, samplers: list[Sampler]) -> None:
    """Bounded: every row truncates by rank, the tied rows' ~19,000 ties of a value past the W found."""
    rows, vocab = 512, 152064
    z = logits(rows, vocab, torch.bfloat16, seed=top, device="cuda")
    gen = torch.Generator().manual_seed(11)
    targets = torch.randint(0, vocab, (rows,), generator=gen).cuda()
    inv_t = (1.0 / (0.5 + torch.rand(rows, generator=gen))).cuda()
    asks = chunk_asks(np.arange(rows), vocab, top, device="cuda", samplers=samplers)
    assert extras_radix.bounded(asks, vocab) == (samplers is BOUNDED)
    args = (z, 0, rows, targets, inv_t, LogitTransform(scale=SCALE), asks)
    fast = extra.cat(radix_chunk(*args))  # one ExtraScores per group of asking rows
    assert_same_extras(fast, extra.cat(chunked.from_float_copy(*args)))


@only_interpreted
def test_interpreter_select_writes_the_values_the_row_max_and_the_picks() -> None:
    """z beside each id, the largest x bitwise the torch path's, z at picked ids; K = 0 rows: threshold 0."""
    rows, vocab = 6, 1800
    z = logits(rows, vocab, torch.bfloat16, seed=12)
    inv_t = torch.tensor([1.0, 1.7, 0.6, 1.1, 2.0, 0.9])
    at = torch.arange(rows)
    found = topk_kernel.select(z, at, at, SCALE, inv_t, 20, block=512)
    assert found.ids is not None
    assert found.values is not None
    assert found.row_max is not None
    assert torch.equal(found.values.view(torch.int16), z[at[:, None], found.ids.long()].view(torch.int16))
    assert torch.equal(found.row_max, tempered(z, inv_t).amax(dim=1))
    picks = torch.randint(0, vocab, (rows, 3), generator=torch.Generator().manual_seed(13))
    out = topk_kernel.Out.empty(rows, z.device)
    out = replace(out, picked=torch.empty(rows, 3, dtype=z.dtype))
    k = torch.tensor([0, 5, 0, 1, 9, 0], dtype=torch.int32)
    out.threshold.fill_(-7)
    topk_kernel.launch(z, at, at, SCALE, inv_t, k, out, picks=picks, block=512)
    assert out.picked is not None
    assert torch.equal(out.picked.view(torch.int16), z.gather(1, picks).view(torch.int16))
    keys = topk_kernel.order_keys(z)
    kth = torch.sort(keys, dim=1, descending=True).values.gather(1, (k.long() - 1).clamp(min=0)[:, None])[
        :, 0
    ]
    assert torch.equal(out.threshold, torch.where(k > 0, kth, 0).to(torch.int32))


@only_interpreted
@pytest.mark.parametrize("vocab", [1800, 1793])  # 8 blocks of 256 (segments of 2), the last one short
def test_interpreter_gather_takes_every_key_at_the_bound_once_across_its_segments(vocab: int) -> None:
    """Candidates: each row's ids with a key at or above its bound (out.threshold), each once, with z
    beside them, whichever of the row's segments read them; count is how many, past the width too."""
    rows, k, width = 6, 7, 48
    z = logits(rows, vocab, torch.bfloat16, seed=14)
    at = torch.arange(rows)
    found = topk_kernel.Candidates.empty(rows, width, z.dtype, z.device)
    out = topk_kernel.Out.empty(rows, z.device)
    ks = torch.full((rows,), k, dtype=torch.int32)
    topk_kernel.launch(z, at, at, SCALE, None, ks, out, found=found, block=256)
    keys = topk_kernel.order_keys(z)
    fits = []
    for r in range(rows):
        want = torch.nonzero(keys[r] >= out.threshold[r]).flatten()
        assert int(found.count[r]) == want.numel() >= k
        if want.numel() > width:  # only the first width taken are written
            taken = found.ids[r].tolist()
            assert len(set(taken)) == width  # each slot written, no id twice
            assert set(taken) <= set(want.tolist())
        else:
            got = found.ids[r, : want.numel()]
            assert sorted(got.tolist()) == want.tolist()
            assert torch.equal(
                found.values[r, : want.numel()].view(torch.int16), z[r, got.long()].view(torch.int16)
            )
            assert found.ids[r, want.numel() :].tolist() == [-1] * (width - want.numel())
        fits.append(want.numel() <= width)
    assert fits == [False, True, False, True, False, True]  # tied rows overflow, random rows fit


class Stored(torch.nn.Module):
    """A head whose logits are given: row i of hidden holds i, and its logits are z[i]."""

    def __init__(self, z: torch.Tensor) -> None:
        super().__init__()
        self.z = z

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.z[hidden[:, 0].long()]


def chunked_reference(  # noqa: PLR0917
    z: torch.Tensor,
    targets: torch.Tensor,
    inv_t: torch.Tensor,
    transform: LogitTransform,
    asks: Extras,
    chunk: int,
) -> ExtraScores:
    parts: list[ExtraScores] = []
    for start in range(0, z.shape[0], chunk):
        end = min(start + chunk, z.shape[0])
        parts += chunked.from_float_copy(z[start:end], start, end, targets, inv_t, transform, asks)
    return extra.cat(parts)


@only_interpreted
@pytest.mark.parametrize("pass_elements", [extra.PASS_ELEMENTS, 3 * 2000])
def test_interpreter_score_actions_over_many_chunks_equals_the_float_copy_path(
    monkeypatch: pytest.MonkeyPatch, pass_elements: int
) -> None:
    """25 rows in chunks of 4; asking rows spread over chunks, chunks [8, 12) and [16, 20) ask
    nothing, the flat row 2 grows its top-p prefix to V (its chunk's logits made again). With
    PASS_ELEMENTS at 3 rows of W, the rows go in groups of 3, finished inside chunks."""
    monkeypatch.setattr(extra, "PASS_ELEMENTS", pass_elements)
    rows, vocab = 25, 2000
    z = logits(rows, vocab, torch.bfloat16, seed=21)
    gen = torch.Generator().manual_seed(22)
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    targets[4::5] = int((z[0] == 3.0).nonzero()[0, 0])  # tied targets
    inv_t = 1.0 / (0.5 + torch.rand(rows, generator=gen))
    asking = np.asarray([0, 2, 3, 5, 6, 7, 13, 14, 20, 21, 22, 23, 24])
    transform = LogitTransform(scale=SCALE)
    made: list[int] = []
    head = Stored(z)
    hook = head.register_forward_hook(lambda module, args, out: made.append(int(args[0][0, 0])))
    for top in (3, 100):
        asks = chunk_asks(asking, vocab, top)
        capped = (
            asks.top_k.clamp(max=50) if asks.top_k is not None else None
        )  # W = max(top, 64): the flat row grows
        asks = replace(asks, top_k=capped, most_top_k=50)
        with torch.no_grad():
            got = score_actions(
                hidden=torch.arange(rows, dtype=torch.float32)[:, None], targets=targets,
                inv_temperature=inv_t, lm_head=head, transform=transform, chunk_rows=4,
                want_entropy=True, fused=True, extras=asks,
            )  # fmt: skip
        assert got.extras is not None
        assert_same_extras(got.extras, chunked_reference(z, targets, inv_t, transform, asks, 4))
    hook.remove()
    assert made.count(0) >= 4  # each call made chunk [0, 4) again: the flat row's prefix grew past W


@pytest.mark.gpu
@pytest.mark.parametrize("top", [100, 1000])
def test_compiled_score_actions_over_many_chunks_equals_the_float_copy_path_on_cuda(top: int) -> None:
    rows, vocab, chunk = 1300, 152064, 512
    z = logits(rows, vocab, torch.bfloat16, seed=top + 1, device="cuda")
    gen = torch.Generator().manual_seed(23)
    targets = torch.randint(0, vocab, (rows,), generator=gen).cuda()
    inv_t = (1.0 / (0.5 + torch.rand(rows, generator=gen))).cuda()
    asking = np.concatenate([np.arange(0, 300), np.arange(1100, 1300)])  # chunk [512, 1024) asks nothing
    asks = chunk_asks(asking, vocab, top, device="cuda")
    transform = LogitTransform(scale=SCALE)
    with torch.no_grad():
        got = score_actions(
            hidden=torch.arange(rows, dtype=torch.float32, device="cuda")[:, None], targets=targets,
            inv_temperature=inv_t, lm_head=Stored(z), transform=transform, chunk_rows=chunk,
            want_entropy=True, fused=True, extras=asks,
        )  # fmt: skip
    assert got.extras is not None
    assert_same_extras(got.extras, chunked_reference(z, targets, inv_t, transform, asks, chunk))
    found = topk_kernel.select(z[:64], torch.arange(64, device="cuda"), targets[:64], SCALE, inv_t[:64], 10)
    assert found.row_max is not None
    assert torch.equal(found.row_max, tempered(z[:64], inv_t[:64]).amax(dim=1))  # the floor's x_max

"""Beyond the log-prob: from a chunk of asking rows' tempered logits, the K most likely tokens, the
target's rank, candidates' log-probs, the log-prob under vLLM's sampler (temperature, then min-p,
top-k, top-p: docs/semantics.md, 'Beyond the log-prob') and a seeded Gumbel-max draw.

Boundary: x [r, w] float32, columns [start, start + w) of the vocabulary for r asking rows, and a
per-row shift with log p = x - shift, in; ExtraScores of those rows out. Under tensor parallel w is
this rank's slice and `Join` holds the collectives: sums (rank, candidates, kept mass, the target's
logit), maxima (row max, the draw) and a gather of each rank's top keys, merged by one more top-k.
All of it is elementwise or a top-k over x; the only sort of a whole row is a top-p whose kept set
outgrows every prefix searched (PREFIX, then 4x or more, up to the vocabulary). The processed
log-prob reads x through `Rows` (prefixes of keys, the row max, a kept mass), so that
heads/extras_radix.py gives it from 16-bit logits without x.

Order: a token's key is its float32 logit's bits mapped to an order-preserving int32, times 2^32,
plus V - 1 - id: one int64 per token, unique, larger for a larger logit and, among equal logits,
for the lower id. torch.topk over keys gives the order the semantics define on any device and
across ranks, and each logit is decoded from its key.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from service.engine.batch.asks import Extras
from service.engine.heads.base import ExtraScores
from service.engine.parallel.sharding import Shard

LOW = 1 << 32
MASK = LOW - 1
SIGN = 0x7FFFFFFF
PREFIX = 64  # the top-p prefix first searched; 4x for rows whose kept set is longer
PASS_ELEMENTS = 1 << 25  # rows x vocabulary of one pass: its int64 keys take 256 MiB at most
LOWEST = torch.iinfo(torch.int64).min
HIGHEST = torch.iinfo(torch.int64).max


@dataclass(frozen=True, slots=True)
class Join:
    """x's place in the vocabulary, and the collectives joining the ranks' slices (shard None: whole)."""

    start: int  # the token id of x's first column
    vocab: int  # the whole vocabulary V
    shard: Shard | None = None

    def sum_(self, x: torch.Tensor) -> None:
        if self.shard is not None:
            self.shard.all_reduce_(x)

    def max_(self, x: torch.Tensor) -> None:
        if self.shard is not None:
            self.shard.all_reduce_max_(x)

    def cat(self, x: torch.Tensor) -> torch.Tensor:
        """[r, n] on every rank -> [r, N·n], the ranks' parts side by side."""
        if self.shard is None:
            return x
        return torch.cat(self.shard.all_gather(x), dim=1)


class Rows(Protocol):
    """The r asking rows' tempered logits x, as the processed log-prob reads them: Full over x itself,
    or heads/extras_radix.py's search of the 16-bit logits."""

    def prefix(self, n: int, pending: torch.Tensor | None) -> torch.Tensor:
        """[p, min(n, V)] the largest keys of each row (pending: of those rows; None: all), largest first."""
        ...

    def row_max(self) -> torch.Tensor:
        """[r] the largest x of each row."""
        ...

    def mass(
        self, shift: torch.Tensor, floor: torch.Tensor, kth: torch.Tensor, kth_key: torch.Tensor
    ) -> torch.Tensor:
        """[r] Σ p = exp(x - shift) over each row's tokens with p >= floor and x >= kth, the logit of
        the token of key kth_key (LOWEST, kth -inf: every token)."""
        ...


@dataclass(frozen=True, slots=True)
class Full:
    """Rows from x [r, w] and its keys k [r, w], the columns of `join`."""

    x: torch.Tensor
    k: torch.Tensor
    join: Join

    def prefix(self, n: int, pending: torch.Tensor | None) -> torch.Tensor:
        return _prefix(take(self.k, pending), n, self.join)

    def row_max(self) -> torch.Tensor:
        x_max = self.x.amax(dim=1)
        self.join.max_(x_max)
        return x_max

    def mass(
        self, shift: torch.Tensor, floor: torch.Tensor, kth: torch.Tensor, kth_key: torch.Tensor
    ) -> torch.Tensor:
        prob = torch.exp(self.x - shift[:, None])
        mass = (prob * ((prob >= floor[:, None]) & (self.x >= kth[:, None]))).sum(dim=1)
        del prob
        self.join.sum_(mass)
        return mass


def passes(extras: Extras, start: int, end: int, vocab: int) -> Iterator[tuple[Extras, slice | torch.Tensor]]:
    """The asking rows among action rows [start, end), in passes of at most PASS_ELEMENTS logits:
    each pass's Extras and the rows it takes from the chunk (a slice where they are consecutive)."""
    lo, hi = extras.span(start, end)
    step = max(1, PASS_ELEMENTS // vocab)
    for a in range(lo, hi, step):
        b = min(a + step, hi)
        first, last = int(extras.rows[a]), int(extras.rows[b - 1])
        rows = (
            slice(first - start, last + 1 - start) if last - first == b - a - 1 else extras.index[a:b] - start
        )
        yield extras.part(a, b), rows


def keys(x: torch.Tensor, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """int64 keys of logits x [...] at token ids [...] (broadcast): order of (x, -id)."""
    bits = (x + 0.0).contiguous().view(torch.int32)  # + 0.0: -0.0 becomes +0.0
    ordered = bits ^ ((bits >> 31) & SIGN)  # int32, increasing with x
    return ordered.long() * LOW + (vocab - 1 - ids)


def decode(k: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, float32 logits) of keys."""
    high = (k >> 32).to(torch.int32)  # arithmetic shift: the signed high half
    bits = high ^ ((high >> 31) & SIGN)
    return vocab - 1 - (k & MASK), bits.view(torch.float32)


def cat(parts: list[ExtraScores]) -> ExtraScores:
    """One ExtraScores from those of consecutive passes."""

    def join(values: list[torch.Tensor | None]) -> torch.Tensor | None:
        return None if values[0] is None else torch.cat([v for v in values if v is not None])

    ranks = join([p.ranks for p in parts])
    assert ranks is not None
    return ExtraScores(
        top_ids=join([p.top_ids for p in parts]),
        top_logprobs=join([p.top_logprobs for p in parts]),
        ranks=ranks,
        candidate_logprobs=join([p.candidate_logprobs for p in parts]),
        processed=join([p.processed for p in parts]),
        drawn=join([p.drawn for p in parts]),
    )


def score(
    x: torch.Tensor,  # [r, w] float32 tempered logits (any per-row shift) of columns start..start+w-1
    shift: torch.Tensor,  # [r] log p = x - shift
    targets: torch.Tensor,  # [r] token ids of the whole vocabulary
    asks: Extras,  # the r rows' asks
    join: Join,
) -> ExtraScores:
    """The r rows' ExtraScores from their logits (every rank calls it with its slice)."""
    width = x.shape[1]
    ids = torch.arange(join.start, join.start + width, device=x.device)
    local = targets - join.start
    mine = (local >= 0) & (local < width)
    x_target = x.gather(1, local.clamp(0, width - 1)[:, None])[:, 0].masked_fill(~mine, 0.0)
    join.sum_(x_target)  # [r] the target's logit, from the rank that holds it
    ranks = (x >= x_target[:, None]).sum(dim=1)  # vLLM's rank: tokens at least as likely
    join.sum_(ranks)
    k = keys(x, ids, join.vocab)  # [r, w]
    top_ids = top_logprobs = candidate_logprobs = processed = drawn = None
    if asks.top:
        top_ids, values = decode(_prefix(k, asks.top, join), join.vocab)
        top_logprobs = values - shift[:, None]
    if asks.candidates is not None:
        where = asks.candidates - join.start
        held = (where >= 0) & (where < width)
        found = x.gather(1, where.clamp(0, width - 1)).masked_fill(~held, 0.0)
        join.sum_(found)
        candidate_logprobs = found - shift[:, None]
    if asks.top_p is not None:
        processed = processed_logprobs(Full(x, k, join), shift, x_target, targets, asks, join.vocab)
    if asks.seeds is not None:
        assert asks.positions is not None
        drawn = draw(x, asks.seeds, asks.positions, ids, join)
    return ExtraScores(top_ids, top_logprobs, ranks, candidate_logprobs, processed, drawn)


def draw(
    x: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, ids: torch.Tensor, join: Join
) -> torch.Tensor:
    """[r] int64 argmax_i (x_i + G_i) of tempered logits x [r, w] (columns `ids`), ties by the lower
    id; Gumbel noise G per (seed, position, id) (docs/semantics.md, Draw)."""
    noisy = keys(x + _gumbel(seeds, positions, ids), ids, join.vocab).amax(dim=1)
    join.max_(noisy)
    return decode(noisy, join.vocab)[0]


def _prefix(k: torch.Tensor, n: int, join: Join) -> torch.Tensor:
    """[r, min(n, V)] the largest keys of each row over the whole vocabulary, largest first."""
    n = min(n, join.vocab)
    local = torch.topk(k, min(n, k.shape[1]), dim=1).values
    if join.shard is None:
        return local
    if local.shape[1] < n:  # a rank with fewer columns than n: pad, so every rank gathers n
        local = torch.nn.functional.pad(local, (0, n - local.shape[1]), value=LOWEST)
    return torch.topk(join.cat(local), n, dim=1).values


def processed_logprobs(  # noqa: PLR0917 (the rows' distribution and their sampler)
    rows: Rows,
    shift: torch.Tensor,
    x_target: torch.Tensor,
    targets: torch.Tensor,
    asks: Extras,
    vocab: int,
) -> torch.Tensor:
    """[r] log-prob of each target under the row's sampler, -inf outside the kept set (vLLM v1:
    min-p on the tempered distribution, then top-k, then top-p on what is left, renormalised)."""
    assert asks.top_k is not None
    assert asks.top_p is not None
    assert asks.min_p is not None
    top_k = torch.where(asks.top_k >= vocab, 0, asks.top_k.clamp(min=0))  # k >= V keeps every token
    top_p, min_p = asks.top_p, asks.min_p
    x_max = rows.row_max()
    floor = min_p * torch.exp(x_max - shift)  # [r] min-p keeps p >= min_p · p_max (vLLM: p < it goes)
    kth = torch.full_like(shift, float("-inf"))  # [r] top-k keeps logits >= the k-th largest (ties kept)
    kth_key = torch.full_like(top_k, LOWEST, dtype=torch.int64)  # [r] the key of the k-th largest
    # one top-k over the keys serves both the k-th largest and top-p's first prefix
    first = None
    if asks.most_top_k or asks.any_top_p:
        first = rows.prefix(max(asks.most_top_k, PREFIX if asks.any_top_p else 0), None)
    if asks.most_top_k:
        assert first is not None
        at = (top_k - 1).clamp(0, min(asks.most_top_k, first.shape[1]) - 1)
        kth_key = torch.where(top_k > 0, first.gather(1, at[:, None])[:, 0], kth_key)
        kth = torch.where(top_k > 0, decode(kth_key, vocab)[1], kth)
    mass = rows.mass(shift, floor, kth, kth_key)  # [r] after min-p, top-k
    logp = x_target - shift
    kept = (torch.exp(logp) >= floor) & (x_target >= kth)
    total = mass
    if asks.any_top_p:
        assert first is not None
        total, last = _top_p(rows, first, shift, floor, kth, top_p * mass, top_p < 1.0, mass, vocab)
        kept &= keys(x_target, targets, vocab) >= last
    out = torch.where(kept, logp - torch.log(total), float("-inf"))
    off = (top_k == 0) & (top_p >= 1.0) & (min_p <= 0.0)
    return torch.where(off, logp, out)  # no sampler: exactly the log-prob


def _top_p(  # noqa: PLR0917
    rows: Rows,
    first: torch.Tensor,  # [r, n] each row's largest keys, largest first (n >= PREFIX, or V)
    shift: torch.Tensor,
    floor: torch.Tensor,
    kth: torch.Tensor,
    goal: torch.Tensor,  # [r] top_p · the mass left by min-p and top-k
    wanted: torch.Tensor,  # [r] bool: top_p < 1
    mass: torch.Tensor,
    vocab: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[r] the kept set's mass and the key of its last token (LOWEST: every survivor kept). A token
    is kept when the survivors before it hold less than `goal` (vLLM drops those whose ascending
    cumulative share is <= 1 - top_p). Searched over the first PREFIX keys of each row, then for
    the rows whose prefix holds less than `goal` a prefix 4x longer or, where the prefix held a small
    share of the goal, twice the length its share suggests, up to the whole vocabulary; a longer
    prefix is searched PASS_ELEMENTS keys at a time."""
    total = mass.clone()
    last = torch.full_like(shift, LOWEST, dtype=torch.int64)
    every = torch.arange(shift.shape[0], device=shift.device)
    pending: torch.Tensor | None = None  # rows still searched (None: all)
    n = first.shape[1]
    while True:
        short_rows, shares = [], []
        for part in _groups(pending, max(1, PASS_ELEMENTS // n)):
            top = first if part is None else rows.prefix(n, part)  # [p, n]
            found = survivors(top, take(shift, part), take(floor, part), take(kth, part), vocab)
            goals, want, at = take(goal, part), take(wanted, part), take(every, part)
            total[at], last[at] = found.cut(top, goals, want, take(mass, part))
            reach = found.upto[:, -1]  # the survivors' mass in the prefix
            short = want & (reach < goals)
            short_rows.append(at[short])
            shares.append(goals[short] / reach[short].clamp(min=1e-30))
        if n >= vocab:
            break
        pending = torch.cat(short_rows)
        if not pending.numel():  # the same on every rank: the keys and sums are joined
            break
        # at least 4x; more where the prefix held a small share of the goal (a flat distribution)
        need = float(torch.cat(shares).max())
        n = int(min(vocab, max(4 * n, 2 * n * min(need, float(vocab)))))
    return total, last


@dataclass(frozen=True, slots=True)
class Survivors:
    """Of prefixes [p, n] of rows' largest keys, largest first: the tokens min-p and top-k keep
    (survive), their p, 0 elsewhere (held), and its running sum (upto). A key LOWEST (no token)
    decodes to NaN and never survives."""

    survive: torch.Tensor  # [p, n] bool
    held: torch.Tensor  # [p, n] float32
    upto: torch.Tensor  # [p, n] float32

    def cut(
        self, top: torch.Tensor, goal: torch.Tensor, wanted: torch.Tensor, mass: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-p over the prefixes `top`: [p] the kept mass (`mass` where top_p is 1: not `wanted`)
        and the key of the last token kept (LOWEST: every survivor), a token kept when the survivors
        before it hold less than `goal`."""
        kept = self.survive & (self.upto - self.held < goal[:, None])
        total = torch.where(wanted, (self.held * kept).sum(dim=1), mass)
        last = torch.where(wanted, top.masked_fill(~kept, HIGHEST).amin(dim=1), LOWEST)
        return total, last


def survivors(
    top: torch.Tensor, shift: torch.Tensor, floor: torch.Tensor, kth: torch.Tensor, vocab: int
) -> Survivors:
    """Survivors of prefixes top [p, n] under min-p (p >= floor) and top-k (x >= kth), p = exp(x - shift)."""
    _, values = decode(top, vocab)
    prob = torch.exp(values - shift[:, None])
    survive = (prob >= floor[:, None]) & (values >= kth[:, None])
    held = prob * survive
    return Survivors(survive, held, torch.cumsum(held, dim=1))


def _groups(rows: torch.Tensor | None, size: int) -> list[torch.Tensor | None]:
    """rows in consecutive groups of at most `size` (None: all rows, one group)."""
    if rows is None:
        return [None]
    return [rows[i : i + size] for i in range(0, rows.shape[0], size)]


def take(t: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """t's rows `rows` (None: t itself)."""
    return t if rows is None else t[rows]


GOLDEN = 0x9E3779B9


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """(h · c) mod 2^32 for h < 2^32 in int64, with no product past 2^48."""
    return (h * (c & 0xFFFF) + (((h * (c >> 16)) & 0xFFFF) << 16)) & MASK


def _mix(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32: xor-shift-multiply), on int64 holding 32 bits."""
    h = h & MASK
    h = h ^ (h >> 16)
    h = _mul32(h, 0x7FEB352D)
    h = h ^ (h >> 15)
    h = _mul32(h, 0x846CA68B)
    return h ^ (h >> 16)


def _gumbel(seeds: torch.Tensor, positions: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[r, w] float32 Gumbel noise that depends only on (seed, position, token id): a counter-based
    hash, so a draw does not depend on batching, chunking or ranks."""
    row = _mix(_mix(seeds & MASK) ^ ((seeds >> 32) & MASK))
    row = _mix(row ^ _mix(positions))  # [r]
    salt = _mix(row ^ 0x5BD1E995)
    bits = _mix(_mix(row[:, None] + _mul32(ids, GOLDEN)[None, :]) ^ salt[:, None])  # [r, w]
    uniform = ((bits >> 8).float() + 0.5) * 2.0**-24  # in (0, 1)
    return -torch.log(-torch.log(uniform))

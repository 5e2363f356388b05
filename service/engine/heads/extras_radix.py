"""The extras of the fused head (heads/extras.py's ExtraScores) from 16-bit logits, searched by
heads/topk_kernel.py's radix select, with no [r, V] float32 or int64 tensor.

Boundary: per chunk, z [c, V] bfloat16 / float16 logits and the span of asking rows it holds; the
asking rows' targets, 1 / T and asks once per score_actions call (a `Collector`); ExtraScores out.

Per chunk (`score`), only kernels, writing rows of buffers made once for a group of asking rows (the
micro-batch's, split where rows x W passes extras.PASS_ELEMENTS), with nothing read back to the host:
- the stats kernel: each row's shift (log-sum-exp of x), rank, largest x, and z at its target and
  candidates; then, where no row needs the kept mass summed over its row (`found`), the gather
  kernel: every key at or above a lower bound of the W-th largest, [g, F] (topk_kernel.Candidates),
  the exact selection running only for rows with more than F; else the write kernel: the ids of
  the W largest logits and z at them ([g, W] int32 and 16-bit);
- rows with a sampler, where some row does not truncate by rank (top_k 0 or >= V), also: floor =
  min_p · exp(x_max - shift) (three [r] torch operations, as extras.processed_logprobs computes it),
  the stats kernel over their W values (the top_k-th largest order key) and the mass kernel (Σ p
  kept by min-p and top-k, the one sum needing the whole row). Where every row truncates by rank
  (`bounded`), none of these: the survivors are among the W found but for ties of the top_k-th
  logit past them, which the stats kernel counts (`_bounded_processed`).
Per group, after its last chunk (`finish`), every torch operation on [g, W] ([g, F] to sort the
candidates: `_first`): x from the values with
the torch path's operations ((float(z)·scale)·(1 / T)), keys, one sort, decode, the top list, the
candidates' and targets' logits, and extras.processed_logprobs over the sorted keys (bounded: its
closed form over them, with nothing read back to the host). The logits,
keys and order are bitwise those of extras.score over the whole x (the kernel's order is z's, which
x keeps: topk_kernel.py). Ids and ranks equal that path's exactly; log-probs differ by the shift's
rounding (a float32 online sum, not torch's); the kept mass is the kernel's sum, so the processed
log-probs differ by rounding too. The one step needing z after its chunk is a top-p whose kept set
outgrows the W keys found (a flat row, top_k 0): for those rows `finish` makes their chunk's logits
again (`logits_of`: the same head on the same rows, so the same z) and selects a longer prefix.

Not for: float32 logits, a seeded draw (it adds noise to every logit), a vocabulary split over ranks;
`usable` says so and chunked.py keeps extras.score for them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from service.engine.batch.asks import Extras
from service.engine.heads import extras as extra
from service.engine.heads import topk_kernel
from service.engine.heads.base import ExtraScores
from service.engine.runtime import triton_jit
from service.engine.runtime.copies import to_device


def usable(z: torch.Tensor, asks: Extras) -> bool:
    """True where these kernels can give the asks: 16-bit logits on a device the kernels run on
    (CUDA, or any under Triton's interpreter), no draw."""
    return (
        z.dtype in topk_kernel.SIXTEEN
        and asks.seeds is None
        and (z.is_cuda or triton_jit.interpreting())
        and triton_jit.triton() is not None
    )


def bounded(asks: Extras, vocab: int) -> bool:
    """Every row truncates by rank (0 < top_k < V): the sampler's survivors are among the W found,
    but for ties of the top_k-th logit past them (`_bounded_processed`)."""
    return asks.top_p is not None and asks.least_top_k > 0 and asks.most_top_k < vocab


def width(asks: Extras, vocab: int) -> int:
    """W: the keys selected per row, enough for the top list, top-k's k-th key and top-p's first prefix
    (none where every row truncates by rank: its survivors are the top_k and their ties)."""
    sampler = asks.top_p is not None
    prefix = extra.PREFIX if asks.any_top_p and not bounded(asks, vocab) else 0
    wanted = max(asks.top, asks.most_top_k, prefix, 1 if sampler else 0)
    return min(wanted, vocab)


@dataclass(frozen=True, slots=True)
class Batch:
    """Asking rows [g] of one group and the buffers their chunks write (topk_kernel.Out)."""

    asks: Extras
    chunk: np.ndarray  # [g] host: the first action row of each row's chunk
    local: torch.Tensor  # [g] int64 each row's index in its chunk
    targets: torch.Tensor  # [g] int64
    inv_t: torch.Tensor | None  # [g] float32
    picks: torch.Tensor  # [g, 1 + C] int64 the target and the candidates
    k: torch.Tensor  # [g] int32 W
    scale: float
    vocab: int
    out: topk_kernel.Out  # ids, values [g, W] (with `found`: of the rows it overflowed); picked [g, 1 + C]
    found: topk_kernel.Candidates | None  # [g, F] keys at or above a bound (None: the exact select)
    top_k: torch.Tensor | None  # [g] int32 the sampler's k (0: off; >= V: 0)
    least: topk_kernel.Out | None  # threshold: the top_k-th largest order key of each row
    mass: torch.Tensor | None  # [g] float32
    logits_of: Callable[[int], torch.Tensor]  # a chunk's logits [c, V] again, by its first row
    every: torch.Tensor  # [g] int64 0..g-1
    zeros: torch.Tensor  # [g] int64

    @classmethod
    def make(  # noqa: PLR0917
        cls,
        asks: Extras,
        chunk: np.ndarray,
        targets: torch.Tensor,  # [A]
        inv_temperature: torch.Tensor | None,  # [A]
        scale: float,
        z: torch.Tensor,  # a chunk's logits: their vocabulary, dtype and device
        logits_of: Callable[[int], torch.Tensor],
    ) -> Batch:
        g, vocab, device = len(asks.rows), z.shape[1], z.device
        w = width(asks, vocab)
        own = targets[asks.index]
        picks = own[:, None] if asks.candidates is None else torch.cat([own[:, None], asks.candidates], 1)
        out = dataclasses.replace(
            topk_kernel.Out.empty(g, device),
            ids=torch.full((g, w), -1, dtype=torch.int32, device=device),
            values=torch.empty(g, w, dtype=z.dtype, device=device),
            picked=torch.empty(picks.shape, dtype=z.dtype, device=device),
        )
        top_k = least = mass = None
        if asks.top_p is not None:
            assert asks.top_k is not None
            top_k = torch.where(asks.top_k >= vocab, 0, asks.top_k.clamp(min=0)).to(torch.int32)
            if not bounded(asks, vocab):  # the kept mass needs a pass over each row (`mass`)
                least = topk_kernel.Out.empty(g, device)
                mass = torch.empty(g, dtype=torch.float32, device=device)
        found = None
        if least is None and w > 0:  # no kept mass to sum over the row: the gather serves
            found = topk_kernel.Candidates.empty(g, min(vocab, w + max(w // 2, 64)), z.dtype, device)
        return cls(
            asks=asks,
            chunk=chunk,
            local=to_device(asks.rows - chunk, device),
            targets=own.contiguous(),
            inv_t=None if inv_temperature is None else inv_temperature[asks.index].float(),
            picks=picks.long().contiguous(),
            k=torch.full((g,), w, dtype=torch.int32, device=device),
            scale=scale,
            vocab=vocab,
            out=out,
            found=found,
            top_k=top_k,
            least=least,
            mass=mass,
            logits_of=logits_of,
            every=torch.arange(g, device=device),
            zeros=torch.zeros(g, dtype=torch.int64, device=device),
        )


def score(batch: Batch, z: torch.Tensor, a: int, b: int) -> ExtraScores | None:
    """Rows [a, b) of the batch, all in chunk z [c, V]: its kernels (and a sampler's floor), launched
    with nothing read back to the host. After the batch's last row (b = g): the batch's ExtraScores
    (`finish`); before it, None."""
    inv_t = None if batch.inv_t is None else batch.inv_t[a:b]
    out = batch.out.rows(a, b)
    rows, k = batch.local[a:b], batch.k[a:b]
    found = None if batch.found is None else batch.found.rows(a, b)
    topk_kernel.launch(
        z, rows, batch.targets[a:b], batch.scale, inv_t, k, out, picks=batch.picks[a:b], found=found
    )
    if batch.least is not None and batch.mass is not None and batch.top_k is not None:
        _sampler(batch, z, a, b)
    return finish(batch) if b == len(batch.asks.rows) else None


def _sampler(batch: Batch, z: torch.Tensor, a: int, b: int) -> None:
    """The sampler's per-chunk part of rows [a, b): the kept mass under min-p and top-k (needs z)."""
    assert batch.least is not None
    assert batch.mass is not None
    assert batch.top_k is not None
    inv_t = None if batch.inv_t is None else batch.inv_t[a:b]
    out = batch.out.rows(a, b)
    assert batch.asks.min_p is not None
    assert out.values is not None
    floor = batch.asks.min_p[a:b] * torch.exp(out.row_max - out.shift)  # [r] as processed_logprobs
    # the top_k-th largest order key of a row is that of its W values (top_k <= most_top_k <= W)
    least = batch.least.rows(a, b)
    every = batch.every[: b - a]
    topk_kernel.launch(out.values, every, batch.zeros[a:b], 1.0, None, batch.top_k[a:b], least)
    topk_kernel.mass(
        z, batch.local[a:b], batch.scale, inv_t, out.shift, floor, least.threshold, out=batch.mass[a:b]
    )


def finish(batch: Batch) -> ExtraScores:
    """The batch's ExtraScores from its buffers: the torch work over all its rows at once."""
    out, asks, vocab = batch.out, batch.asks, batch.vocab
    assert out.ids is not None
    assert out.values is not None
    assert out.picked is not None
    first, above, tied = _first(batch)
    x_picked = _tempered(batch, out.picked, None)  # [g, 1 + C]
    x_target = x_picked[:, 0]
    top_ids = top_logprobs = candidate_logprobs = processed = None
    if asks.top:
        top_ids, values = extra.decode(first[:, : asks.top], vocab)
        top_logprobs = values - out.shift[:, None]
    if asks.candidates is not None:
        candidate_logprobs = x_picked[:, 1:] - out.shift[:, None]
    if asks.top_p is not None and batch.mass is None:
        processed = _bounded_processed(batch, first, x_target, above, tied)
    elif asks.top_p is not None:
        rows = Found(batch, first)
        processed = extra.processed_logprobs(rows, out.shift, x_target, batch.targets, asks, vocab)
    return ExtraScores(top_ids, top_logprobs, out.ranks.long(), candidate_logprobs, processed, None)


def _first(batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[g, W] each row's W largest keys, largest first, and the counts of keys above the W-th's
    logit and tied with it ([g] each, the whole row's): from the candidates where they fit (every
    tie of the W-th is among them then), else from the exact selection."""
    out = batch.out
    assert out.ids is not None
    assert out.values is not None
    exact = _sorted_keys(batch, out.ids, out.values, None)
    if batch.found is None:
        return exact, out.above, out.tied
    found, w = batch.found, exact.shape[1]
    keys = _sorted_keys(batch, found.ids, found.values, None)  # [g, F]
    over = found.count > keys.shape[1]
    first = torch.where(over[:, None], exact, keys[:, :w])
    values, real = extra.decode(keys, batch.vocab)[1], keys != extra.LOWEST
    last = extra.decode(first[:, w - 1], batch.vocab)[1][:, None]
    above = torch.where(over, out.above, (real & (values > last)).sum(dim=1, dtype=torch.int32))
    tied = torch.where(over, out.tied, (real & (values == last)).sum(dim=1, dtype=torch.int32))
    return first, above, tied


def _bounded_processed(
    batch: Batch, first: torch.Tensor, x_target: torch.Tensor, above: torch.Tensor, tied: torch.Tensor
) -> torch.Tensor:
    """[g] extras.processed_logprobs where every row truncates by rank (`bounded`), from the W keys
    found, with nothing read back to the host: min-p, top-k and top-p over them, renormalised.

    Past the W found, the only survivors are ties of the top_k-th logit v, where it ties the W-th
    (the ties past them: `tied - (W - above)`, all of p_v = exp(v - shift), after every token found
    in the order). They count in the kept mass; top-p keeps the first `more` of them, where the
    survivors found hold less than its goal (the j-th is kept where reach + j·p_v < goal), and the
    target is one of them by its place among its ties (`before`, past the W - above ties found)."""
    out, asks, vocab = batch.out, batch.asks, batch.vocab
    assert batch.top_k is not None
    assert asks.top_p is not None
    assert asks.min_p is not None
    shift, w = out.shift, first.shape[1]
    floor = asks.min_p * torch.exp(out.row_max - shift)  # as extras.processed_logprobs
    kth_key = first.gather(1, (batch.top_k.long() - 1).clamp(0, w - 1)[:, None])[:, 0]
    kth = extra.decode(kth_key, vocab)[1]
    found = extra.survivors(first, shift, floor, kth, vocab)
    reach = found.upto[:, -1]
    p_v = torch.exp(kth - shift)
    ties_past = (tied - (w - above)).long().clamp(min=0)
    w_th = extra.decode(first[:, -1], vocab)[1]  # the W-th found (NaN where none: never kth)
    past = torch.where((w_th == kth) & (p_v >= floor), ties_past, 0)
    mass = reach + past * p_v
    goal = asks.top_p * mass
    wanted = asks.top_p < 1.0
    total, last = found.cut(first, goal, wanted, mass)
    short = wanted & (reach < goal) & (past > 0)
    more = torch.where(short, torch.minimum(torch.ceil((goal - reach) / p_v), past.float()), 0.0)
    total = total + more * p_v
    place = (out.before - (w - above)).long()  # among the ties past the W, if the target is one
    one_past = (x_target == kth) & (past > 0) & (place >= 0)
    in_order = extra.keys(x_target, batch.targets, vocab) >= last
    in_order |= one_past & (place < more)
    logp = x_target - shift
    kept = (torch.exp(logp) >= floor) & (x_target >= kth) & in_order
    return torch.where(kept, logp - torch.log(total), float("-inf"))


@dataclass(frozen=True, slots=True)
class Found:
    """extras.Rows over a finished batch: its W sorted keys; a longer prefix from its chunks' logits."""

    batch: Batch
    first: torch.Tensor  # [g, W] each row's W largest keys, largest first

    def prefix(self, n: int, pending: torch.Tensor | None) -> torch.Tensor:
        n = min(n, self.batch.vocab)
        if n <= self.first.shape[1]:
            return extra.take(self.first, pending)[:, :n]
        return _longer(self.batch, n, pending)

    def row_max(self) -> torch.Tensor:
        return self.batch.out.row_max  # the kernel's max of x, which the floor of `mass` used

    def mass(
        self, shift: torch.Tensor, floor: torch.Tensor, kth: torch.Tensor, kth_key: torch.Tensor
    ) -> torch.Tensor:
        # summed per chunk by `score` with this floor and the top_k-th key, while z existed
        assert self.batch.mass is not None
        return self.batch.mass


def _longer(batch: Batch, n: int, pending: torch.Tensor | None) -> torch.Tensor:
    """[p, n] the n largest keys of pending rows (None: all), from their chunks' logits made again."""
    device = batch.out.shift.device
    at = np.arange(len(batch.asks.rows)) if pending is None else pending.cpu().numpy()
    keys = torch.empty(len(at), n, dtype=torch.int64, device=device)
    for start in np.unique(batch.chunk[at]):
        mine = np.flatnonzero(batch.chunk[at] == start)
        rows = torch.from_numpy(at[mine]).to(device)
        z = batch.logits_of(int(start))
        inv_t = None if batch.inv_t is None else batch.inv_t[rows]
        local = batch.local[rows]
        found = topk_kernel.select(z, local, torch.zeros_like(local), batch.scale, inv_t, n)
        assert found.ids is not None
        assert found.values is not None
        keys[torch.from_numpy(mine).to(device)] = _sorted_keys(batch, found.ids, found.values, rows)
    return keys


def _tempered(batch: Batch, z: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """[p, m] float32 x of 16-bit logits z [p, m] of rows (None: all): the torch path's operations."""
    x = z.to(torch.float32)
    if batch.scale != 1.0:
        x.mul_(batch.scale)  # LogitTransform's scale, as transform() applies it
    if batch.inv_t is not None:
        x.mul_(extra.take(batch.inv_t, rows)[:, None])
    return x


def _sorted_keys(
    batch: Batch, ids: torch.Tensor, values: torch.Tensor, rows: torch.Tensor | None
) -> torch.Tensor:
    """[p, W] extras.keys of tokens ids [p, W] (int32, -1: none) with logits `values`, largest first
    (none: LOWEST)."""
    real = ids >= 0
    at = ids.long().clamp(min=0)
    k = extra.keys(_tempered(batch, values, rows), at, batch.vocab).masked_fill(~real, extra.LOWEST)
    return torch.sort(k, dim=1, descending=True).values


class Collector:
    """One score_actions call's radix extras: `chunk` per chunk of logits, `done` after the last.

    The asking rows go in groups of at most extras.PASS_ELEMENTS // W rows (the micro-batch's rows
    in one group unless W is large); a group is finished when its last row has been written."""

    def __init__(  # noqa: PLR0917
        self,
        extras: Extras,  # the asking rows of the call
        targets: torch.Tensor,  # [A]
        inv_temperature: torch.Tensor | None,  # [A]
        scale: float,
        first: int,  # the first action row of the first chunk
        chunk_rows: int,
        logits_of: Callable[[int], torch.Tensor],  # the logits of the chunk starting at an action row
    ) -> None:
        self.extras, self.targets, self.inv_t, self.scale = extras, targets, inv_temperature, scale
        self.chunk = first + (extras.rows - first) // chunk_rows * chunk_rows  # [R] host
        self.logits_of = logits_of
        self.batch: Batch | None = None
        self.begin = 0  # the current group's first asking row
        self.parts: list[ExtraScores] = []

    def chunk_of(self, z: torch.Tensor, start: int, end: int) -> None:
        """The asking rows among action rows [start, end), whose logits z [end - start, V] are."""
        lo, hi = self.extras.span(start, end)
        size = max(1, extra.PASS_ELEMENTS // width(self.extras, z.shape[1]))
        while lo < hi:
            if self.batch is None:
                self.begin = lo
                last = min(lo + size, len(self.extras.rows))
                self.batch = Batch.make(
                    self.extras.part(lo, last), self.chunk[lo:last], self.targets, self.inv_t,
                    self.scale, z, self.logits_of,
                )  # fmt: skip
            stop = min(hi, self.begin + len(self.batch.asks.rows))
            finished = score(self.batch, z, lo - self.begin, stop - self.begin)
            lo = stop
            if finished is not None:
                self.parts.append(finished)
                self.batch = None

    def done(self) -> list[ExtraScores]:
        assert self.batch is None, "rows of the last group were never written"
        return self.parts

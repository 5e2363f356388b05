"""Radix select over 16-bit logits (Triton): each row's K largest token ids, its log-sum-exp, the
target's rank and a thresholded probability mass, without a float32 or int64 copy of the row.

For the extras of the fused head (heads/extras_radix.py). Boundary: z [c, V] bfloat16 / float16
logits, the asking rows' indices into z, and the row multiplier x = (float(z)·scale)·inv_t (the
torch path's operations, scale > 0, inv_t > 0) in; per-row tensors out. x is strictly increasing
in z over finite values (two 16-bit values differ by >= 2^-11 relatively, a float32 product rounds
by 2^-24) as long as x stays a normal float32 or zero, so the order of (x desc, id asc) is that of
(z desc, id asc) and ties in x are ties in z. Each element's order key is a 16-bit integer: its
bits with the sign folded so that integers increase with z, -0 mapped onto +0 (`order_keys`).

`select`: one program per row, passes over its 16-bit values (a 2 B read per element each; each
pass loads its next block while it works on one, as heads/fused_kernel.py does):
1. the online log-sum-exp of x (as heads/fused_kernel.py), the count of keys >= the target's (vLLM's
   rank: tokens at least as likely) and the row's largest key;
2. a histogram of the 2^DIGIT keys at and below the largest, one bin each: where they hold K keys
   (the usual case: a row's K most likely lie within 256 bf16 steps of its largest, two binades) it
   gives the K-th largest key v, the count above it and the ties at v at once;
   else the radix passes: a histogram of the keys' top DIGIT bits, then for each further DIGIT bits
   a histogram of those bits among the keys that share the digits found so far;
3. the ids of the keys > v and of the first ties == v, in id order (a running prefix count, run only
   in the blocks that hold one), into [r, W] int32 (W >= each row's K; unwritten slots keep -1).
Compiled offline for sm_90 (tests/engine/heads/test_topk_compiles.py); launch parameters measured by
benchmarks/probes/topk_sweep.py.
`launch` runs them into given buffers (topk_kernel.Out, row slices of a micro-batch's) with no
allocation and nothing read back; `select` allocates them. Given `Candidates`, `launch` skips 2 and
3 for most rows: pass 1 also bounds the K-th largest key from below by the K-th largest of its
lanes' largest keys (each lane is one column of every block, so K lanes hold a key at least that
large), and a gather pass writes every key at or above the bound, in slots taken by atomics; only
rows where more than the candidates' width reach the bound (ties, flat rows) run 2 and 3, the
others' programs returning at once. The stats kernel also keeps each row's
largest x and copies z at given ids (target, candidates); the write kernel writes z beside each id.
`mass`: one more pass, Σ exp(x - shift) over tokens with key >= a per-row key and
exp(x - shift) >= a per-row floor (the kept mass of vLLM's min-p and top-k).

triton is imported on first use (runtime/triton_jit.py); on CPU tensors only under TRITON_INTERPRET=1.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from service.engine.runtime import triton_jit

# On an H200 the serving path's kernels at these ran within 4-10 % of the best of BLOCK 1024-4096 x
# NUM_WARPS 4-16, 2048 with 8 warps (benchmarks/probes/topk_sweep.py --gathered: a chunk of 512 rows
# asking the top 100; docs/performance.md)
BLOCK = 2048
NUM_WARPS = 4
# the gather pass's programs per row, each over a segment of its blocks: the pass does little per key,
# so a row's keys are read by several programs at once (its count is taken by atomics anyway)
GATHER_SPLIT = 4
DIGIT = 8  # bits of the 16-bit key per histogram pass: 16 // DIGIT passes of 2^DIGIT bins
SIXTEEN = (torch.bfloat16, torch.float16)

tl: Any = None  # triton.language, bound on first use; the kernels find it among this module's globals


@dataclass(frozen=True, slots=True)
class Selection:
    """Per row r of a `select` call."""

    shift: torch.Tensor  # [r] float32 log Σ exp(x)
    ranks: torch.Tensor  # [r] int64 count of tokens with z >= z[target]
    ids: torch.Tensor | None  # [r, W] int32 the row's K largest (z desc, id asc) in id order; -1 pads
    threshold: torch.Tensor | None  # [r] int32 the K-th largest order key
    above: torch.Tensor | None  # [r] int32 tokens with a key > threshold
    tied: torch.Tensor | None  # [r] int32 tokens with a key == threshold (all of them, taken or not)
    values: torch.Tensor | None = None  # [r, W] z at ids (z's dtype; unwritten slots undefined)
    row_max: torch.Tensor | None = None  # [r] float32 the largest x


@dataclass(frozen=True, slots=True)
class Out:
    """The buffers one `launch` writes, r rows each (row slices of wider buffers will do): per row
    the shift, rank (int32), the target's place among its ties, largest x and the K-th largest order
    key with its counts; the ids and z values of the K largest (None: not written); z at `picks`
    token ids (None: none)."""

    shift: torch.Tensor  # [r] float32
    ranks: torch.Tensor  # [r] int32
    row_max: torch.Tensor  # [r] float32
    threshold: torch.Tensor  # [r] int32
    above: torch.Tensor  # [r] int32
    tied: torch.Tensor  # [r] int32
    before: torch.Tensor  # [r] int32 tokens with z == z[target] and a lower id (its place among its ties)
    ids: torch.Tensor | None = None  # [r, W] int32, rows contiguous
    values: torch.Tensor | None = None  # [r, W] z's dtype, rows contiguous
    picked: torch.Tensor | None = None  # [r, P] z's dtype, rows contiguous

    @classmethod
    def empty(cls, r: int, device: torch.device) -> Out:
        f32, i32 = torch.float32, torch.int32
        return cls(*(torch.empty(r, dtype=d, device=device) for d in (f32, i32, f32, i32, i32, i32, i32)))

    def rows(self, a: int, b: int) -> Out:
        """Rows [a, b) of these buffers (views)."""

        def cut(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[a:b]

        return Out(
            self.shift[a:b], self.ranks[a:b], self.row_max[a:b], self.threshold[a:b], self.above[a:b],
            self.tied[a:b], self.before[a:b], cut(self.ids), cut(self.values), cut(self.picked),
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class Candidates:
    """Each row's keys at or above a lower bound of its K-th largest (the K-th largest of its lanes'
    largest keys: K lanes hold one each), in slots taken by atomics (any order), and how many there
    are. Where they fit (count <= C) they hold the K largest and every tie of the K-th; else the exact
    selection ran for the row (`launch`) and its ids are in Out.ids."""

    ids: torch.Tensor  # [r, C] int32, rows contiguous; slots past count unwritten
    values: torch.Tensor  # [r, C] z's dtype, rows contiguous
    count: torch.Tensor  # [r] int32 keys at or above the bound (written: min(count, C))

    @classmethod
    def empty(cls, r: int, width: int, dtype: torch.dtype, device: torch.device) -> Candidates:
        """Ids -1 and values -inf, so unwritten slots sort last."""
        return cls(
            ids=torch.full((r, width), -1, dtype=torch.int32, device=device),
            values=torch.full((r, width), float("-inf"), dtype=dtype, device=device),
            count=torch.zeros(r, dtype=torch.int32, device=device),
        )

    def rows(self, a: int, b: int) -> Candidates:
        return Candidates(self.ids[a:b], self.values[a:b], self.count[a:b])


def order_keys(z: torch.Tensor) -> torch.Tensor:
    """int32 keys in [1, 65535] of 16-bit logits z: increasing with z, -0 and +0 equal (as the kernels
    compute them; for callers that compare with a threshold)."""
    bits = z.view(torch.int16).to(torch.int32)
    return torch.where(bits < 0, -bits, bits + 32768)


def select(  # noqa: PLR0917 (the rows, their multiplier and what to select)
    z: torch.Tensor,  # [c, V] bfloat16 / float16
    rows: torch.Tensor,  # [r] int64 indices into z's rows
    targets: torch.Tensor,  # [r] token ids
    scale: float,  # the logit transform's positive scale
    inv_t: torch.Tensor | None,  # [r] float32 1 / T (None: 1)
    k: int | torch.Tensor,  # K of every row, or [r] per row; each clamped to [0, V] (0: no ids)
    *,
    width: int | None = None,  # W of ids (default: the largest K; read from the device if per row)
    block: int = BLOCK,
    digit: int = DIGIT,  # 2, 4 or 8
) -> Selection:
    """Each row's shift and rank and, where K > 0, its K largest ids (ties: the lower id first)."""
    triton_jit.runnable(z)
    if z.dtype not in SIXTEEN:
        raise ValueError(f"the radix select reads 16-bit logits, not {z.dtype}")
    vocab, r, device = z.shape[1], rows.shape[0], z.device
    per_row = torch.as_tensor(k, device=device).to(torch.int32).clamp(0, vocab).expand(r).contiguous()
    if width is None:
        width = min(int(k), vocab) if isinstance(k, int) else int(per_row.max()) if r else 0
    wanted = width > 0
    out = Out.empty(r, device)
    if wanted:
        ids = torch.full((r, width), -1, dtype=torch.int32, device=device)
        out = replace(out, ids=ids, values=torch.empty(r, width, dtype=z.dtype, device=device))
    launch(z, rows, targets, scale, inv_t, per_row, out, select=wanted, block=block, digit=digit)
    return Selection(
        shift=out.shift,
        ranks=out.ranks.long(),
        ids=out.ids,
        threshold=out.threshold if wanted else None,
        above=out.above if wanted else None,
        tied=out.tied if wanted else None,
        values=out.values,
        row_max=out.row_max,
    )


def launch(  # noqa: PLR0917
    z: torch.Tensor,  # [c, V] bfloat16 / float16
    rows: torch.Tensor,  # [r] int64 indices into z's rows
    targets: torch.Tensor,  # [r] int64 token ids
    scale: float,
    inv_t: torch.Tensor | None,  # [r] float32 1 / T (None: 1)
    k: torch.Tensor,  # [r] int32 K of each row, in [0, V] and <= W where ids are written
    out: Out,
    *,
    select: bool = True,  # find each row's K-th largest key (threshold, above, tied)
    picks: torch.Tensor | None = None,  # [r, P] int64 token ids whose z goes to out.picked
    found: Candidates | None = None,  # gather each row's candidates first (`Candidates`)
    block: int = BLOCK,
    digit: int = DIGIT,
) -> None:
    """`select`'s kernels into given buffers: no allocation, no copy of the inputs when they are
    already int64 / float32 and contiguous, and nothing read back to the host. The stats kernel
    always runs; the write kernel where out.ids is given. With `found`, the stats kernel bounds the
    K-th largest key from below and the gather kernel writes every key at or above the bound into
    `found`; the exact selection and write then run only for the rows whose candidates overflowed
    (the others return at once)."""
    triton_jit.runnable(z)
    if z.stride(1) != 1:
        z = z.contiguous()
    r, vocab = rows.shape[0], z.shape[1]
    if not r:
        return
    rows = rows.to(torch.int64).contiguous()
    temp = inv_t.to(torch.float32).contiguous() if inv_t is not None else out.shift  # unread when None
    count = 0 if picks is None else picks.shape[1]
    if picks is not None:
        assert out.picked is not None
    step = min(block, triton_jit.next_power_of_2(vocab))
    assert step < 1 << 16, "the write kernel counts a block's keys in 16 bits"
    targets = targets.contiguous()
    picked = out.picked if out.picked is not None else out.shift
    gated = found is not None and select
    counts, cap = (found.count, found.ids.shape[1]) if found is not None else (out.ranks, 0)
    with triton_jit.on_device(z):

        def stats(bound: bool, gate: bool) -> None:
            triton_jit.jit(_stats_kernel)[(r,)](
                z, z.stride(0), rows, targets, float(scale), temp, k,
                out.shift, out.ranks, out.row_max, out.threshold, out.above, out.tied, out.before,
                picks if picks is not None else rows, picked, counts, cap,
                VOCAB=vocab, HAS_SCALE=scale != 1.0, HAS_TEMP=inv_t is not None, SELECT=select,
                PICKS=count, PICKS_BLOCK=triton_jit.next_power_of_2(max(count, 1)),
                BOUND=bound, GATED=gate, BLOCK=step, DIGIT=digit, num_warps=NUM_WARPS,
            )  # fmt: skip

        stats(gated, False)
        if gated:
            assert found is not None
            span = gather_span(vocab, step)
            triton_jit.jit(_gather_kernel)[(r, triton_jit.cdiv(vocab, span))](
                z, z.stride(0), rows, out.threshold, found.count, found.ids, found.values, cap,
                VOCAB=vocab, BLOCK=step, SPAN=span, num_warps=NUM_WARPS,
            )  # fmt: skip
            stats(False, True)
        if out.ids is not None:
            assert out.values is not None
            triton_jit.jit(_write_kernel)[(r,)](
                z, z.stride(0), rows, k, out.threshold, out.above, out.ids, out.values, out.ids.shape[1],
                counts, cap, VOCAB=vocab, BLOCK=step, GATED=gated, num_warps=NUM_WARPS,
            )  # fmt: skip


def gather_span(vocab: int, block: int) -> int:
    """The columns of one of a row's GATHER_SPLIT segments for the gather pass: whole blocks."""
    return triton_jit.cdiv(triton_jit.cdiv(vocab, block), GATHER_SPLIT) * block


def mass(  # noqa: PLR0917
    z: torch.Tensor,  # [c, V] bfloat16 / float16
    rows: torch.Tensor,  # [r] int64 indices into z's rows
    scale: float,
    inv_t: torch.Tensor | None,  # [r] float32 1 / T (None: 1)
    shift: torch.Tensor,  # [r] float32: p = exp(x - shift)
    floor: torch.Tensor,  # [r] float32: only p >= floor counts
    least: torch.Tensor,  # [r] int32: only order keys >= least count (0: every token)
    *,
    out: torch.Tensor | None = None,  # [r] float32 to write (default: a new tensor)
    block: int = BLOCK,
) -> torch.Tensor:
    """[r] float32 Σ p over each row's tokens with an order key >= least and p >= floor."""
    triton_jit.runnable(z)
    if z.stride(1) != 1:
        z = z.contiguous()
    r, vocab = rows.shape[0], z.shape[1]
    if out is None:
        out = torch.empty(r, dtype=torch.float32, device=z.device)
    if r:
        temp = inv_t.to(torch.float32).contiguous() if inv_t is not None else out  # unread when None
        with triton_jit.on_device(z):
            triton_jit.jit(_mass_kernel)[(r,)](
                z, z.stride(0), rows.to(torch.int64).contiguous(), float(scale), temp,
                shift.to(torch.float32).contiguous(), floor.to(torch.float32).contiguous(),
                least.to(torch.int32).contiguous(), out,
                VOCAB=vocab, HAS_SCALE=scale != 1.0, HAS_TEMP=inv_t is not None,
                BLOCK=min(block, triton_jit.next_power_of_2(vocab)), num_warps=NUM_WARPS,
            )  # fmt: skip
    return out


def _stats_kernel(  # noqa: PLR0915, PLR0917 (a Triton kernel takes its arguments positionally)
    z_ptr: tl.tensor,
    row_stride: tl.tensor,
    rows_ptr: tl.tensor,
    target_ptr: tl.tensor,
    scale: tl.tensor,
    temp_ptr: tl.tensor,
    k_ptr: tl.tensor,
    shift_ptr: tl.tensor,
    rank_ptr: tl.tensor,
    max_ptr: tl.tensor,
    threshold_ptr: tl.tensor,
    above_ptr: tl.tensor,
    tied_ptr: tl.tensor,
    before_ptr: tl.tensor,
    picks_ptr: tl.tensor,
    picked_ptr: tl.tensor,
    count_ptr: tl.tensor,
    cap: tl.tensor,
    VOCAB: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_TEMP: tl.constexpr,
    SELECT: tl.constexpr,
    PICKS: tl.constexpr,
    PICKS_BLOCK: tl.constexpr,
    BOUND: tl.constexpr,
    GATED: tl.constexpr,
    BLOCK: tl.constexpr,
    DIGIT: tl.constexpr,
) -> None:
    """The selecting passes of one row: the first with the online log-sum-exp (the running max m and
    per-lane sums d = Σ exp(x - m), rescaled when m grows) and the rank; each a histogram of the
    next DIGIT bits of the keys whose higher bits are those of the K-th largest key found so far.
    Padding loads as -inf (exp gives 0) and is masked out of the counts. A row with K = 0 writes
    threshold, above and tied 0 (every key is at or above threshold 0). Also stores the row's
    largest x (the running max: x is the torch path's product, so the value is bitwise its max)
    and copies z at PICKS token ids per row (the target's and candidates' logits).
    BOUND: after the first pass, instead of the selection, threshold is a lower bound of the K-th
    largest key (the K-th largest of the lanes' largest; 0 where K > BLOCK) and count is zeroed for
    the gather kernel. GATED: only rows whose count passed cap run (the others return at once)."""
    i = tl.program_id(0)
    if GATED:  # noqa: SIM102 (a constexpr branch around a runtime one)
        if tl.load(count_ptr + i) <= cap:
            return
    row_ptr = z_ptr + tl.load(rows_ptr + i).to(tl.int64) * row_stride
    t = tl.load(temp_ptr + i) if HAS_TEMP else 1.0
    target = tl.load(target_ptr + i)
    target_bits = tl.load(row_ptr + target).to(tl.int16, bitcast=True).to(tl.int32)
    target_key = tl.where(target_bits < 0, -target_bits, target_bits + 32768)  # order_keys, inlined
    k = tl.load(k_ptr + i)
    if PICKS > 0:
        at = tl.arange(0, PICKS_BLOCK)
        some = at < PICKS
        picks = tl.load(picks_ptr + i.to(tl.int64) * PICKS + at, mask=some, other=0)
        tl.store(picked_ptr + i.to(tl.int64) * PICKS + at, tl.load(row_ptr + picks, mask=some), mask=some)
    bins = tl.arange(0, 1 << DIGIT)
    m = float("-inf")
    d = tl.zeros([BLOCK], tl.float32)
    rank = tl.zeros([BLOCK], tl.int32)
    before = tl.zeros([BLOCK], tl.int32)
    top = tl.zeros([BLOCK], tl.int32)  # per lane, the largest order key
    ahead = tl.load(row_ptr + tl.arange(0, BLOCK), mask=tl.arange(0, BLOCK) < VOCAB, other=float("-inf"))
    for start in range(0, VOCAB, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        valid = cols < VOCAB
        v = ahead
        ahead = tl.load(row_ptr + cols + BLOCK, mask=cols + BLOCK < VOCAB, other=float("-inf"))  # in flight
        bits = v.to(tl.int16, bitcast=True).to(tl.int32)
        key = tl.where(bits < 0, -bits, bits + 32768)
        x = v.to(tl.float32)
        if HAS_SCALE:
            x = x * scale
        if HAS_TEMP:
            x = x * t
        m_new = tl.maximum(m, tl.max(x, axis=0))
        d = d * tl.exp(m - m_new) + tl.exp(x - m_new)
        m = m_new
        rank += (valid & (key >= target_key)).to(tl.int32)
        before += (valid & (key == target_key) & (cols < target)).to(tl.int32)
        if SELECT:
            top = tl.maximum(top, tl.where(valid, key, 0))
    tl.store(shift_ptr + i, m + tl.log(tl.sum(d, axis=0)))
    tl.store(rank_ptr + i, tl.sum(rank, axis=0))
    tl.store(before_ptr + i, tl.sum(before, axis=0))
    tl.store(max_ptr + i, m)
    if BOUND:
        # the K-th largest of the lanes' largest keys, by bisection of the 16-bit key space: the
        # largest b with K lanes at or above it (0 where fewer than K lanes hold a key)
        lo = tl.zeros([], tl.int32)
        hi = tl.full([], 1 << 16, tl.int32)
        for _ in tl.static_range(16):
            mid = (lo + hi) // 2
            enough = tl.sum((top >= mid).to(tl.int32), axis=0) >= k
            lo = tl.where(enough, mid, lo)
            hi = tl.where(enough, hi, mid)
        tl.store(threshold_ptr + i, lo)
        tl.store(count_ptr + i, 0)
    elif SELECT:
        if k <= 0:
            tl.store(threshold_ptr + i, 0)
            tl.store(above_ptr + i, 0)
            tl.store(tied_ptr + i, 0)
        else:
            # the window: the 2^DIGIT order keys at and below the row's largest, a bin each (bin g:
            # key = largest - g), which holds the K-th largest key in one pass when it holds >= K keys
            largest = tl.max(top, axis=0)
            counts = tl.zeros([1 << DIGIT], tl.int32)
            ahead = tl.load(row_ptr + tl.arange(0, BLOCK), mask=tl.arange(0, BLOCK) < VOCAB, other=0.0)
            for start in range(0, VOCAB, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                valid = cols < VOCAB
                v = ahead
                ahead = tl.load(row_ptr + cols + BLOCK, mask=cols + BLOCK < VOCAB, other=0.0)
                bits = v.to(tl.int16, bitcast=True).to(tl.int32)
                gap = largest - tl.where(bits < 0, -bits, bits + 32768)
                near = valid & (gap < (1 << DIGIT))
                counts += tl.histogram(tl.where(near, gap, 0), 1 << DIGIT, mask=near)
            if tl.sum(counts, axis=0) >= k:
                at_or_above = tl.cumsum(counts, 0)  # keys >= largest - g
                g = tl.min(tl.where(at_or_above >= k, bins, 1 << DIGIT), axis=0)
                threshold = largest - g
                over = tl.sum(tl.where(bins < g, counts, 0), axis=0)
                tied = tl.sum(tl.where(bins == g, counts, 0), axis=0)
            else:
                # the radix select: DIGIT bits a pass, from the top, over the keys whose higher bits
                # are those of the K-th largest key found so far
                prefix = tl.zeros([], tl.int32)
                over = tl.zeros([], tl.int32)
                tied = tl.zeros([], tl.int32)
                for p in tl.static_range(0, 16 // DIGIT):
                    counts = tl.zeros([1 << DIGIT], tl.int32)
                    for start in range(0, VOCAB, BLOCK):
                        cols = start + tl.arange(0, BLOCK)
                        valid = cols < VOCAB
                        v = tl.load(row_ptr + cols, mask=valid, other=0.0)
                        bits = v.to(tl.int16, bitcast=True).to(tl.int32)
                        key = tl.where(bits < 0, -bits, bits + 32768)
                        inside = valid
                        if p > 0:
                            inside = valid & ((key >> (16 - p * DIGIT)) == prefix)
                        counts += tl.histogram(
                            (key >> (16 - (p + 1) * DIGIT)) & ((1 << DIGIT) - 1), 1 << DIGIT, mask=inside
                        )
                    at_or_above = tl.cumsum(counts, 0, reverse=True)
                    digit = tl.max(tl.where(at_or_above >= k - over, bins, -1), axis=0)
                    over += tl.sum(tl.where(bins > digit, counts, 0), axis=0)
                    tied = tl.sum(tl.where(bins == digit, counts, 0), axis=0)
                    prefix = prefix * (1 << DIGIT) + digit
                threshold = prefix
            tl.store(threshold_ptr + i, threshold)
            tl.store(above_ptr + i, over)
            tl.store(tied_ptr + i, tied)


def _write_kernel(  # noqa: PLR0917
    z_ptr: tl.tensor,
    row_stride: tl.tensor,
    rows_ptr: tl.tensor,
    k_ptr: tl.tensor,
    threshold_ptr: tl.tensor,
    above_ptr: tl.tensor,
    ids_ptr: tl.tensor,
    values_ptr: tl.tensor,
    width: tl.tensor,
    count_ptr: tl.tensor,
    cap: tl.tensor,
    VOCAB: tl.constexpr,
    BLOCK: tl.constexpr,
    GATED: tl.constexpr,
) -> None:
    """Pass 3 of one row: the ids of keys > threshold and of the first K - above keys == threshold,
    in id order, at consecutive slots of the row's output, and z at those ids beside them (GATED:
    only rows whose candidates overflowed)."""
    i = tl.program_id(0)
    k = tl.load(k_ptr + i)
    if GATED:
        k = tl.where(tl.load(count_ptr + i) > cap, k, 0)
    if k > 0:
        row_ptr = z_ptr + tl.load(rows_ptr + i).to(tl.int64) * row_stride
        out_ptr = ids_ptr + i.to(tl.int64) * width
        values_out = values_ptr + i.to(tl.int64) * width
        v = tl.load(threshold_ptr + i)
        ties = k - tl.load(above_ptr + i)  # ties at v to take, the lowest ids
        written = tl.zeros([], tl.int32)
        seen = tl.zeros([], tl.int32)  # ties at v before this block
        ahead = tl.load(row_ptr + tl.arange(0, BLOCK), mask=tl.arange(0, BLOCK) < VOCAB, other=0.0)
        for start in range(0, VOCAB, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            valid = cols < VOCAB
            z = ahead
            ahead = tl.load(row_ptr + cols + BLOCK, mask=cols + BLOCK < VOCAB, other=0.0)  # in flight
            bits = z.to(tl.int16, bitcast=True).to(tl.int32)
            key = tl.where(bits < 0, -bits, bits + 32768)
            tie = (valid & (key == v)).to(tl.int32)
            high = (valid & (key > v)).to(tl.int32)
            both = tl.sum(high * 65536 + tie, axis=0)  # one reduction: BLOCK < 2^16 of each
            ties_here = both & 65535
            # most blocks hold none of the K: the scans run only where one is taken
            if (both >> 16) + tl.where(seen < ties, ties_here, 0) > 0:
                take = ((high > 0) | ((tie > 0) & (seen + tl.cumsum(tie, 0) <= ties))).to(tl.int32)
                slot = written + tl.cumsum(take, 0) - take
                tl.store(out_ptr + slot, cols, mask=take > 0)
                tl.store(values_out + slot, z, mask=take > 0)
                written += tl.sum(take, axis=0)
            seen += ties_here


def _gather_kernel(  # noqa: PLR0917
    z_ptr: tl.tensor,
    row_stride: tl.tensor,
    rows_ptr: tl.tensor,
    bound_ptr: tl.tensor,
    count_ptr: tl.tensor,
    ids_ptr: tl.tensor,
    values_ptr: tl.tensor,
    width: tl.tensor,
    VOCAB: tl.constexpr,
    BLOCK: tl.constexpr,
    SPAN: tl.constexpr,
) -> None:
    """One pass over a segment of a row (program (row, segment): SPAN columns, whole blocks): every
    key >= the row's bound into a slot taken by an atomic increment of its count (slots past width
    are counted, not written), with z beside its id."""
    i = tl.program_id(0)
    first = tl.program_id(1) * SPAN
    stop = tl.minimum(first + SPAN, VOCAB)
    row_ptr = z_ptr + tl.load(rows_ptr + i).to(tl.int64) * row_stride
    bound = tl.load(bound_ptr + i)
    out_ptr = ids_ptr + i.to(tl.int64) * width
    values_out = values_ptr + i.to(tl.int64) * width
    ahead = tl.load(row_ptr + first + tl.arange(0, BLOCK), mask=first + tl.arange(0, BLOCK) < stop, other=0.0)
    for offset in range(0, SPAN, BLOCK):
        cols = first + offset + tl.arange(0, BLOCK)
        z = ahead
        ahead = tl.load(row_ptr + cols + BLOCK, mask=cols + BLOCK < stop, other=0.0)  # in flight
        bits = z.to(tl.int16, bitcast=True).to(tl.int32)
        take = (cols < stop) & (tl.where(bits < 0, -bits, bits + 32768) >= bound)
        slot = tl.atomic_add(count_ptr + i + cols * 0, 1, mask=take)
        kept = take & (slot < width)
        tl.store(out_ptr + slot, cols, mask=kept)
        tl.store(values_out + slot, z, mask=kept)


def _mass_kernel(  # noqa: PLR0917
    z_ptr: tl.tensor,
    row_stride: tl.tensor,
    rows_ptr: tl.tensor,
    scale: tl.tensor,
    temp_ptr: tl.tensor,
    shift_ptr: tl.tensor,
    floor_ptr: tl.tensor,
    least_ptr: tl.tensor,
    out_ptr: tl.tensor,
    VOCAB: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_TEMP: tl.constexpr,
    BLOCK: tl.constexpr,
) -> None:
    """One pass of one row: Σ exp(x - shift) over keys >= least with exp(x - shift) >= floor."""
    i = tl.program_id(0)
    row_ptr = z_ptr + tl.load(rows_ptr + i).to(tl.int64) * row_stride
    t = tl.load(temp_ptr + i) if HAS_TEMP else 1.0
    shift = tl.load(shift_ptr + i)
    floor = tl.load(floor_ptr + i)
    least = tl.load(least_ptr + i)
    total = tl.zeros([BLOCK], tl.float32)
    ahead = tl.load(row_ptr + tl.arange(0, BLOCK), mask=tl.arange(0, BLOCK) < VOCAB, other=float("-inf"))
    for start in range(0, VOCAB, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        valid = cols < VOCAB
        v = ahead
        ahead = tl.load(row_ptr + cols + BLOCK, mask=cols + BLOCK < VOCAB, other=float("-inf"))  # in flight
        x = v.to(tl.float32)
        if HAS_SCALE:
            x = x * scale
        if HAS_TEMP:
            x = x * t
        p = tl.exp(x - shift)
        bits = v.to(tl.int16, bitcast=True).to(tl.int32)
        total += tl.where(valid & (tl.where(bits < 0, -bits, bits + 32768) >= least) & (p >= floor), p, 0.0)
    tl.store(out_ptr + i, tl.sum(total, axis=0))

"""The steps of a sparse MoE layer around its grouped GEMMs, as Triton kernels with torch twins.

Routing (`route_kernel`, `group_kernel`; the twin is dispatch.plan's torch ops), T tokens, E experts:

    p = softmax(logits [T, E] in float32)         as the architecture's router (routing_rule.Routing)
    w, e = top-k of p                             [T, k], descending; a tie goes to the lower expert id
    w = w / Σ w (normalise), rounded (round_weights)
    slots grouped by expert, in slot order within one: a counting sort (per block of tokens, each
    expert's count and each slot's rank among the block's slots of its expert; per expert, a
    program of its own, the slots of the lower experts and a prefix sum of its counts over the
    blocks; then each slot's place), the same order as a stable sort

A token's routing reads only its own logits, so it does not depend on the batch it is in.

Combining (`combine_kernel`, `combine_torch`), each token's k expert outputs into the residual:

    x[t] += round(Σ_j round_w(y[slots[t, j]] · w[t, j]) (+ extra[t]))

y [S, H] holds the experts' outputs grouped by expert (S = T·k rows), slots [T, k] int64 says where
each of token t's k rows sits in y, w [T, k] are the routing weights (the model's dtype for the Qwen
family, float32 for Mixtral), extra [T, H] an optional term added before the residual (Qwen2-MoE's
shared expert). Rounded as transformers' forward: each product to w's dtype, the k products summed in
float32 and rounded once to x's dtype, `extra` added in that dtype, then the residual add.

The k rows of a token are read in slot order and added in that order: no atomics, so a score does not
change from run to run. `combine_kernel` is one Triton pass (reads k rows, writes one); `combine_torch`
is its twin (the CPU path and the reference the tests hold the kernel to).

Counting (`count_kernel`, `count_torch`), the real tokens each expert took, for the expert-load
metric: the rows of h below a bound are real tokens and the filler that pads a micro-batch follows
them, so within an expert's group (tokens ascending) the filler is its last rows:

    counts[e] += #{grouped rows r of expert e : rows[r] < real - first}          counts [E] int32

`first` is the row of the whole micro-batch where this call's h starts. The kernel reads only the last
`tail` rows of each group (a bound on the filler tokens), one program per expert.

Replaying and recording (route_kernel given a layer's LayerRoutes, replay.py): in the same pass, a
covered token takes its given ids in their slot order, weighted by p gathered at them (normalised,
rounded, as the top-k's); the others keep the top-k. The grouping then reads the ids taken, so the
experts run exactly as live. The kernel writes the ids taken into `used`, the top-k into `live` and
|given ∩ top-k| into `matches` (int8, one per token): the route agreement, counted while both sets
are in registers.

Boundary: what layer.py and dispatch.py call, each typed: route_kernel -> Routed, group_kernel, and
the Combine and Count pairs (kernel, torch twin); the Triton programs themselves stay private.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from service.engine.batch.device_routes import LayerRoutes
from service.engine.runtime import triton_jit

tl: Any = None  # triton.language, bound by triton_jit.jit

# x [T, H] += Σ_j y[slots[:, j]] · w[:, j] (+ extra [T, H]), in place: combine_torch or combine_kernel
Combine = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], None]
# rows [S] int32, offsets [E+1] int32, real [1] int32, first, counts [E] int32 (added to), tail:
# count_torch or count_kernel
Count = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor, int], None]


def combine_torch(
    x: torch.Tensor, y: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, extra: torch.Tensor | None
) -> None:
    """x [T, H] += the weighted sum of y's rows at slots [T, k] (see the module), in place."""
    t, k = weights.shape
    per_slot = y.index_select(0, slots.flatten()).view(t, k, y.shape[1])
    out = (per_slot * weights[..., None]).sum(dim=1).to(x.dtype)  # products in w's dtype, one rounding
    if extra is not None:
        out = out + extra
    x.add_(out)


def combine_kernel(
    x: torch.Tensor, y: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, extra: torch.Tensor | None
) -> None:
    """combine_torch in one Triton kernel (CUDA, or the interpreter)."""
    triton_jit.runnable(y)
    t, k = weights.shape
    width = y.shape[1]
    if t == 0:
        return
    if x.stride(1) != 1 or y.stride(1) != 1 or (extra is not None and extra.stride(1) != 1):
        raise ValueError("combine_kernel takes row-major x, y and extra")
    slots, weights = slots.contiguous(), weights.contiguous()
    block = min(2048, triton_jit.next_power_of_2(width))
    grid = (t, triton_jit.cdiv(width, block))
    with triton_jit.on_device(y):
        kernel = triton_jit.jit(_combine)
        kernel[grid](
            x,
            x.stride(0),
            y,
            y.stride(0),
            slots,
            weights,
            extra if extra is not None else x,
            extra.stride(0) if extra is not None else 0,
            K=k,
            WIDTH=width,
            BLOCK=block,
            EXTRA=extra is not None,
            num_warps=max(1, min(8, block // 256)),
        )


def _combine(  # noqa: PLR0917 (a Triton kernel takes its arguments positionally)
    x_ptr: tl.tensor,
    x_stride: tl.tensor,
    y_ptr: tl.tensor,
    y_stride: tl.tensor,
    slots_ptr: tl.tensor,
    w_ptr: tl.tensor,
    extra_ptr: tl.tensor,
    extra_stride: tl.tensor,
    K: tl.constexpr,
    WIDTH: tl.constexpr,
    BLOCK: tl.constexpr,
    EXTRA: tl.constexpr,
) -> None:
    """One token, BLOCK columns: its k rows of y in slot order, float32 sum, one rounding."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < WIDTH
    dtype = x_ptr.dtype.element_ty
    w_dtype = w_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(K):
        slot = tl.load(slots_ptr + row * K + j).to(tl.int64)
        w = tl.load(w_ptr + row * K + j).to(tl.float32)
        y = tl.load(y_ptr + slot * y_stride + cols, mask=mask, other=0.0).to(tl.float32)
        acc += (y * w).to(w_dtype).to(tl.float32)
    out = acc.to(dtype).to(tl.float32)
    if EXTRA:
        extra = tl.load(extra_ptr + row * extra_stride + cols, mask=mask, other=0.0).to(tl.float32)
        out = (out + extra).to(dtype).to(tl.float32)
    target = x_ptr + row * x_stride + cols
    x = tl.load(target, mask=mask, other=0.0).to(tl.float32)
    tl.store(target, (x + out).to(dtype), mask=mask)


def count_torch(  # noqa: PLR0917 (the Count signature layer.SparseMoe calls)
    rows: torch.Tensor, offsets: torch.Tensor, real: torch.Tensor, first: int, counts: torch.Tensor, tail: int
) -> None:
    """counts [E] += the real tokens among each expert's grouped rows (see the module), in place;
    rows [S] int32, offsets [E+1] int32, real [1] int32. `tail` is the kernel's bound (unused here)."""
    del tail
    below = (rows < real - first).to(torch.int64)
    running = torch.cat((below.new_zeros(1), below.cumsum(0)))  # [S+1]
    counts.add_((running[offsets[1:].long()] - running[offsets[:-1].long()]).to(counts.dtype))


def count_kernel(  # noqa: PLR0917 (the Count signature layer.SparseMoe calls)
    rows: torch.Tensor, offsets: torch.Tensor, real: torch.Tensor, first: int, counts: torch.Tensor, tail: int
) -> None:
    """count_torch in one Triton kernel, given that fewer than `tail` (a power of 2) rows of h are filler."""
    triton_jit.runnable(rows)
    with triton_jit.on_device(rows):
        triton_jit.jit(_count)[(counts.shape[0],)](rows, offsets, real, counts, first, TAIL=tail, num_warps=4)


def _count(  # noqa: PLR0917
    rows_ptr: tl.tensor,
    offsets_ptr: tl.tensor,
    real_ptr: tl.tensor,
    counts_ptr: tl.tensor,
    first: tl.tensor,
    TAIL: tl.constexpr,
) -> None:
    """One expert: its group's size less the filler among its last TAIL rows."""
    expert = tl.program_id(0)
    lo = tl.load(offsets_ptr + expert)
    hi = tl.load(offsets_ptr + expert + 1)
    at = hi - TAIL + tl.arange(0, TAIL)
    live = at >= lo
    row = tl.load(rows_ptr + at, mask=live, other=0)
    filler = tl.sum((live & (row >= tl.load(real_ptr) - first)).to(tl.int32), axis=0)
    tl.store(counts_ptr + expert, tl.load(counts_ptr + expert) + (hi - lo) - filler)


# ---- routing ---------------------------------------------------------------------------------------

ROUTE_TOKENS = 32  # tokens per program of route_kernel (a block of the counting sort)
GROUP_SLOTS = 1024  # slots per program of group_kernel
SCAN_ROWS = 256  # blocks' counts per step of a scan program's sum over the lower experts' [ROWS, E]
SCAN_BLOCKS = 512  # blocks per step of a scan program's prefix sum down its expert's column


@dataclass(frozen=True, slots=True)
class Routed:
    """route_kernel's output: weights [T, k], experts [T, k] int32, ranks [T, k] int32 (how many of its
    block's earlier tokens chose the same expert), counts [blocks, E] int32 (each block of ROUTE_TOKENS
    tokens' slots per expert)."""

    weights: torch.Tensor
    experts: torch.Tensor
    ranks: torch.Tensor
    counts: torch.Tensor


def route_kernel(  # noqa: PLR0917
    logits: torch.Tensor,
    k: int,
    normalise: bool,
    weight_dtype: torch.dtype,
    routes: LayerRoutes | None = None,
    first: int = 0,
) -> Routed:
    """Softmax, top-k and renormalisation of logits [T, E] (see the module), in one Triton pass; with
    `routes`, the replay and the records of the layer's rows first .. first + T - 1 in the same pass."""
    triton_jit.runnable(logits)
    t, count = logits.shape
    blocks = triton_jit.cdiv(t, ROUTE_TOKENS)
    weights = torch.empty((t, k), device=logits.device, dtype=weight_dtype)
    experts = torch.empty((t, k), device=logits.device, dtype=torch.int32)
    ranks = torch.empty((t, k), device=logits.device, dtype=torch.int32)
    counts = torch.empty((blocks, count), device=logits.device, dtype=torch.int32)
    if not t:
        return Routed(weights, experts, ranks, counts)
    rows = slice(first, first + t)
    given = covered = used = live = matches = None
    if routes is not None:
        used = None if routes.used is None else routes.used[rows]
        if routes.given is not None and routes.covered is not None:
            given, covered = routes.given[rows], routes.covered[rows]
            live = None if routes.live is None else routes.live[rows]
            matches = None if routes.matches is None else routes.matches[rows]
    for name, out in (("used", used), ("live", live)):
        if out is not None and (out.dtype != torch.int32 or out.stride(1) != 1):
            raise ValueError(f"route_kernel writes {name} as int32 rows of contiguous slots")
    if given is not None and given.stride(1) != 1:
        raise ValueError("route_kernel reads given ids as rows of contiguous slots")
    with triton_jit.on_device(logits):
        triton_jit.jit(_route, ("tokens",))[(blocks,)](  # T only bounds masks: not specialised
            logits,
            logits.stride(0),
            weights,
            experts,
            ranks,
            counts,
            t,
            given if given is not None else experts,
            given.stride(0) if given is not None else 0,
            covered.view(torch.uint8) if covered is not None else experts,
            used if used is not None else experts,
            used.stride(0) if used is not None else 0,
            live if live is not None else experts,
            live.stride(0) if live is not None else 0,
            matches if matches is not None else experts,
            matches.stride(0) if matches is not None else 0,
            EXPERTS=count,
            K=k,
            BLOCK_T=ROUTE_TOKENS,
            BLOCK_E=triton_jit.next_power_of_2(count),
            BLOCK_K=triton_jit.next_power_of_2(k),
            NORMALISE=normalise,
            REPLAY=given is not None,
            USED=used is not None,
            LIVE=live is not None,
            MATCHES=matches is not None,
            num_warps=4,
        )
    return Routed(weights, experts, ranks, counts)


def group_kernel(routed: Routed) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The grouped order of routed's slots: rows [T·k] int32 (each grouped row's token), slots [T, k]
    int64 (each slot's grouped row), offsets [E+1] int32 (each expert's first grouped row)."""
    experts, counts = routed.experts, routed.counts
    t, k = experts.shape
    blocks, count = counts.shape
    offsets = torch.empty(count + 1, device=experts.device, dtype=torch.int32)
    starts = torch.empty_like(counts)  # [blocks, E]: each expert's first grouped row for each block
    with triton_jit.on_device(experts):
        triton_jit.jit(_starts, runtime=("blocks",))[(count,)](  # compiled once, whatever the tokens
            counts,
            starts,
            offsets,
            blocks,
            EXPERTS=count,
            BLOCK_E=triton_jit.next_power_of_2(count),
            ROWS=SCAN_ROWS,
            CHUNK=SCAN_BLOCKS,
            num_warps=8,
        )
    rows = torch.empty(t * k, device=experts.device, dtype=torch.int32)
    slots = torch.empty((t, k), device=experts.device, dtype=torch.int64)
    if t:
        with triton_jit.on_device(experts):
            triton_jit.jit(_group)[(triton_jit.cdiv(t * k, GROUP_SLOTS),)](
                experts,
                routed.ranks,
                starts,
                rows,
                slots,
                t * k,
                EXPERTS=count,
                PER_BLOCK=ROUTE_TOKENS * k,
                K=k,
                BLOCK=GROUP_SLOTS,
                num_warps=4,
            )
    return rows, slots, offsets


def _route(  # noqa: PLR0917, PLR0915
    logits_ptr: tl.tensor,
    stride: tl.tensor,
    w_ptr: tl.tensor,
    e_ptr: tl.tensor,
    ranks_ptr: tl.tensor,
    counts_ptr: tl.tensor,
    tokens: tl.tensor,
    given_ptr: tl.tensor,
    given_stride: tl.tensor,
    covered_ptr: tl.tensor,
    used_ptr: tl.tensor,
    used_stride: tl.tensor,
    live_ptr: tl.tensor,
    live_stride: tl.tensor,
    matches_ptr: tl.tensor,
    matches_stride: tl.tensor,
    EXPERTS: tl.constexpr,
    K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NORMALISE: tl.constexpr,
    REPLAY: tl.constexpr,
    USED: tl.constexpr,
    LIVE: tl.constexpr,
    MATCHES: tl.constexpr,
) -> None:
    """BLOCK_T tokens: float32 softmax, k rounds of (largest, lowest id among equals); where REPLAY, a
    covered token's given ids instead, p gathered at them; which experts each token took, whose running
    sum over the block's tokens gives the ranks and the counts. The rounds over k are loops, not
    unrolled: each variant then compiles in about a quarter of the time (Qwen3-MoE's k = 8, E = 128)."""
    block = tl.program_id(0).to(tl.int64)
    tok = block * BLOCK_T + tl.arange(0, BLOCK_T)
    live = tok < tokens
    ids = tl.arange(0, BLOCK_E)
    real = ids < EXPERTS
    x = tl.load(
        logits_ptr + tok[:, None] * stride + ids[None, :], mask=live[:, None] & real[None, :], other=0.0
    ).to(tl.float32)
    x = tl.where(real[None, :], x, float("-inf"))
    e = tl.exp(x - tl.max(x, axis=1)[:, None])
    p = e / tl.sum(e, axis=1)[:, None]
    p = tl.where(real[None, :], p, -1.0)  # below every probability: never taken
    probs = p
    cols = tl.arange(0, BLOCK_K)
    slot_ok = live[:, None] & (cols[None, :] < K)
    weights = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    chosen = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int32)
    for j in range(K):
        best = tl.max(p, axis=1)
        pick = tl.min(tl.where(p == best[:, None], ids[None, :], BLOCK_E), axis=1)  # the lowest id of a tie
        p = tl.where(ids[None, :] == pick[:, None], -2.0, p)
        weights = tl.where(cols[None, :] == j, best[:, None], weights)
        chosen = tl.where(cols[None, :] == j, pick[:, None], chosen)
    took = ((p == -2.0) & live[:, None]).to(tl.int32)  # [tokens, experts]: 1 where the token chose it
    if REPLAY:
        out = tok[:, None] * given_stride + cols[None, :]
        given = tl.load(given_ptr + out, mask=slot_ok, other=0).to(tl.int32)
        covered = (tl.load(covered_ptr + tok, mask=live, other=0) != 0) & live
        at = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
        hits = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.int32)  # 1 where a given id names the expert
        for j in range(K):
            want = tl.sum(tl.where(cols[None, :] == j, given, 0), axis=1)
            hit = ids[None, :] == want[:, None]
            at = tl.where(cols[None, :] == j, tl.sum(tl.where(hit, probs, 0.0), axis=1)[:, None], at)
            hits += hit.to(tl.int32)
        if LIVE:
            tl.store(live_ptr + tok[:, None] * live_stride + cols[None, :], chosen, mask=slot_ok)
        if MATCHES:
            overlap = tl.sum(hits * took, axis=1)  # |given ∩ top-k|: the ids are distinct within a token
            overlap = tl.where(covered, overlap, 0)
            tl.store(matches_ptr + tok * matches_stride, overlap.to(tl.int8), mask=live)
        chosen = tl.where(covered[:, None], given, chosen)
        weights = tl.where(covered[:, None], at, weights)
        took = tl.where(covered[:, None], hits * live[:, None].to(tl.int32), took)
    before = tl.cumsum(took, axis=0) - took  # the block's earlier tokens that chose it
    ranks = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int32)
    for j in range(K):
        pick = tl.sum(tl.where(cols[None, :] == j, chosen, 0), axis=1)
        rank = tl.sum(tl.where(ids[None, :] == pick[:, None], before, 0), axis=1)
        ranks = tl.where(cols[None, :] == j, rank[:, None], ranks)
    if NORMALISE:
        weights = weights / tl.sum(weights, axis=1)[:, None]
    out = tok[:, None] * K + cols[None, :]
    tl.store(w_ptr + out, weights.to(w_ptr.dtype.element_ty), mask=slot_ok)
    tl.store(e_ptr + out, chosen, mask=slot_ok)
    tl.store(ranks_ptr + out, ranks, mask=slot_ok)
    tl.store(counts_ptr + block * EXPERTS + ids, tl.sum(took, axis=0), mask=real)
    if USED:
        tl.store(used_ptr + tok[:, None] * used_stride + cols[None, :], chosen, mask=slot_ok)


def _starts(  # noqa: PLR0917
    counts_ptr: tl.tensor,
    starts_ptr: tl.tensor,
    offsets_ptr: tl.tensor,
    blocks: tl.tensor,
    EXPERTS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    ROWS: tl.constexpr,
    CHUNK: tl.constexpr,
) -> None:
    """One expert e a program, over counts [blocks, E]: offsets[e] = the slots of every lower expert
    (their counts summed over the blocks, ROWS blocks a step), then its column of starts,
    starts[b, e] = offsets[e] + Σ_{b' < b} counts[b', e] (CHUNK blocks a step); the last expert's
    program also writes offsets[E], the total. The steps are while loops on the runtime `blocks`
    (Triton 3.6's interpreter cannot take a range over a runtime bound; a bound fixed at compile time
    would compile once per token count)."""
    expert = tl.program_id(0)
    ids = tl.arange(0, BLOCK_E)
    lower = ids < expert
    rows = tl.arange(0, ROWS)
    below = tl.zeros((BLOCK_E,), dtype=tl.int32)
    first = 0
    while first < blocks:
        block = first + rows
        mask = (block < blocks)[:, None] & lower[None, :]
        below += tl.sum(
            tl.load(counts_ptr + block[:, None] * EXPERTS + ids[None, :], mask=mask, other=0), axis=0
        )
        first += ROWS
    running = tl.sum(below, axis=0)
    tl.store(offsets_ptr + expert, running)
    column = tl.arange(0, CHUNK)
    first = 0
    while first < blocks:
        block = first + column
        live = block < blocks
        at = block * EXPERTS + expert
        counts = tl.load(counts_ptr + at, mask=live, other=0)
        tl.store(starts_ptr + at, running + tl.cumsum(counts, axis=0) - counts, mask=live)
        running += tl.sum(counts, axis=0)
        first += CHUNK
    if expert == EXPERTS - 1:
        tl.store(offsets_ptr + EXPERTS, running)


def _group(  # noqa: PLR0917
    e_ptr: tl.tensor,
    ranks_ptr: tl.tensor,
    starts_ptr: tl.tensor,
    rows_ptr: tl.tensor,
    slots_ptr: tl.tensor,
    slots: tl.tensor,
    EXPERTS: tl.constexpr,
    PER_BLOCK: tl.constexpr,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
) -> None:
    """BLOCK slots: each one's place = its expert's start in its block + its rank there."""
    slot = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = slot < slots
    expert = tl.load(e_ptr + slot, mask=live, other=0)
    rank = tl.load(ranks_ptr + slot, mask=live, other=0)
    place = tl.load(starts_ptr + (slot // PER_BLOCK) * EXPERTS + expert, mask=live, other=0) + rank
    tl.store(rows_ptr + place, (slot // K).to(tl.int32), mask=live)
    tl.store(slots_ptr + slot, place.to(tl.int64), mask=live)

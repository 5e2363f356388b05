"""Packed (varlen) causal attention for Hugging Face models, behind transformers' AttentionInterface.

The sequences of a micro-batch sit in one row; `cu_seq_lens_q` ([S+1] int32 boundaries) tells the
kernel where each starts, so attention never crosses a sequence boundary. Four kernels:

- flash_attn_cute: flash-attn 4's CuTe `flash_attn_varlen_func` (package flash-attn-4; bf16/fp16 on
                   Ampere, Hopper (FA3's algorithm) and Blackwell; softcap, sliding window);
- flash_attn:   flash-attn 2's `flash_attn_varlen_func` (bf16/fp16 on CUDA; softcap, sliding window);
- torch_varlen: torch's `varlen_attn` (flash kernels shipped with torch; no softcap);
- sdpa:         one `scaled_dot_product_attention` per sequence: the CPU path, and the fallback for
                whatever the fast kernels cannot do (float32, attention softcapping without flash-attn);
- blocked:      batch-invariant mode's CPU path and fallback (`invariant`): fixed query tiles and key
                blocks counted from each sequence's first position (`blocked_kernel`).

Sliding windows follow transformers: a query at i sees keys j with i - W < j <= i.

A segment may have more keys than queries (`cu_k`: the keys of a shared prefix computed by other
segments of the row, or a context cached by earlier micro-batches; batch/kv_store.py): its queries are its
last tokens, so query i of q sees keys j <= i + (k - q), the bottom-right alignment every kernel
here uses.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from service.engine.batch.kv_store import CONTEXT_KWARG, KVContext
from service.engine.runtime import packages as optional
from service.engine.runtime.packages import FAST_DTYPES


@dataclass(frozen=True, slots=True)
class Segments:
    """How one attention call runs over a packed row.

    cu: [S+1] int32 sequence boundaries; max_len: the longest sequence; window: transformers'
    sliding_window (None: full causal); softcap: attention-logit soft-capping (None: off).
    cu_k, max_len_k: the key boundaries and longest key segment where they differ from the queries'
    (None: the same).
    """

    cu: torch.Tensor
    max_len: int
    scale: float
    window: int | None
    softcap: float | None
    cu_k: torch.Tensor | None = None
    max_len_k: int | None = None

    @property
    def keys(self) -> tuple[torch.Tensor, int]:
        """The key boundaries and the longest key segment."""
        if self.cu_k is None:
            return self.cu, self.max_len
        assert self.max_len_k is not None
        return self.cu_k, self.max_len_k


# q: [N, Hq, D], k/v: [N, Hk, D] packed rows -> [N, Hq, D]
Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Segments], torch.Tensor]
# The keyword argument of a transformers decoder forward that carries the Kernel to run, where it is
# not the registered backend's (batch-invariant mode's: `invariant`)
KERNEL_KWARG = "logprobd_kernel"


@dataclass(frozen=True, slots=True)
class AttentionBackend:
    name: str  # one of BACKENDS
    kernel: Kernel

    @property
    def implementation(self) -> str:
        """The name registered with transformers' AttentionInterface.

        Free of "sdpa" and "flash": transformers treats names containing those as its own kernels.
        """
        return _IMPLEMENTATION[self.name]


_IMPLEMENTATION = {
    "flash_attn_cute": "logprobd_fa4_varlen",
    "flash_attn": "logprobd_fa2_varlen",
    "torch_varlen": "logprobd_torch_varlen",
    "sdpa": "logprobd_exact",
    "blocked": "logprobd_blocked",
}
BACKENDS = tuple(_IMPLEMENTATION)


def sdpa_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: Segments) -> torch.Tensor:
    """Reference kernel: exact attention one sequence at a time. O(q_i · k_i) memory per sequence."""
    groups = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    cu_k, _ = seg.keys
    bounds = zip(itertools.pairwise(seg.cu.tolist()), itertools.pairwise(cu_k.tolist()), strict=True)
    for (start, end), (k_start, k_end) in bounds:
        if end == start:
            continue
        qs = q[start:end].transpose(0, 1)  # [Hq, q, D]
        ks = k[k_start:k_end].transpose(0, 1).repeat_interleave(groups, dim=0)  # [Hq, k, D]
        vs = v[k_start:k_end].transpose(0, 1).repeat_interleave(groups, dim=0)
        query = torch.arange(end - start, device=q.device)[:, None] + (k_end - k_start) - (end - start)
        key = torch.arange(k_end - k_start, device=q.device)[None, :]
        allowed = key <= query  # [q, k] causal, bottom-right aligned
        if seg.window is not None:
            allowed &= key > query - seg.window
        if seg.softcap is None:
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=allowed, scale=seg.scale)
        else:
            scores = torch.matmul(qs, ks.transpose(1, 2)) * seg.scale
            scores = torch.tanh(scores / seg.softcap) * seg.softcap
            scores = scores.masked_fill(~allowed, float("-inf"))
            o = torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(vs.dtype), vs)
        out[start:end] = o.transpose(0, 1)
    return out


def flash_attn_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: Segments) -> torch.Tensor:
    if q.dtype not in FAST_DTYPES:
        return sdpa_kernel(q, k, v, seg)
    from flash_attn import flash_attn_varlen_func

    cu_k, max_len_k = seg.keys
    out: torch.Tensor = flash_attn_varlen_func(
        q,
        k,
        v,
        seg.cu,
        cu_k,
        seg.max_len,
        max_len_k,
        softmax_scale=seg.scale,
        causal=True,
        window_size=(seg.window - 1, 0) if seg.window is not None else (-1, -1),
        softcap=seg.softcap or 0.0,
    )
    return out


def flash_cute_kernel(pack_gqa: bool | None = None) -> Kernel:
    """flash-attn 4's kernel; `pack_gqa`: its PackGQA (a key/value head's query heads in one tile's
    rows), None: flash-attn's own choice (on, wherever heads are grouped)."""
    from flash_attn.cute import flash_attn_varlen_func

    packing = {} if pack_gqa is None else {"pack_gqa": pack_gqa}  # the default call names no option

    def kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: Segments) -> torch.Tensor:
        if q.dtype not in FAST_DTYPES:
            return sdpa_kernel(q, k, v, seg)
        cu_k, max_len_k = seg.keys
        out = flash_attn_varlen_func(
            q,
            k,
            v,
            cu_seqlens_q=seg.cu,
            cu_seqlens_k=cu_k,
            max_seqlen_q=seg.max_len,
            max_seqlen_k=max_len_k,
            softmax_scale=seg.scale,
            causal=True,
            window_size=(seg.window - 1, 0) if seg.window is not None else (None, None),
            softcap=seg.softcap or 0.0,
            **packing,
        )
        result = out[0] if isinstance(out, tuple) else out  # (out, lse) in some releases
        assert isinstance(result, torch.Tensor)
        return result

    return kernel


def _torch_varlen_kernel() -> Kernel:
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    native_gqa = "enable_gqa" in params

    def kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: Segments) -> torch.Tensor:
        if seg.softcap is not None or q.dtype not in FAST_DTYPES:
            return sdpa_kernel(q, k, v, seg)
        left = seg.window - 1 if seg.window is not None else -1
        grouped = q.shape[1] != k.shape[1]
        if grouped and not native_gqa:
            return _flash_gqa(q, k, v, seg, left)
        extra: dict[str, Any] = {"window_size": (left, 0)}
        if native_gqa:
            extra["enable_gqa"] = grouped
        cu_k, max_len_k = seg.keys
        out = varlen_attn(q, k, v, seg.cu, cu_k, seg.max_len, max_len_k, scale=seg.scale, **extra)
        assert isinstance(out, torch.Tensor)
        return out

    return kernel


def _flash_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: Segments, left: int) -> torch.Tensor:
    """Grouped-query attention where varlen_attn has no enable_gqa (torch < 2.12): its flash op.

    torch's flash kernels take k/v with fewer heads than q (as flash-attn's do; varlen_attn only
    checks it), so the key and value heads are not repeated: repeating them cost two [N, Hq, D]
    copies a layer, 5 % of Qwen2.5-1.5B's forward on an H100.
    """
    cu_k, max_len_k = seg.keys
    out = torch.ops.aten._flash_attention_forward(
        q,
        k,
        v,
        seg.cu,
        cu_k,
        seg.max_len,
        max_len_k,
        0.0,  # dropout
        left == -1,  # is_causal, as varlen_attn sets it; a window's right edge 0 keeps it causal
        False,  # return_debug_mask
        scale=seg.scale,
        window_size_left=left,
        window_size_right=0,
    )[0]
    assert isinstance(out, torch.Tensor)
    return out


# batch-invariant mode's blocked kernel: queries in tiles of QUERY_TILE rows, keys in blocks of KEY_BLOCK
# positions from each sequence's position 0 (every matmul of one shape per model)
QUERY_TILE = 64
KEY_BLOCK = 64


@dataclass(frozen=True, slots=True)
class _Tiles:
    """Where blocked_kernel's tiles read and write, from the boundaries (read on the host): T query
    tiles of QUERY_TILE rows and B key blocks of KEY_BLOCK keys; an index past the real rows (a zero
    row) where a tile or block runs past its segment.

    query_rows [T, QT], positions [T, QT] (each query's position in its sequence; -1: padding),
    key_rows [B, KB], key_length [T] (the keys of the tile's segment), on the device; per tile on the
    host: first_block (in the table of B blocks), first_key (its first block's first position),
    blocks (how many, in order). Tiles come most blocks first, so a step's tiles are a prefix."""

    query_rows: torch.Tensor
    positions: torch.Tensor
    key_rows: torch.Tensor
    key_length: torch.Tensor
    first_block: np.ndarray
    first_key: np.ndarray
    blocks: np.ndarray


def _tiles(seg: Segments, queries: int, keys: int, device: torch.device) -> _Tiles:
    cu_k, _ = seg.keys
    q_bounds = seg.cu.cpu().numpy().astype(np.int64)
    k_bounds = cu_k.cpu().numpy().astype(np.int64)
    q_len, k_len = np.diff(q_bounds), np.diff(k_bounds)
    live = np.flatnonzero(q_len > 0)
    n_blocks = -(-k_len[live] // KEY_BLOCK)  # key blocks of each live segment
    table = np.concatenate(([0], np.cumsum(n_blocks)))[:-1]  # its first block in the table
    n_tiles = -(-q_len[live] // QUERY_TILE)
    segment = np.repeat(np.arange(live.shape[0]), n_tiles)  # [T] each tile's live segment
    r0 = (np.arange(segment.shape[0]) - np.repeat(np.cumsum(n_tiles) - n_tiles, n_tiles)) * QUERY_TILE
    seq = live[segment]
    r = r0[:, None] + np.arange(QUERY_TILE)  # [T, QT] rows within the segment
    real = r < q_len[seq, None]
    offset = (k_len - q_len)[seq]  # the queries are the segment's last positions (bottom-right aligned)
    last = offset + np.minimum(r0 + QUERY_TILE, q_len[seq]) - 1  # each tile's last query position
    first = np.zeros_like(last)  # each tile's first block: none left of its first query's window
    if seg.window is not None:
        first = np.maximum(0, offset + r0 - seg.window + 1) // KEY_BLOCK
    block = np.arange(int(n_blocks.sum())) - np.repeat(table, n_blocks)  # each block's index in its segment
    key_segment = live[np.repeat(np.arange(live.shape[0]), n_blocks)]
    key_r = block[:, None] * KEY_BLOCK + np.arange(KEY_BLOCK)
    key_rows = np.where(key_r < k_len[key_segment, None], key_r + k_bounds[key_segment, None], keys)

    def to(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).to(device)

    counts = last // KEY_BLOCK + 1 - first
    order = np.argsort(-counts, kind="stable")  # most blocks first: a step's tiles are a prefix
    return _Tiles(
        query_rows=to(np.where(real, r + q_bounds[seq, None], queries)[order]),
        positions=to(np.where(real, r + offset[:, None], -1)[order]),
        key_rows=to(key_rows),
        key_length=to(k_len[seq][order]),
        first_block=(table[segment] + first)[order],
        first_key=(first * KEY_BLOCK)[order],
        blocks=counts[order],
    )


def blocked_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: Segments) -> torch.Tensor:
    """Exact attention whose every query row is reduced over its keys in one order, however the
    queries are segmented: batch-invariant mode's CPU kernel, and its fallback where the fast kernels
    cannot run (float32, a soft-cap torch varlen lacks).

    A segment's queries are cut into tiles of QUERY_TILE rows, its keys (positions 0 .. k-1 of its
    sequence: its own, a shared prefix's or a cached context's) into blocks of KEY_BLOCK positions from
    position 0. Each tile runs an online softmax in float32 over its key blocks in ascending order;
    every product is one batched matmul of fixed shape ([Hk, G·QT, D] x [Hk, D, KB] and [Hk, G·QT, KB]
    x [Hk, KB, D + 1], whose last column of ones sums the weights), so a row's bits depend on its own
    query and keys alone. A block past a row's last key (or before its window) is masked whole for
    that row and leaves its running max, sum and output exactly as they were (exp(0) = 1 scales, zeros
    add), so a row scores the same bits in a tile of any other rows, beside a shared prefix's keys or
    a chunk's cached context, and alone."""
    device, hk, d = q.device, k.shape[1], q.shape[2]
    groups = q.shape[1] // hk
    out = torch.empty_like(q)
    if q.shape[0] == 0:
        return out
    tiles = _tiles(seg, q.shape[0], k.shape[0], device)
    n_tiles = tiles.query_rows.shape[0]
    zero_q = q.new_zeros((1, *q.shape[1:]))
    padded_q = torch.cat([q, zero_q]).float()
    # [T, QT, Hk·G, D] -> [T, Hk, G·QT, D]
    tile_q = padded_q[tiles.query_rows].view(n_tiles, QUERY_TILE, hk, groups, d)
    tile_q = tile_q.permute(0, 2, 3, 1, 4).reshape(n_tiles, hk, groups * QUERY_TILE, d).contiguous()
    padded_k = torch.cat([k, k.new_zeros((1, *k.shape[1:]))]).float()
    padded_v = torch.cat([v, v.new_zeros((1, *v.shape[1:]))]).float()
    n_blocks = tiles.key_rows.shape[0]
    block_k = padded_k[tiles.key_rows].permute(0, 2, 3, 1).contiguous()  # [B, Hk, D, KB]
    block_v = padded_v[tiles.key_rows].permute(0, 2, 1, 3)  # [B, Hk, KB, D]
    ones = block_v.new_ones((n_blocks, hk, KEY_BLOCK, 1))
    block_v = torch.cat([block_v, ones], dim=3).contiguous()  # [B, Hk, KB, D + 1]
    acc = q.new_zeros((n_tiles, hk, groups * QUERY_TILE, d + 1), dtype=torch.float32)
    row_max = acc.new_full((n_tiles, hk, groups, QUERY_TILE), float("-inf"))
    within = torch.arange(KEY_BLOCK, device=device)
    for step in range(int(tiles.blocks[0])):
        t = int(np.count_nonzero(tiles.blocks > step))  # the tiles with a block at this step: a prefix
        blocks = torch.from_numpy(tiles.first_block[:t] + step).to(device)
        key_position = torch.from_numpy(tiles.first_key[:t] + step * KEY_BLOCK).to(device)[:, None] + within
        query_position = tiles.positions[:t]  # [t, QT]
        allowed = key_position[:, None, :] <= query_position[:, :, None]  # [t, QT, KB]
        allowed &= (key_position < tiles.key_length[:t, None])[:, None, :]
        if seg.window is not None:
            allowed &= key_position[:, None, :] > query_position[:, :, None] - seg.window
        scores = torch.matmul(tile_q[:t], block_k[blocks]) * seg.scale  # [t, Hk, G·QT, KB]
        if seg.softcap is not None:
            scores = torch.tanh(scores / seg.softcap) * seg.softcap
        scores = scores.view(t, hk, groups, QUERY_TILE, KEY_BLOCK)
        scores = scores.masked_fill(~allowed[:, None, None], -math.inf)
        previous = row_max[:t]
        new_max = torch.maximum(previous, scores.amax(dim=-1))
        safe = new_max.masked_fill(new_max == -math.inf, 0.0)  # a row with no key yet
        rescale = torch.exp(previous - safe).view(t, hk, groups * QUERY_TILE, 1)
        weights = torch.exp(scores - safe[..., None]).view(t, hk, groups * QUERY_TILE, KEY_BLOCK)
        product = torch.matmul(weights, block_v[blocks])  # [t, Hk, G·QT, D + 1]
        acc[:t] = acc[:t] * rescale + product
        row_max[:t] = new_max
    result = acc[..., :d] / acc[..., d:]  # [T, Hk, G·QT, D]
    result = result.view(n_tiles, hk, groups, QUERY_TILE, d).permute(0, 3, 1, 2, 4)
    result = result.reshape(n_tiles * QUERY_TILE, hk * groups, d)
    rows = tiles.query_rows.flatten()
    real = rows < q.shape[0]
    out[rows[real]] = result[real].to(q.dtype)
    return out


def invariant(backend: AttentionBackend) -> AttentionBackend:
    """`backend` as batch-invariant mode runs it: the blocked kernel on the CPU (sdpa's place) and
    wherever the fast kernel would fall back to sdpa; a fast kernel as it is, the one varlen call for
    segments whose keys are their own, a shared prefix's or a chunk's context alike (its query tiles
    reduce each row over key blocks counted from the segment's key 0, in one order, no split of the
    keys; a block masked whole for a row leaves it as it was)."""
    if backend.name in {"sdpa", "blocked"}:
        return AttentionBackend("blocked", blocked_kernel)
    fast, softcap = backend.kernel, backend.name != "torch_varlen"

    def kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: Segments) -> torch.Tensor:
        if q.dtype not in FAST_DTYPES or (seg.softcap is not None and not softcap):
            return blocked_kernel(q, k, v, seg)
        return fast(q, k, v, seg)

    return AttentionBackend(backend.name, kernel)


# The fast backends `auto` tries on CUDA, in order: the module each needs, its package, and whether the
# device can run it.
_OPTIONAL = {
    "flash_attn_cute": ("flash_attn.cute", "flash-attn-4"),
    "flash_attn": ("flash_attn.flash_attn_interface", "flash-attn"),
    "torch_varlen": ("torch.nn.attention.varlen", "torch >= 2.10"),
}
_DEVICE_NEEDED = {
    "flash_attn_cute": "a CUDA device of compute capability 8.0 or later",
    "torch_varlen": "a CUDA device",
}


def _device_can_run(name: str, device: torch.device) -> bool:
    if name == "flash_attn_cute":
        return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 8
    if name == "torch_varlen":
        return device.type == "cuda"
    return True


def _build(name: str) -> AttentionBackend:
    if name == "flash_attn_cute":
        return AttentionBackend(name, flash_cute_kernel())
    if name == "flash_attn":
        return AttentionBackend(name, flash_attn_kernel)
    return AttentionBackend(name, _torch_varlen_kernel())


def choose_backend(requested: str, device: torch.device) -> AttentionBackend:
    """Resolve the `attention` setting: auto prefers flash-attn 4 (on compute capability 8.0 and up),
    then flash-attn 2, then torch varlen, on CUDA, skipping (with one warning) a package that is
    installed but does not import; an explicit kernel that cannot run fails with the reason."""
    if requested == "auto":
        if device.type != "cuda":
            return AttentionBackend("sdpa", sdpa_kernel)
        for name, (module, package) in _OPTIONAL.items():
            if _device_can_run(name, device) and optional.importable(module, package):
                return _build(name)
        return AttentionBackend("sdpa", sdpa_kernel)
    if requested == "sdpa":
        return AttentionBackend("sdpa", sdpa_kernel)
    module, package = _OPTIONAL[requested]
    if not _device_can_run(requested, device):
        needed = _DEVICE_NEEDED[requested]
        raise RuntimeError(f"attention={requested} needs {needed} and the {package} package")
    optional.required(module, package, f"attention={requested}")
    return _build(requested)


def register(backend: AttentionBackend) -> str:
    """Make `backend` usable as `attn_implementation=<returned name>` in transformers; a forward
    given KERNEL_KWARG runs that kernel instead."""
    from transformers import AttentionInterface

    registered = backend.kernel

    def packed_attention(  # noqa: PLR0917 (transformers calls it positionally)
        module: torch.nn.Module,
        query: torch.Tensor,  # [B, Hq, S, D]
        key: torch.Tensor,  # [B, Hk, S, D]
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        sliding_window: int | None = None,
        softcap: float | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        del attention_mask, dropout  # causality and boundaries come from cu_seq_lens_q
        batch, heads, seq, dim = query.shape
        cu: torch.Tensor | None = kwargs.get("cu_seq_lens_q")
        max_len = int(kwargs.get("max_length_q") or seq)
        if cu is None:  # an ordinary call (e.g. the self-check): each row is one whole sequence
            cu = torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32, device=query.device)
        q = query.transpose(1, 2).reshape(batch * seq, heads, dim)
        k = key.transpose(1, 2).reshape(batch * seq, key.shape[1], dim)
        v = value.transpose(1, 2).reshape(batch * seq, value.shape[1], dim)
        scale = scaling if scaling is not None else dim**-0.5
        seg = Segments(cu, max_len, scale, sliding_window, softcap)
        context: KVContext | None = kwargs.get(CONTEXT_KWARG)
        if context is not None:  # shared prefixes' keys, the last segment's cached context
            k, v = context.extend(int(getattr(module, "layer_idx")), k, v)  # noqa: B009 (a Module attribute)
            seg = dataclasses.replace(seg, cu_k=context.cu_k, max_len_k=context.max_len_k)
        kernel: Kernel = kwargs.get(KERNEL_KWARG) or registered
        out = kernel(q, k, v, seg)
        return out.reshape(batch, seq, heads, dim), None

    AttentionInterface.register(backend.implementation, packed_attention)
    return backend.implementation

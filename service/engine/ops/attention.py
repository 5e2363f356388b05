"""Packed (varlen) causal attention for Hugging Face models, behind transformers' AttentionInterface.

The sequences of a micro-batch sit in one row; `cu_seq_lens_q` ([S+1] int32 boundaries) tells the
kernel where each starts, so attention never crosses a sequence boundary. Four kernels:

- flash_attn_cute: flash-attn 4's CuTe `flash_attn_varlen_func` (package flash-attn-4; bf16/fp16 on
                   Ampere, Hopper (FA3's algorithm) and Blackwell; softcap, sliding window);
- flash_attn:   flash-attn 2's `flash_attn_varlen_func` (bf16/fp16 on CUDA; softcap, sliding window);
- torch_varlen: torch's `varlen_attn` (flash kernels shipped with torch; no softcap);
- sdpa:         one `scaled_dot_product_attention` per sequence: the CPU path, and the fallback for
                whatever the fast kernels cannot do (float32, attention softcapping without flash-attn).

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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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


def _flash_cute_kernel() -> Kernel:
    from flash_attn.cute import flash_attn_varlen_func

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
        return AttentionBackend(name, _flash_cute_kernel())
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
    """Make `backend` usable as `attn_implementation=<returned name>` in transformers."""
    from transformers import AttentionInterface

    kernel = backend.kernel

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
        out = kernel(q, k, v, seg)
        return out.reshape(batch, seq, heads, dim), None

    AttentionInterface.register(backend.implementation, packed_attention)
    return backend.implementation

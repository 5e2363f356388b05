"""Packed (varlen) causal attention for Hugging Face models, behind transformers' AttentionInterface.

The sequences of a micro-batch sit in one row; `cu_seq_lens_q` ([S+1] int32 boundaries) tells the
kernel where each starts, so attention never crosses a sequence boundary. Three kernels:

- flash_attn:   flash-attn's `flash_attn_varlen_func` (bf16/fp16 on CUDA; softcap, sliding window);
- torch_varlen: torch's `varlen_attn` (flash kernels shipped with torch; no softcap);
- sdpa:         one `scaled_dot_product_attention` per sequence: the CPU path, and the fallback for
                whatever the fast kernels cannot do (float32, attention softcapping without flash-attn).

Sliding windows follow transformers: a query at i sees keys j with i - W < j <= i.
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

# q, k, v: [N, H, D] packed rows; cu: [S+1] int32; returns [N, Hq, D]
Kernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float, "int | None", "float | None"],
    torch.Tensor,
]

FAST_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True, slots=True)
class AttentionBackend:
    name: str  # flash_attn | torch_varlen | sdpa
    kernel: Kernel

    @property
    def implementation(self) -> str:
        """The name registered with transformers' AttentionInterface."""
        return f"logprobd_{self.name}"


def sdpa_kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu: torch.Tensor,
    max_len: int,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """Reference kernel: exact attention one sequence at a time. O(L_i^2) memory per sequence."""
    del max_len
    groups = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    bounds = cu.tolist()
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        qs = q[start:end].transpose(0, 1)  # [Hq, l, D]
        ks = k[start:end].transpose(0, 1).repeat_interleave(groups, dim=0)  # [Hq, l, D]
        vs = v[start:end].transpose(0, 1).repeat_interleave(groups, dim=0)
        length = end - start
        idx = torch.arange(length, device=q.device)
        allowed = idx[None, :] <= idx[:, None]  # [l, l] causal
        if window is not None and window < length:
            allowed &= idx[None, :] > idx[:, None] - window
        if softcap is None:
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=allowed, scale=scale)
        else:
            scores = torch.matmul(qs, ks.transpose(1, 2)) * scale
            scores = torch.tanh(scores / softcap) * softcap
            scores = scores.masked_fill(~allowed, float("-inf"))
            o = torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(vs.dtype), vs)
        out[start:end] = o.transpose(0, 1)
    return out


def flash_attn_kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu: torch.Tensor,
    max_len: int,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    if q.dtype not in FAST_DTYPES:
        return sdpa_kernel(q, k, v, cu, max_len, scale, window, softcap)
    from flash_attn import flash_attn_varlen_func

    out: torch.Tensor = flash_attn_varlen_func(
        q,
        k,
        v,
        cu,
        cu,
        max_len,
        max_len,
        softmax_scale=scale,
        causal=True,
        window_size=(window - 1, 0) if window is not None else (-1, -1),
        softcap=softcap or 0.0,
    )
    return out


def _torch_varlen_kernel() -> Kernel:
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    native_gqa = "enable_gqa" in params

    def kernel(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu: torch.Tensor,
        max_len: int,
        scale: float,
        window: int | None,
        softcap: float | None,
    ) -> torch.Tensor:
        if softcap is not None or q.dtype not in FAST_DTYPES:
            return sdpa_kernel(q, k, v, cu, max_len, scale, window, softcap)
        extra: dict[str, Any] = {"window_size": (window - 1 if window is not None else -1, 0)}
        if native_gqa:
            extra["enable_gqa"] = q.shape[1] != k.shape[1]
        elif q.shape[1] != k.shape[1]:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out: torch.Tensor = varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scale, **extra)
        return out

    return kernel


def choose_backend(requested: str, device: torch.device) -> AttentionBackend:
    """Resolve the `attention` setting: auto prefers flash-attn, then torch varlen, on CUDA."""
    has_flash = importlib.util.find_spec("flash_attn") is not None
    has_varlen = importlib.util.find_spec("torch.nn.attention.varlen") is not None
    if requested == "auto":
        if device.type != "cuda":
            requested = "sdpa"
        else:
            requested = "flash_attn" if has_flash else "torch_varlen" if has_varlen else "sdpa"
    if requested == "flash_attn":
        if not has_flash:
            raise RuntimeError("attention=flash_attn but the flash_attn package is not importable")
        return AttentionBackend("flash_attn", flash_attn_kernel)
    if requested == "torch_varlen":
        if not has_varlen or device.type != "cuda":
            raise RuntimeError("attention=torch_varlen needs torch.nn.attention.varlen and a CUDA device")
        return AttentionBackend("torch_varlen", _torch_varlen_kernel())
    return AttentionBackend("sdpa", sdpa_kernel)


def register(backend: AttentionBackend) -> str:
    """Make `backend` usable as `attn_implementation=<returned name>` in transformers."""
    from transformers import AttentionInterface

    kernel = backend.kernel

    def packed_attention(
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
        del module, attention_mask, dropout  # causality and boundaries come from cu_seq_lens_q
        batch, heads, seq, dim = query.shape
        cu = kwargs.get("cu_seq_lens_q")
        max_len = kwargs.get("max_length_q")
        if cu is None:  # an ordinary call (e.g. the self-check): each row is one whole sequence
            cu = torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32, device=query.device)
            max_len = seq
        q = query.transpose(1, 2).reshape(batch * seq, heads, dim)
        k = key.transpose(1, 2).reshape(batch * seq, key.shape[1], dim)
        v = value.transpose(1, 2).reshape(batch * seq, value.shape[1], dim)
        scale = scaling if scaling is not None else dim**-0.5
        out = kernel(q, k, v, cu, int(max_len), scale, sliding_window, softcap)
        return out.reshape(batch, seq, heads, dim), None

    AttentionInterface.register(backend.implementation, packed_attention)
    return backend.implementation

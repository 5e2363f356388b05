"""A fused RoPE for one model instance, when the architecture applies RoPE through a module global.

transformers' decoders call `apply_rotary_pos_emb(q, k, cos, sin)`, a global of their modeling
module, from their attention's forward, so a fused kernel can only be swapped in module-wide:
liger does exactly that, which changes every model of the architecture in the process (a reference
model, a test model). Here the global becomes a dispatcher, installed once per modeling module, that
calls the original function unless the calling thread is inside the forward of an attention module
that `fuse_rope` wrapped; only those get the fused kernel. Other models see the original function,
one Python call deeper.

The fused kernel is used only where it computes the same thing as the original: the standard
layout (q, k: [B, heads, L, D], cos/sin: [B or 1, L, D], unsqueeze_dim=1) with the rotation over the
whole head (cos/sin as wide as q's head), on the kernel's device type. Anything else (partial
rotary, another layout, a tensor elsewhere) takes the original path.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

import torch

NAME = "apply_rotary_pos_emb"

# q, k, cos, sin -> (q, k) rotated; may rotate q and k in place
RopeFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class _Fused:
    """An attention module's forward with `fused` active while it runs (in this thread only)."""

    def __init__(self, forward: Callable[..., Any], fused: RopeFn, device_type: str) -> None:
        self.forward = forward
        self.fused = fused
        self.device_type = device_type

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        token = _ACTIVE.set(self)
        try:
            return self.forward(*args, **kwargs)
        finally:
            _ACTIVE.reset(token)


# the fused attention module whose forward runs in this thread (None: the original function)
_ACTIVE: ContextVar[_Fused | None] = ContextVar("logprobd_fused_rope", default=None)


class _Dispatcher:
    """Stands in for a modeling module's `apply_rotary_pos_emb`."""

    def __init__(self, original: Callable[..., Any]) -> None:
        self.original = original
        self.__doc__ = original.__doc__
        self.__wrapped__ = original

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        active = _ACTIVE.get()
        if (
            active is not None
            and q.device.type == active.device_type
            and _fusable(q, k, cos, sin, *args, **kwargs)
        ):
            return active.fused(q, k, cos, sin)
        return self.original(q, k, cos, sin, *args, **kwargs)


def _fusable(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *args: Any, **kwargs: Any
) -> bool:
    """The call is the standard full-head RoPE that the fused kernels implement."""
    if len(args) > 1 or set(kwargs) - {"unsqueeze_dim"}:
        return False
    if (args[0] if args else kwargs.get("unsqueeze_dim", 1)) != 1:
        return False
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or cos.shape != sin.shape:
        return False
    batch, _, length, head_dim = q.shape
    return (
        k.shape[0] == batch
        and k.shape[2:] == q.shape[2:]
        and cos.shape[0] in (1, batch)
        and cos.shape[1:] == (length, head_dim)
        and q.dtype == k.dtype == cos.dtype == sin.dtype
    )


def fuse_rope(model: torch.nn.Module, fused: RopeFn, device_type: str = "cuda") -> int:
    """Route the RoPE of `model`'s attention modules through `fused`; return how many modules.

    A module qualifies when its class's forward (under any decorators) calls the global
    `apply_rotary_pos_emb` of the module that defines it; that global becomes a dispatcher (once).
    `fused` runs on tensors of `device_type` only. Nothing else changes.
    """
    count = 0
    for module in model.modules():
        forward = getattr(type(module), "forward", None)
        if forward is not None:  # the function itself, under decorators (transformers' deprecate_kwarg)
            forward = inspect.unwrap(forward)
        code = getattr(forward, "__code__", None)
        if code is None or NAME not in code.co_names or isinstance(module.forward, _Fused):
            continue
        namespace: dict[str, Any] = forward.__globals__  # type: ignore[union-attr]
        current = namespace.get(NAME)
        if current is None:
            continue
        if not isinstance(current, _Dispatcher):
            namespace[NAME] = _Dispatcher(current)
        module.forward = _Fused(module.forward, fused, device_type)
        count += 1
    return count


def unfuse_rope(model: torch.nn.Module) -> int:
    """Undo `fuse_rope` on `model` (the dispatchers stay; they are the original without the flag)."""
    count = 0
    for module in model.modules():
        if isinstance(module.__dict__.get("forward"), _Fused):
            del module.forward
            count += 1
    return count


def fused_active() -> bool:
    """Whether the calling thread is inside a fused attention module's forward."""
    return _ACTIVE.get() is not None

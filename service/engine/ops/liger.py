"""Optional fused decoder kernels: liger-kernel's Triton RMSNorm, SwiGLU/GeGLU MLP and RoPE.

They replace memory-bound chains of elementwise ops; on CUDA only, for the architectures liger
patches (BENCHMARKS.md has what they save). Only the given model instance is patched: liger also
rebinds names in the transformers modeling module (for models built later), which is undone here so
that no other model in the process (a reference, a test model) changes behind its back. liger can
only install RoPE module-wide, so its RoPE kernel goes in through ops/rope.py's per-instance dispatch.
The model's head is untouched (no fused cross-entropy: logprobd runs its own head).
"""

from __future__ import annotations

import inspect
import logging
import sys
from typing import Any

import torch

from service.engine.ops.rope import fuse_rope
from service.engine.runtime import packages as optional

log = logging.getLogger(__name__)

LIGER = "liger_kernel.transformers"

_WANTED = {
    "rope": False,  # module-wide in liger: installed per instance below instead
    "rms_norm": True,
    "swiglu": True,
    "geglu": True,
    "cross_entropy": False,
    "fused_linear_cross_entropy": False,
}


def apply_fused_kernels(model: Any, setting: str, device: torch.device, batch_invariant: bool = False) -> str:
    """Patch `model` per the `kernels` setting; return what runs ("liger" or "none").
    batch_invariant: liger's RMSNorm keeps its one-row kernel whatever the row count (`_pin_rows`)."""
    if setting == "none" or (setting == "auto" and device.type != "cuda"):
        return "none"
    model_type = str(model.config.model_type)
    patch = _liger_patch(model_type, setting)
    if patch is None:
        if setting == "liger":
            raise RuntimeError(
                f"kernels=liger: liger-kernel is not importable or has no patch for {model_type}"
            )
        return "none"
    params = inspect.signature(patch).parameters
    modeling = sys.modules[type(model).__module__]
    before = dict(vars(modeling))
    own = {module: set(vars(module)) for module in model.modules()}  # what liger binds goes in here
    try:
        patch(model=model, **{k: v for k, v in _WANTED.items() if k in params})
    except Exception as exc:  # liger fails on a model it names (e.g. qwen3_moe with mlp_only_layers)
        if setting == "liger":
            raise RuntimeError(
                f"kernels=liger: liger-kernel's patch for {model_type} failed: {exc!r}"
            ) from exc
        for module, names in own.items():  # undo what it bound before failing
            for name in set(vars(module)) - names:
                delattr(module, name)
        log.warning("kernels=auto: liger-kernel's patch for %s failed (%r); it runs without", model_type, exc)
        return "none"
    finally:
        for name, value in before.items():  # keep the patch on this instance only
            if getattr(modeling, name, None) is not value:
                setattr(modeling, name, value)
    fused = "RMSNorm and MLP"
    rope = params.get("rope")  # liger fuses RoPE by default only where its kernel fits the architecture
    if rope is not None and rope.default is True and fuse_rope(model, _liger_rope()):
        fused = "RMSNorm, MLP and RoPE"
    if batch_invariant:
        _pin_rows(model)
    log.info("liger-kernel fused %s applied to this %s model", fused, model_type)
    return "liger"


def _pin_rows(model: Any) -> int:
    """liger's RMSNorm takes a one-row kernel below 32k rows of at most 256 columns and a 16-row block
    kernel above, which round apart (Qwen3's per-head q/k norms cross it at 1024 tokens): pin each
    patched norm to the row kernel (its `row_mode`), so a row's bits do not depend on the batch.
    Returns how many."""
    count = 0
    for module in model.modules():
        if hasattr(module, "row_mode") and hasattr(module, "casting_mode"):  # a liger-patched RMSNorm
            module.row_mode = True
            count += 1
    return count


def _liger_patch(model_type: str, setting: str) -> Any:
    """liger's patch function for `model_type`, None where there is none. A liger-kernel that is
    installed but does not import: None with one warning under auto, an error under kernels=liger."""
    liger = (
        optional.required(LIGER, "liger-kernel", "kernels=liger")
        if setting == "liger"
        else optional.optional(LIGER, "liger-kernel")
    )
    return getattr(liger, f"apply_liger_kernel_to_{model_type}", None) if liger is not None else None


def _liger_rope() -> Any:
    from liger_kernel.transformers.rope import liger_rotary_pos_emb

    def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Any:
        return liger_rotary_pos_emb(q, k, cos, sin)  # rotates q and k in place

    return rope

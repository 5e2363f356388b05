"""Optional fused decoder kernels: liger-kernel's Triton RMSNorm, RoPE and SwiGLU/GeGLU.

They replace memory-bound chains of elementwise ops; on CUDA only, for the architectures liger
patches. Measured on an H200 (BENCHMARKS.md): 23% less engine time at Qwen2.5-1.5B, none at 7B.
The model's head is untouched (no fused cross-entropy: logprobd runs its own head).
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
from typing import Any

import torch

log = logging.getLogger(__name__)

_WANTED = {
    "rope": True,
    "rms_norm": True,
    "swiglu": True,
    "geglu": True,
    "cross_entropy": False,
    "fused_linear_cross_entropy": False,
}


def apply_fused_kernels(model: Any, setting: str, device: torch.device) -> str:
    """Patch `model` per the `kernels` setting; return what runs ("liger" or "none")."""
    if setting == "none" or (setting == "auto" and device.type != "cuda"):
        return "none"
    model_type = str(model.config.model_type)
    patch = _liger_patch(model_type)
    if patch is None:
        if setting == "liger":
            raise RuntimeError(
                f"kernels=liger: liger-kernel is not importable or has no patch for {model_type}"
            )
        return "none"
    params = inspect.signature(patch).parameters
    patch(model=model, **{k: v for k, v in _WANTED.items() if k in params})
    log.info("liger-kernel fused RMSNorm/RoPE/MLP applied to %s", model_type)
    return "liger"


def _liger_patch(model_type: str) -> Any:
    if importlib.util.find_spec("liger_kernel") is None:
        return None
    import liger_kernel.transformers as liger

    return getattr(liger, f"apply_liger_kernel_to_{model_type}", None)

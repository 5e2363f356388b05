"""Optional kernel packages (flash-attn 2 and 4, quack-kernels): whether one is importable here, and
the dtypes their fast kernels take."""

from __future__ import annotations

import importlib.util

import torch

FAST_DTYPES = (torch.bfloat16, torch.float16)


def importable(module: str) -> bool:
    """Whether `module` can be found without importing it; a missing parent package counts as not
    (flash-attn 4 alone leaves `flash_attn` a namespace package with no flash-attn 2 modules)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False

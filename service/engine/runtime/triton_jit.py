"""Triton, imported on first use and never at import time: the engine loads on machines without it.

A kernel function is written at module level with `tl` (triton.language) as a module global, which
is bound when the kernel is first jitted. Under TRITON_INTERPRET=1 in the environment before triton
is first imported (the CPU tests), `triton.jit` returns the interpreter instead of a compiler.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
from collections.abc import Callable
from typing import Any

import torch

from service.engine.runtime import packages as optional


def triton() -> Any:
    """The triton module, or None where it is missing or does not import (then one warning)."""
    return optional.optional("triton", "triton")


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in {"1", "true", "on", "yes"}


def available(device: torch.device) -> bool:
    """True where the service runs its Triton kernels: a CUDA device and an importable triton."""
    return device.type == "cuda" and triton() is not None


def runnable(tensor: torch.Tensor) -> None:
    """Raise unless a kernel can run on `tensor`: on CUDA, or anywhere under the interpreter."""
    if tensor.device.type != "cuda" and not interpreting():
        raise ValueError(f"Triton kernels run on CUDA or under TRITON_INTERPRET=1, not on {tensor.device}")
    if triton() is None:
        raise RuntimeError("this kernel needs triton, which is not importable")


@functools.cache
def jit(kernel: Callable[..., None], runtime: tuple[str, ...] = ()) -> Any:
    """`kernel` jitted (compiled, or interpreted under TRITON_INTERPRET=1), with `tl` bound for it.
    `runtime`: integer arguments compiled for any value (Triton otherwise compiles a kernel again for
    an integer equal to 1 and for one divisible by 16)."""
    module = triton()
    if module is None:
        raise RuntimeError("this kernel needs triton, which is not importable")
    kernel.__globals__["tl"] = importlib.import_module("triton.language")
    return module.jit(kernel, do_not_specialize=list(runtime))


def on_device(tensor: torch.Tensor) -> contextlib.AbstractContextManager[Any]:
    """Triton launches on the current CUDA device, not on the tensors': make it the tensor's."""
    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)

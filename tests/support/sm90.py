"""A service Triton kernel compiled for Hopper (sm_90) on a machine without a GPU: triton lowers it
to PTX and its bundled ptxas assembles a cubin, so a kernel the interpreter runs but the compiler
rejects fails on the CPU host. Tests that call it skip where triton does not import."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def compile_sm90(fn: Callable[..., None], signature: dict[str, str], constants: dict[str, Any]) -> Any:
    """`fn` (a module-level kernel written with `tl` as a global) compiled with 4 warps: the compiled
    kernel (its `asm` holds the PTX and the cubin). `signature`: the runtime arguments' types."""
    triton = importlib.import_module("triton")
    compiler = importlib.import_module("triton.compiler")
    backends = importlib.import_module("triton.backends.compiler")
    fn.__globals__["tl"] = importlib.import_module("triton.language")  # as triton_jit.jit binds it
    source = compiler.ASTSource(
        triton.jit(fn), {**signature, **dict.fromkeys(constants, "constexpr")}, constexprs=constants
    )
    return compiler.compile(source, target=backends.GPUTarget("cuda", 90, 64), options={"num_warps": 4})

"""Optional kernel packages (flash-attn 2 and 4, quack-kernels, liger-kernel, triton): whether one
imports here, and the dtypes their fast kernels take.

A package can be missing (fine: the service runs without it) or installed but broken: a native
library it links is absent, it was built for another CUDA or torch, its own dependencies conflict.
Importing a broken one raises anything (ImportError, OSError, RuntimeError...). `auto` settings call
`optional`, which logs one warning naming the package and the error and answers None, so the service
falls back; an explicit setting calls `required`, which fails the start with that error.
"""

from __future__ import annotations

import functools
import importlib
import logging
from types import ModuleType

import torch

log = logging.getLogger(__name__)

FAST_DTYPES = (torch.bfloat16, torch.float16)


class BrokenPackage(RuntimeError):
    """An optional package that is installed but fails to import."""

    def __init__(self, module: str, package: str, error: BaseException) -> None:
        failure = f"{type(error).__name__}: {error}"
        super().__init__(f"{package} is installed but `import {module}` fails: {failure}")
        self.module, self.package, self.error = module, package, error


def _missing(error: ModuleNotFoundError, module: str) -> bool:
    """Whether `error` says `module` itself (or a parent package of it) is absent, rather than
    something the package imports."""
    return error.name is not None and (module == error.name or module.startswith(error.name + "."))


@functools.cache
def _load(module: str, package: str) -> ModuleType | BrokenPackage | None:
    """One import attempt per process (a failed import leaves nothing in sys.modules and would run
    the package's import-time code again each time)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if _missing(exc, module):
            return None
        return BrokenPackage(module, package, exc)
    except Exception as exc:  # any failure of third-party import-time code: native libs, CUDA builds
        return BrokenPackage(module, package, exc)


@functools.cache
def _warn(module: str, package: str, message: str) -> None:
    log.warning("%s; continuing without it", message)


def optional(module: str, package: str) -> ModuleType | None:
    """`module` imported, or None where its package is missing or broken (broken: one warning)."""
    loaded = _load(module, package)
    if isinstance(loaded, BrokenPackage):
        _warn(module, package, str(loaded))
        return None
    return loaded


def required(module: str, package: str, setting: str) -> ModuleType:
    """`module` imported, for an explicit `setting` (e.g. "attention=flash_attn_cute"): a missing or
    broken package raises RuntimeError, which fails the start."""
    loaded = _load(module, package)
    if isinstance(loaded, BrokenPackage):
        raise RuntimeError(f"{setting}: {loaded}") from loaded.error
    if loaded is None:
        raise RuntimeError(f"{setting} needs the {package} package, which is not installed")
    return loaded


def importable(module: str, package: str) -> bool:
    """Whether `module` imports (a broken package: warned once, False)."""
    return optional(module, package) is not None


def forget() -> None:
    """Drop the remembered import outcomes and warnings (for tests that install or break packages)."""
    _load.cache_clear()
    _warn.cache_clear()

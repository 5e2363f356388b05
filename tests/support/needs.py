"""What a test needs from the host, declared once, as a marker; a pytest plugin (tests/conftest.py
loads it) that registers the markers and skips a marked test, naming what is missing, where the host
lacks it.

    @pytest.mark.gpu        a CUDA device (compiled kernels: not in Triton's interpreter process)
    @pytest.mark.hopper     a CUDA device of compute capability 9.0 (kernels built for sm_90 only)
    @pytest.mark.quack      quack-kernels importable and a CUDA device of compute capability 9.0+
    @pytest.mark.liger      liger-kernel installed, and a CUDA device
    @pytest.mark.two_gpus   two CUDA devices (tensor parallel over NCCL, a GPU per rank)

Every one of them implies `gpu`: `pytest -m gpu` selects all of them (`make test-gpu`). Two more
markers select, not skip: `parity` (the suites `make test-gpu` runs again with the service on cuda,
LOGPROBD_TEST_DEVICE=cuda, in each dtype: tests/support/device.py) and `slow`.

What the CPU suite needs beyond Python packages (the native JSON row reader, Prometheus, the image)
skips where it is missing, or fails where CI asks for it (`skip_or_fail`, LOGPROBD_REQUIRE_*).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

import pytest


@dataclass(frozen=True)
class Need:
    """A marker for something a test needs from the host, and why the host lacks it (None: it has it)."""

    marker: str
    meaning: str
    missing: Callable[[], str | None]


@functools.cache
def _no_gpu() -> str | None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "needs compiled kernels: this is Triton's interpreter process (TRITON_INTERPRET=1)"
    import torch

    return None if torch.cuda.is_available() else "needs a CUDA device"


@functools.cache
def _no_hopper() -> str | None:
    import torch

    capability = torch.cuda.get_device_capability(0)
    return (
        None if capability == (9, 0) else f"needs a CUDA device of compute capability 9.0, not {capability}"
    )


@functools.cache
def _no_quack() -> str | None:
    import torch

    from service.engine.heads import quack_head
    from service.engine.ops import gate_up

    if gate_up.quack_available(torch.device("cuda")) and quack_head.importable():
        return None
    return "needs quack-kernels (the hopper extra) and a CUDA device of compute capability 9.0+"


def _no_liger() -> str | None:
    return None if importlib.util.find_spec("liger_kernel") else "needs liger-kernel installed"


@functools.cache
def _no_second_gpu() -> str | None:
    import torch

    return None if torch.cuda.device_count() >= 2 else "needs two CUDA devices"


GPU = Need("gpu", "needs a CUDA device (make test-gpu runs every test marked so)", _no_gpu)
NEEDS = (
    GPU,
    Need("hopper", "needs a CUDA device of compute capability 9.0 (implies gpu)", _no_hopper),
    Need("quack", "needs quack-kernels and a CUDA device of capability 9.0+ (implies gpu)", _no_quack),
    Need("liger", "needs liger-kernel installed (implies gpu)", _no_liger),
    Need("two_gpus", "needs two CUDA devices (implies gpu)", _no_second_gpu),
)
SELECTORS = {
    "parity": "runs the service on LOGPROBD_TEST_DEVICE/_DTYPE: make test-gpu runs it on cuda in each dtype",
    "slow": "longer-running",
}


def pytest_configure(config: pytest.Config) -> None:
    for need in NEEDS:
        config.addinivalue_line("markers", f"{need.marker}: {need.meaning}")
    for marker, meaning in SELECTORS.items():
        config.addinivalue_line("markers", f"{marker}: {meaning}")


@pytest.hookimpl(tryfirst=True)  # before -m selects: a test marked `quack` is also a `gpu` one
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        needed = [need for need in NEEDS if item.get_closest_marker(need.marker) is not None]
        if not needed:
            continue
        if needed[0] is not GPU:
            item.add_marker(pytest.mark.gpu)
            needed.insert(0, GPU)
        reason = next((r for r in (need.missing() for need in needed) if r is not None), None)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


def skip_or_fail(problem: str, required_by: str) -> NoReturn:
    """Skip the test for `problem`; fail it instead where the environment variable `required_by` is 1
    (.ci/run sets LOGPROBD_REQUIRE_NATIVE, _PROMETHEUS and _IMAGE: there nothing may skip for them)."""
    if os.environ.get(required_by) == "1":
        pytest.fail(f"{problem} ({required_by}=1)")
    pytest.skip(problem)


def native_or_skip() -> None:
    """Skip unless the native JSON row reader (service/wire/_jsonrows.c) was built; with
    LOGPROBD_REQUIRE_NATIVE=1 (CI) its absence fails instead."""
    from service.wire import jsonrows

    if jsonrows.native() is None:
        skip_or_fail(
            "service.wire._jsonrows is not built (pip install -e . compiles it; needs a C compiler)",
            "LOGPROBD_REQUIRE_NATIVE",
        )

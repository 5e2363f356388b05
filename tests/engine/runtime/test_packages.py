"""Optional kernel packages that are installed but broken: `auto` logs one warning naming the package
and the error and falls back; an explicit setting fails the start with that error.

Each test puts a fake package on sys.path whose import raises what a broken install raises on a GPU
host (a native library that does not load, a build for another CUDA, a dependency missing), and
takes the CUDA branch on this CPU host by reporting a compute capability for device "cuda" (the
choice is made without touching the device; nothing here runs a kernel).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from service.engine.ops import gate_up as gated
from service.engine.ops.attention import choose_backend
from service.engine.ops.elementwise import TORCH
from service.engine.ops.liger import apply_fused_kernels
from service.engine.runtime import packages as optional
from service.engine.runtime import triton_jit
from tests.support import models
from tests.support.device import settings_for
from tests.support.fake_packages import fake_site
from tests.support.servers import running

CUDA = torch.device("cuda")

# What importing a broken install raises: (the statement in the fake module, what the error says)
FAILURES = {
    "native library": ("raise ImportError('libcudart.so.13: cannot open shared object file')", "libcudart"),
    "os error": ("raise OSError('libcuda.so.1: cannot open shared object file')", "libcuda.so.1"),
    "wrong cuda build": ("raise RuntimeError('compiled for CUDA 12.8, found CUDA 13.0')", "CUDA 12.8"),
    "missing dependency": ("import cutlass_not_installed_here", "cutlass_not_installed_here"),
}


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory ahead of site-packages for fake packages (tests/support/fake_packages.py): what
    the test imports of them leaves sys.modules with it."""
    with fake_site(tmp_path, monkeypatch, {"flash_attn", "quack", "liger_kernel", "triton"}) as path:
        yield path


@pytest.fixture
def capability(monkeypatch: pytest.MonkeyPatch) -> None:
    """Device "cuda" reports compute capability 9.0 (a Hopper), so `auto` weighs the fast kernels."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))


def fake(site: Path, module: str, body: str = "") -> None:
    """A package for dotted `module` under `site`; the innermost __init__.py holds `body`."""
    path = site
    for part in module.split("."):
        path /= part
        path.mkdir(exist_ok=True)
        (path / "__init__.py").touch()
    (path / "__init__.py").write_text(body + "\n")


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


@pytest.mark.parametrize("failure", FAILURES)
@pytest.mark.usefixtures("capability")
def test_auto_attention_skips_a_broken_flash_attn_4(
    site: Path, failure: str, caplog: pytest.LogCaptureFixture
) -> None:
    statement, says = FAILURES[failure]
    fake(site, "flash_attn.cute", statement)  # flash-attn-4 alone: no flash_attn_interface
    with caplog.at_level(logging.WARNING):
        assert choose_backend("auto", CUDA).name == "torch_varlen"
        assert choose_backend("auto", CUDA).name == "torch_varlen"  # a second model: no second warning
    (warning,) = warnings_of(caplog)
    assert "flash-attn-4" in warning
    assert "import flash_attn.cute" in warning
    assert says in warning
    with pytest.raises(RuntimeError, match="attention=flash_attn_cute: flash-attn-4 is installed") as info:
        choose_backend("flash_attn_cute", CUDA)
    assert says in str(info.value)


@pytest.mark.usefixtures("capability")
def test_auto_attention_skips_a_broken_flash_attn_2_for_a_working_one(
    site: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """flash_attn itself broken (flash-attn 2 built for another torch): neither flash-attn 2 nor 4
    loads, each is named once, and torch's varlen kernel is used."""
    fake(site, "flash_attn", "raise ImportError('undefined symbol: _ZN3c104cuda9SetDevice')")
    fake(site, "flash_attn.flash_attn_interface")
    fake(site, "flash_attn.cute")
    with caplog.at_level(logging.WARNING):
        assert choose_backend("auto", CUDA).name == "torch_varlen"
    warnings = warnings_of(caplog)
    assert len(warnings) == 2
    assert any("flash-attn-4" in w and "undefined symbol" in w for w in warnings)
    assert any("flash-attn is installed" in w and "undefined symbol" in w for w in warnings)
    with pytest.raises(RuntimeError, match=r"attention=flash_attn: flash-attn is installed but.*undefined"):
        choose_backend("flash_attn", CUDA)


def test_a_broken_flash_attn_does_not_stop_auto_on_cpu(site: Path, caplog: pytest.LogCaptureFixture) -> None:
    """On CPU `auto` is sdpa without importing any kernel package; asking for flash_attn there fails
    with the import error."""
    fake(site, "flash_attn", "raise RuntimeError('CUDA driver initialization failed')")
    fake(site, "flash_attn.flash_attn_interface")
    with caplog.at_level(logging.WARNING):
        assert choose_backend("auto", torch.device("cpu")).name == "sdpa"
    assert warnings_of(caplog) == []
    with pytest.raises(RuntimeError, match="CUDA driver initialization failed"):
        choose_backend("flash_attn", torch.device("cpu"))


def test_a_missing_package_is_not_broken(site: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Not installed at all: no warning; the explicit setting says which package to install."""
    del site
    with caplog.at_level(logging.WARNING):
        assert optional.optional("flash_attn_not_installed.cute", "flash-attn-x") is None
    assert warnings_of(caplog) == []
    with pytest.raises(RuntimeError, match="needs the flash-attn-x package, which is not installed"):
        optional.required("flash_attn_not_installed.cute", "flash-attn-x", "attention=x")


@pytest.mark.usefixtures("capability")
def test_auto_mlp_kernel_skips_a_broken_quack(site: Path, caplog: pytest.LogCaptureFixture) -> None:
    fake(site, "quack", "raise RuntimeError('nvidia-cutlass-dsl 4.4 is not supported, need 4.6')")
    fake(site, "quack.gemm_interface")
    with caplog.at_level(logging.WARNING):
        assert gated.choose("auto", CUDA, torch.bfloat16, TORCH.swiglu).name == "split"
        assert not gated.quack_available(CUDA)
    (warning,) = warnings_of(caplog)
    assert "quack-kernels" in warning
    assert "nvidia-cutlass-dsl 4.4" in warning
    with pytest.raises(RuntimeError, match="mlp_kernel=quack: quack-kernels is installed but"):
        gated.choose("quack", CUDA, torch.bfloat16, TORCH.swiglu)


def test_auto_kernels_skip_a_broken_liger(site: Path, caplog: pytest.LogCaptureFixture) -> None:
    fake(site, "liger_kernel.transformers", "raise OSError('libtriton.so: cannot open shared object')")
    with caplog.at_level(logging.WARNING):
        assert apply_fused_kernels(models.build("qwen2"), "auto", CUDA) == "none"
    (warning,) = warnings_of(caplog)
    assert "liger-kernel" in warning
    assert "libtriton.so" in warning
    with pytest.raises(RuntimeError, match=r"kernels=liger: liger-kernel is installed but.*libtriton"):
        apply_fused_kernels(models.build("qwen2"), "liger", CUDA)


def test_a_broken_triton_turns_the_triton_kernels_off(site: Path, caplog: pytest.LogCaptureFixture) -> None:
    fake(site, "triton", "raise RuntimeError('0 active drivers ([]). There should only be one.')")
    with caplog.at_level(logging.WARNING):
        assert triton_jit.triton() is None
        assert not triton_jit.available(CUDA)
    (warning,) = warnings_of(caplog)
    assert "triton is installed but" in warning
    assert "0 active drivers" in warning


@pytest.mark.parity  # make test-gpu runs it again on cuda in each dtype
def test_the_service_starts_and_scores_with_broken_kernel_packages(site: Path) -> None:
    """Every optional package broken at once: the demo model still starts under `auto` and scores."""
    for module in ["flash_attn", "quack", "liger_kernel"]:
        fake(site, module, f"raise OSError('{module}: libcuda.so.1: cannot open shared object file')")
    fake(site, "flash_attn.flash_attn_interface")
    with running(settings_for(None, attention="auto", kernels="auto", mlp_kernel="auto")) as client:
        scored = client.post("/logprobs", json={"input_ids": [[1, 2, 3, 4]], "num_actions": 2})
        assert scored.status_code == 200
        assert len(scored.json()["logprobs"][0]) == 2


def test_a_fake_that_imports_leaves_with_the_test(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fake that imports cleanly stays importable in its block and is out of sys.modules after it
    (a later test in the process must not find it: tests/client/test_releases.py)."""
    with fake_site(tmp_path, monkeypatch, {"flash_attn"}) as site:
        fake(site, "flash_attn.cute", "MARK = 'fake'")
        assert optional.importable("flash_attn.cute", "flash-attn-4")
        assert sys.modules["flash_attn.cute"].MARK == "fake"
    assert [name for name in sys.modules if name.partition(".")[0] == "flash_attn"] == []

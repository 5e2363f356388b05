"""The MLP's gate|up projection and SwiGLU: split (GEMM, then the SwiGLU op) and quack's fused GEMM."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from service.core.jobs import SequenceJob
from service.engine.ops import gate_up as gated
from service.engine.ops.elementwise import TORCH, TRITON
from service.engine.scorer.engine import PackedScorer
from service.settings import Settings


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """silu(gate) · up in float64, from separate gate and up weights (transformers' LlamaMLP)."""
    w_gate, w_up = weight.double().chunk(2, dim=0)
    b_gate, b_up = bias.double().chunk(2) if bias is not None else (None, None)
    return F.silu(F.linear(x.double(), w_gate, b_gate)) * F.linear(x.double(), w_up, b_up)


def inputs(
    rows: int, hidden: int, inner: int, device: str, dtype: torch.dtype, *, with_bias: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(rows + inner)
    x = torch.randn(rows, hidden, generator=gen).to(device, dtype)
    weight = (torch.randn(2 * inner, hidden, generator=gen) * hidden**-0.5).to(device, dtype)
    bias = torch.randn(2 * inner, generator=gen).to(device, dtype) if with_bias else None
    return x, weight, bias


@pytest.mark.parametrize("with_bias", [False, True])
def test_split_is_the_gemm_then_swiglu(with_bias: bool) -> None:
    x, weight, bias = inputs(37, 64, 96, "cpu", torch.float32, with_bias=with_bias)
    projection = gated.choose("split", torch.device("cpu"), torch.float32, TORCH.swiglu)
    assert projection.name == "split"
    got = projection.project(x, weight, bias)
    assert got.shape == (37, 96)
    torch.testing.assert_close(got.double(), reference(x, weight, bias), atol=1e-5, rtol=1e-5)


def test_auto_is_split_off_hopper_and_quack_is_refused() -> None:
    cpu = torch.device("cpu")
    assert gated.choose("auto", cpu, torch.bfloat16, TORCH.swiglu).name == "split"
    assert not gated.quack_available(cpu)
    with pytest.raises(RuntimeError, match="quack-kernels package and a CUDA device"):
        gated.choose("quack", cpu, torch.bfloat16, TORCH.swiglu)


@pytest.mark.quack
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("rows", "with_bias"), [(4096, False), (777, False), (256, True)])
def test_quack_matches_the_split_twin(dtype: torch.dtype, rows: int, with_bias: bool) -> None:
    """The fused GEMM against float64, no further than the split path is (it rounds once fewer);
    Qwen2.5-1.5B's MLP widths, rows that fill no whole tile, a bias (which takes the split path)."""
    x, weight, bias = inputs(rows, 1536, 8960, "cuda", dtype, with_bias=with_bias)
    device = torch.device("cuda")
    fused = gated.choose("quack", device, dtype, TRITON.swiglu)
    assert gated.choose("auto", device, dtype, TRITON.swiglu).name == "quack"
    want = reference(x, weight, bias)
    got = fused.project(x, weight, bias)
    split = gated.choose("split", device, dtype, TRITON.swiglu).project(x, weight, bias)
    assert got.shape == split.shape == (rows, 8960)
    scale = want.abs().max().item()
    fused_err = (got.double() - want).abs().max().item() / scale
    split_err = (split.double() - want).abs().max().item() / scale
    assert fused_err <= max(split_err, 1e-3), (fused_err, split_err)


@pytest.mark.quack
def test_quack_falls_back_to_split_in_float32() -> None:
    x, weight, bias = inputs(64, 128, 256, "cuda", torch.float32, with_bias=False)
    projection = gated.choose("quack", torch.device("cuda"), torch.float32, TORCH.swiglu)
    got = projection.project(x, weight, bias).double()
    torch.testing.assert_close(got, reference(x, weight, bias), atol=1e-4, rtol=1e-4)


def _broken(message: str) -> gated.GatedProjection:
    def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise TypeError(message)

    return gated.GatedProjection("quack", project)


def _off_by_half(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return 1.5 * TORCH.swiglu(F.linear(x, weight, bias))


@pytest.mark.parametrize(
    ("fused", "reason"),
    [
        (_broken("epilogue fn depends on <Logger CUTE_DSL>"), "TypeError: epilogue fn depends on"),
        (gated.GatedProjection("quack", _off_by_half), "from the split path's"),
    ],
)
def test_auto_keeps_split_when_quack_fails_its_probe(
    fused: gated.GatedProjection,
    reason: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """quack releases that do not run with the installed nvidia-cutlass-dsl (or compute wrong
    numbers) leave auto on split, with a warning; an explicit mlp_kernel=quack takes it as asked."""
    monkeypatch.setattr(gated, "quack_available", lambda device: True)
    monkeypatch.setattr(gated, "_quack", lambda fallback: fused)
    cpu = torch.device("cpu")
    assert gated.choose("auto", cpu, torch.bfloat16, TORCH.swiglu).name == "split"
    assert reason in caplog.text
    assert gated.choose("quack", cpu, torch.bfloat16, TORCH.swiglu) is fused
    assert gated.choose("auto", cpu, torch.float32, TORCH.swiglu).name == "split"  # no probe needed


def test_auto_takes_quack_when_its_probe_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    twin = gated.GatedProjection("quack", lambda x, w, b: TORCH.swiglu(F.linear(x, w, b)))
    monkeypatch.setattr(gated, "quack_available", lambda device: True)
    monkeypatch.setattr(gated, "_quack", lambda fallback: twin)
    assert gated.choose("auto", torch.device("cpu"), torch.bfloat16, TORCH.swiglu) is twin


def test_the_engine_runs_the_projection_its_settings_pick(
    model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """mlp_kernel reaches the fused decoder's MLPs (and /info's kernels); kernels=none keeps auto on
    split; quack with a model the fused decoder does not run is refused, not ignored."""
    calls: list[int] = []

    def counted(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        calls.append(x.shape[0])
        return TORCH.swiglu(F.linear(x, weight, bias))

    monkeypatch.setattr(gated, "quack_available", lambda device: True)
    monkeypatch.setattr(gated, "_quack", lambda fallback: gated.GatedProjection("quack", counted))
    qwen2 = model_dirs["qwen2"]
    engine = PackedScorer.from_config(Settings(model=qwen2, device="cpu", mlp_kernel="quack").engine_config())
    assert engine.info.kernels == "none+quack"
    calls.clear()
    engine.score(
        [
            SequenceJob(
                tokens=np.arange(1, 12), actions=np.arange(6, 11), temperature=1.0, return_entropy=False
            )
        ]
    )
    assert calls  # every layer's MLP went through it
    off = PackedScorer.from_config(
        Settings(model=qwen2, device="cpu", dtype="bfloat16", kernels="none").engine_config()
    )
    assert off.info.kernels == "none"
    with pytest.raises(RuntimeError, match="mlp_kernel=quack runs in the fused decoder"):
        PackedScorer.from_config(
            Settings(model=qwen2, device="cpu", decoder="transformers", mlp_kernel="quack").engine_config()
        )


def test_the_projection_is_chosen_only_for_a_model_that_runs_one(
    model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Choosing quack probes it (a compile on a cold cache): a model whose every layer is sparse
    without a shared expert (Mixtral) does not choose one; a dense layer (Qwen3-MoE's mlp_only_layers)
    or a shared expert (Qwen2-MoE) does."""
    chosen: list[str] = []

    def choose(setting: str, *_: object) -> gated.GatedProjection:
        chosen.append(setting)
        return gated.GatedProjection("quack", lambda x, w, b: TORCH.swiglu(F.linear(x, w, b)))

    monkeypatch.setattr(gated, "choose", choose)
    kernels = {}
    for name in ("mixtral", "qwen3_moe", "qwen2_moe"):
        settings = Settings(model=model_dirs[name], device="cpu", mlp_kernel="quack")
        kernels[name] = PackedScorer.from_config(settings.engine_config()).info.kernels
    assert kernels == {"mixtral": "none", "qwen3_moe": "none+quack", "qwen2_moe": "none+quack"}
    assert chosen == ["quack", "quack"]

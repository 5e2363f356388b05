"""The fused decoder's ops: torch twins against transformers' own modules, Triton kernels against both.

The torch twins must compute exactly what transformers' modules compute (same dtype, same rounding
steps), so they are compared bit for bit with LlamaRMSNorm, Qwen3's head norm + apply_rotary_pos_emb,
and LlamaMLP's activation. The Triton kernels run on CPU under Triton's interpreter in a fresh
process (see tests/engine/heads/test_fused_kernel.py for why), in float32 against the same references; on a
GPU they are compared with the twins in bf16 and fp16.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from service.engine.ops import elementwise as decoder_ops
from service.engine.ops.elementwise import HeadNorms, Ops
from tests.engine.interpreter import INTERPRETED, only_interpreted, run_interpreter_cases


def test_kernel_cases_in_a_fresh_process() -> None:
    run_interpreter_cases(__file__)


# ---- independent references: transformers' modules ----------------------------------------------


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(x.shape[-1], eps=eps).to(device=x.device, dtype=weight.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
    out: torch.Tensor = norm(x)
    return out


def hf_rope(  # noqa: PLR0917
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, hq: int, hk: int, d: int, norms: HeadNorms | None
) -> torch.Tensor:
    """transformers' path: [1, heads, N, D] q and k, Qwen3 head norms, apply_rotary_pos_emb."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    n = qkv.shape[0]
    q = qkv[:, : hq * d].reshape(1, n, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].reshape(1, n, hk, d)
    if norms is not None:
        q, k = hf_rms_norm(q, norms.q, norms.eps), hf_rms_norm(k, norms.k, norms.eps)
    q_rot, k_rot = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos[None], sin[None])
    flat = [q_rot.transpose(1, 2).reshape(n, -1), k_rot.transpose(1, 2).reshape(n, -1)]
    return torch.cat([*flat, qkv[:, (hq + hk) * d :]], dim=1)


def rope_inputs(  # noqa: PLR0917
    n: int, hq: int, hk: int, d: int, dtype: torch.dtype, device: str = "cpu", pad: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A qkv buffer (rows `pad` elements wider than the heads: a strided view) and Llama cos/sin."""
    gen = torch.Generator().manual_seed(n * 31 + d)
    buffer = torch.randn(n, (hq + 2 * hk) * d + pad, generator=gen).to(device=device, dtype=dtype)
    qkv = buffer[:, : (hq + 2 * hk) * d]
    positions = torch.randint(0, 4000, (n,), generator=gen).float()
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
    angles = positions[:, None] * inv[None]
    emb = torch.cat([angles, angles], dim=-1)
    return qkv, emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype)


def head_norms(d: int, dtype: torch.dtype, device: str = "cpu") -> HeadNorms:
    gen = torch.Generator().manual_seed(d)
    q, k = torch.rand(d, generator=gen) + 0.5, torch.rand(d, generator=gen) + 0.5
    return HeadNorms(q.to(device=device, dtype=dtype), k.to(device=device, dtype=dtype), 1e-6)


# ---- torch twins == transformers, bit for bit ----------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_torch_rms_norm_is_transformers_rms_norm(dtype: torch.dtype) -> None:
    x = (torch.randn(9, 48) * 4).to(dtype)
    w = (torch.rand(48) + 0.5).to(dtype)
    assert torch.equal(decoder_ops.rms_norm_torch(x, w, 1e-6), hf_rms_norm(x, w, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [False, True])
def test_torch_rope_is_transformers_rope_in_place(dtype: torch.dtype, norm: bool) -> None:
    hq, hk, d = 4, 2, 16
    qkv, cos, sin = rope_inputs(11, hq, hk, d, dtype, pad=8)
    norms = head_norms(d, dtype) if norm else None
    want = hf_rope(qkv.clone(), cos, sin, hq, hk, d, norms)
    before = qkv.clone()
    decoder_ops.rope_torch_(qkv, cos, sin, hq, hk, d, norms)
    assert torch.equal(qkv, want)
    assert not torch.equal(qkv[:, : hq * d], before[:, : hq * d])  # it did rotate, in place


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_swiglu_is_llama_mlp_activation(dtype: torch.dtype) -> None:
    gate_up = (torch.randn(7, 2 * 24) * 3).to(dtype)
    gate, up = gate_up[:, :24], gate_up[:, 24:]
    assert torch.equal(decoder_ops.swiglu_torch(gate_up), F.silu(gate) * up)


def test_ops_pick_torch_on_cpu() -> None:
    assert Ops.for_device(torch.device("cpu")).name == "torch"


def test_kernels_refuse_cpu_tensors_outside_the_interpreter() -> None:
    if INTERPRETED:
        pytest.skip("the interpreter runs them on CPU")
    pytest.importorskip("triton")
    with pytest.raises(ValueError, match="CUDA"):
        decoder_ops.rms_norm_kernel(torch.ones(2, 4), torch.ones(4), 1e-6)


# ---- Triton kernels (interpreter, float32) ------------------------------------------------------


@only_interpreted
@pytest.mark.parametrize("hidden", [48, 64, 896])
def test_interpreter_rms_norm(hidden: int) -> None:
    x = torch.randn(6, hidden) * 3
    w = torch.rand(hidden) + 0.5
    torch.testing.assert_close(decoder_ops.rms_norm_kernel(x, w, 1e-6), hf_rms_norm(x, w, 1e-6))
    strided = torch.randn(6, hidden + 16)[:, :hidden]  # rows of a wider buffer
    torch.testing.assert_close(decoder_ops.rms_norm_kernel(strided, w, 1e-5), hf_rms_norm(strided, w, 1e-5))


@only_interpreted
@pytest.mark.parametrize(("hq", "hk", "d"), [(4, 2, 16), (3, 1, 64), (7, 1, 20)])
@pytest.mark.parametrize("norm", [False, True])
def test_interpreter_rope(hq: int, hk: int, d: int, norm: bool) -> None:
    qkv, cos, sin = rope_inputs(9, hq, hk, d, torch.float32, pad=8)
    norms = head_norms(d, torch.float32) if norm else None
    want = hf_rope(qkv.clone(), cos, sin, hq, hk, d, norms)
    decoder_ops.rope_kernel_(qkv, cos, sin, hq, hk, d, norms)
    torch.testing.assert_close(qkv, want, atol=2e-6, rtol=2e-6)


@only_interpreted
@pytest.mark.parametrize("inner", [24, 1000, 2500])
def test_interpreter_swiglu(inner: int) -> None:
    gate_up = torch.randn(5, 2 * inner) * 4
    gate_up[0, 0], gate_up[0, inner] = -100.0, 3.0  # silu(-100) underflows to -0
    torch.testing.assert_close(
        decoder_ops.swiglu_kernel(gate_up),
        F.silu(gate_up[:, :inner]) * gate_up[:, inner:],
        atol=2e-6,
        rtol=2e-6,
    )


# ---- Triton kernels on a GPU, bf16/fp16: equal to the twins within one rounding --------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernels_equal_the_twins_on_cuda(dtype: torch.dtype) -> None:
    ulp = {torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]
    x = (torch.randn(4096, 1536, device="cuda") * 3).to(dtype)  # Qwen2.5-1.5B's width
    w = (torch.rand(1536, device="cuda") + 0.5).to(dtype)
    got, want = (
        decoder_ops.rms_norm_kernel(x, w, 1e-6).float(),
        decoder_ops.rms_norm_torch(x, w, 1e-6).float(),
    )
    assert float(((got - want).abs() / want.abs().clamp_min(1e-3)).max()) <= 2 * ulp
    for norm in (False, True):
        qkv, cos, sin = rope_inputs(4096, 12, 2, 128, dtype, device="cuda")
        norms = head_norms(128, dtype, device="cuda") if norm else None
        want_rope = qkv.clone()
        decoder_ops.rope_torch_(want_rope, cos, sin, 12, 2, 128, norms)
        decoder_ops.rope_kernel_(qkv, cos, sin, 12, 2, 128, norms)
        assert float((qkv.float() - want_rope.float()).abs().max()) <= 4 * ulp * float(want_rope.abs().max())
    gate_up = (torch.randn(4096, 2 * 8960, device="cuda") * 3).to(dtype)
    got, want = decoder_ops.swiglu_kernel(gate_up).float(), decoder_ops.swiglu_torch(gate_up).float()
    assert float(((got - want).abs() / want.abs().clamp_min(1e-2)).max()) <= 2 * ulp

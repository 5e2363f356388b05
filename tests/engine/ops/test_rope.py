"""The per-instance fused RoPE: the fused path equals the original, and nothing else changes.

CPU twin: the dispatch runs with an independent CPU stand-in for the fused kernel (RoPE as a
complex rotation in float64). On CUDA with liger-kernel, liger's kernel itself is compared with
transformers' function, and a whole model with apply_fused_kernels with an untouched twin; the
GPU parity suites (`make test-gpu`) also score every architecture through it.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from service.engine.ops.liger import apply_fused_kernels
from service.engine.ops.rope import NAME, _Dispatcher, fuse_rope, fused_active, unfuse_rope
from tests.support import models

TOKENS = torch.arange(3, 40)[None]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as (x1 + i·x2)·(cos + i·sin) per frequency; x: [B, H, L, D], cos/sin: [B|1, L, D]."""
    half = x.shape[-1] // 2
    z = torch.complex(x[..., :half].double(), x[..., half:].double())
    turn = torch.complex(cos[..., :half].double(), sin[..., :half].double())[:, None]  # [B|1, 1, L, D/2]
    y = z * turn
    return torch.cat([y.real, y.imag], dim=-1).to(x.dtype)


class StandIn:
    """A CPU fused RoPE that records the threads it ran in."""

    def __init__(self, inside: Callable[[], None] | None = None) -> None:
        self.calls: list[str] = []
        self.inside = inside

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls.append(threading.current_thread().name)
        if self.inside is not None:
            inside, self.inside = self.inside, None
            inside()
        return rotate(q, cos, sin), rotate(k, cos, sin)


def logits(model: Any) -> torch.Tensor:
    with torch.inference_mode():
        out: torch.Tensor = model(input_ids=TOKENS, use_cache=False).logits[0]
    return out


def modeling(model: Any) -> Any:
    return sys.modules[type(model).__module__]


@pytest.mark.parametrize("name", models.ARCHITECTURES)
def test_fused_path_equals_the_original_and_other_models_are_untouched(name: str) -> None:
    fused, other = models.build(name), models.build(name)
    want = logits(models.build(name))
    stand_in = StandIn()
    layers = fuse_rope(fused, stand_in, device_type="cpu")
    assert layers == fused.config.num_hidden_layers
    assert isinstance(getattr(modeling(fused), NAME), _Dispatcher)

    got = logits(fused)
    full_head = getattr(fused.config, "partial_rotary_factor", 1.0) in (None, 1.0)
    assert len(stand_in.calls) == (layers if full_head else 0)  # partial rotary: the original path
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)

    calls = len(stand_in.calls)
    assert torch.equal(logits(other), want)  # same architecture, not fused: the original function
    assert len(stand_in.calls) == calls
    assert not fused_active()


def test_other_threads_keep_the_original_while_a_fused_forward_runs() -> None:
    fused, other = models.build("qwen2"), models.build("qwen2")
    want = logits(models.build("qwen2"))
    seen: list[torch.Tensor] = []
    # inside the fused model's first RoPE call, another thread runs the other model to the end
    thread = threading.Thread(target=lambda: seen.append(logits(other)), name="other")

    def run_other() -> None:
        thread.start()
        thread.join()

    stand_in = StandIn(inside=run_other)
    fuse_rope(fused, stand_in, device_type="cpu")
    torch.testing.assert_close(logits(fused), want, atol=2e-5, rtol=0)
    assert torch.equal(seen[0], want)
    assert "other" not in stand_in.calls
    assert len(stand_in.calls) == fused.config.num_hidden_layers


def test_flag_is_cleared_when_a_forward_fails() -> None:
    model = models.build("llama")

    def fail(*_: Any) -> Any:
        raise RuntimeError("boom")

    fuse_rope(model, fail, device_type="cpu")
    with pytest.raises(RuntimeError, match="boom"):
        logits(model)
    assert not fused_active()


def test_fusing_twice_wraps_once_and_unfuse_restores() -> None:
    model = models.build("qwen2")
    stand_in = StandIn()
    assert fuse_rope(model, stand_in, device_type="cpu") == model.config.num_hidden_layers
    assert fuse_rope(model, stand_in, device_type="cpu") == 0
    dispatcher = getattr(modeling(model), NAME)
    fuse_rope(models.build("qwen2"), stand_in, device_type="cpu")
    assert getattr(modeling(model), NAME) is dispatcher  # one dispatcher per modeling module
    assert unfuse_rope(model) == model.config.num_hidden_layers
    logits(model)
    assert stand_in.calls == []


def test_other_device_types_and_layouts_take_the_original_path() -> None:
    model = models.build("qwen2")
    stand_in = StandIn()
    fuse_rope(model, stand_in, device_type="cuda")  # these tensors are on the CPU
    logits(model)
    assert stand_in.calls == []

    dispatcher = _Dispatcher(lambda q, k, cos, sin, unsqueeze_dim=1: ("original", unsqueeze_dim))
    q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8)
    cos, sin = torch.randn(1, 5, 8), torch.randn(1, 5, 8)
    fuse_rope(torch.nn.Module(), stand_in, device_type="cpu")  # no attention module: nothing wrapped
    from service.engine.ops import rope

    active = rope._Fused(lambda: None, stand_in, "cpu")
    token = rope._ACTIVE.set(active)
    try:
        assert dispatcher(q, k, cos, sin, 2) == ("original", 2)  # another layout
        assert dispatcher(q, k, cos[..., :4], sin[..., :4]) == ("original", 1)  # partial rotary
        assert dispatcher(q, k, cos.double(), sin.double()) == ("original", 1)  # mixed dtypes
        assert stand_in.calls == []
        q_rot, _ = dispatcher(q, k, cos, sin, unsqueeze_dim=1)
        assert len(stand_in.calls) == 1
        torch.testing.assert_close(q_rot, rotate(q, cos, sin))
    finally:
        rope._ACTIVE.reset(token)


def test_stand_in_equals_transformers_rope() -> None:
    """The independent rotation used above is RoPE as transformers computes it."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 7, 16, generator=gen), torch.randn(2, 2, 7, 16, generator=gen)
    angles = torch.randn(2, 7, 8, generator=gen)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    want_q, want_k = getattr(apply_rotary_pos_emb, "original", apply_rotary_pos_emb)(q, k, cos, sin)
    torch.testing.assert_close(rotate(q, cos, sin), want_q, atol=1e-6, rtol=0)
    torch.testing.assert_close(rotate(k, cos, sin), want_k, atol=1e-6, rtol=0)


@pytest.mark.liger
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_liger_kernel_equals_transformers_rope_on_cuda(dtype: torch.dtype) -> None:
    from service.engine.ops.liger import _liger_rope

    gen = torch.Generator(device="cuda").manual_seed(1)
    shape_q, shape_k = (1, 12, 3000, 128), (1, 2, 3000, 128)
    # q, k as the attention makes them: [B, L, heads, D] storage seen as [B, heads, L, D]
    q = torch.randn(shape_q, generator=gen, device="cuda").transpose(1, 2).contiguous().transpose(1, 2)
    k = torch.randn(shape_k, generator=gen, device="cuda").transpose(1, 2).contiguous().transpose(1, 2)
    angles = torch.rand(1, 3000, 64, generator=gen, device="cuda") * 3000
    cos = torch.cat([angles.cos()] * 2, -1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, -1).to(dtype)
    q, k = q.to(dtype), k.to(dtype)
    want_q, want_k = rotate(q, cos, sin), rotate(k, cos, sin)  # before the kernel rotates in place
    largest = float(torch.maximum(q.abs().max(), k.abs().max()))
    got_q, got_k = _liger_rope()(q, k, cos, sin)
    # float32: rounding only; bf16: the kernel rounds its products to bf16 (it computes in cos's
    # dtype, as transformers does), one or two roundings of the largest input (|q| up to ~5.5)
    atol, rtol = (1e-5, 0.0) if dtype == torch.float32 else (2 * 2**-8 * largest, 2**-6)
    torch.testing.assert_close(got_q.double(), want_q.double(), atol=atol, rtol=rtol)
    torch.testing.assert_close(got_k.double(), want_k.double(), atol=atol, rtol=rtol)


@pytest.mark.liger
def test_fused_model_on_cuda_equals_an_untouched_twin() -> None:
    fused, twin = models.build("qwen2").cuda(), models.build("qwen2").cuda()
    assert apply_fused_kernels(fused, "liger", torch.device("cuda")) == "liger"
    calls = StandIn()
    original = getattr(modeling(twin), NAME).original
    getattr(modeling(twin), NAME).original = lambda *a, **kw: (calls(*a[:4]), original(*a, **kw))[1]
    try:
        with torch.inference_mode():
            got = fused(input_ids=TOKENS.cuda(), use_cache=False).logits[0]
            want = twin(input_ids=TOKENS.cuda(), use_cache=False).logits[0]
    finally:
        getattr(modeling(twin), NAME).original = original
    assert len(calls.calls) == twin.config.num_hidden_layers  # the twin ran the original function only
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)

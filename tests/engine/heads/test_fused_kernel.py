"""The one-pass Triton head (fused_head.py) against float64 references and against the torch head.

On CPU the kernel runs in Triton's interpreter (tests/engine/interpreter.py says how); the GPU
tests compare the compiled kernel with the torch path on CUDA.
"""

from __future__ import annotations

import sys
from functools import partial
from typing import Any

import pytest
import torch

from service.engine.heads import fused_kernel as fused_head
from service.engine.heads.base import LogitTransform
from service.engine.heads.chunked import score_actions
from service.engine.runtime import packages as optional
from service.engine.runtime import triton_jit
from tests.engine.interpreter import only_interpreted, run_interpreter_cases


def test_kernel_cases_in_a_fresh_process() -> None:
    run_interpreter_cases(__file__)


def extreme_logits(rows: int, vocab: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random logits with a far-positive row, a far-negative row and a one-spike row; their targets."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, vocab, generator=gen) * 3
    z[1] += 1e4
    z[2] -= 1e4
    z[3, vocab // 2] = 80.0  # softmax ~ one-hot: entropy ~ 0
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    targets[:4] = torch.tensor([vocab - 1, 0, vocab - 2, vocab // 2])  # the last (padded) block, the first
    return z.to(dtype), targets


def reference(
    z: torch.Tensor, targets: torch.Tensor, s: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """log_softmax and entropy in float64 of the float32 values the contract names: float(z)·s."""
    x = (z.float() * s[:, None] if s is not None else z.float()).double()
    logp = torch.log_softmax(x, dim=-1)
    return logp.gather(1, targets[:, None])[:, 0], -(logp.exp() * logp).sum(-1)


@only_interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1000, 4099])
@pytest.mark.parametrize("temperature", [False, True])
@pytest.mark.parametrize("want_entropy", [False, True])
def test_interpreter_kernel_equals_float64_reference(
    dtype: torch.dtype, vocab: int, temperature: bool, want_entropy: bool
) -> None:
    """Blocks of 512: 1000 and 4099 end in a partial block, padded with -inf."""
    z, targets = extreme_logits(6, vocab, dtype, seed=vocab)
    s = 1.0 / torch.tensor([0.7, 0.5, 2.0, 1.0, 0.1, 1.3]) if temperature else None
    logprobs, entropy = fused_head.fused_logprobs(z, targets, s, want_entropy, block=512)
    want_logprobs, want_entropy_values = reference(z, targets, s)
    assert logprobs.dtype == torch.float32
    torch.testing.assert_close(logprobs.double(), want_logprobs, atol=1e-5, rtol=1e-6)
    if want_entropy:
        assert entropy is not None
        assert entropy.dtype == torch.float32
        torch.testing.assert_close(entropy.double(), want_entropy_values, atol=1e-5, rtol=1e-6)
    else:
        assert entropy is None


@only_interpreted
def test_interpreter_kernel_on_a_vocabulary_smaller_than_a_block() -> None:
    z, targets = extreme_logits(4, 7, torch.float32, seed=0)
    logprobs, entropy = fused_head.fused_logprobs(z, targets, None, True)
    want_logprobs, want_entropy = reference(z, targets, None)
    torch.testing.assert_close(logprobs.double(), want_logprobs, atol=1e-5, rtol=1e-6)
    assert entropy is not None
    torch.testing.assert_close(entropy.double(), want_entropy, atol=1e-5, rtol=1e-6)


def head_inputs(rows: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, 16, generator=gen)
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    inv_t = 1.0 / (0.5 + torch.rand(rows, generator=gen))
    return hidden, targets, inv_t


@only_interpreted
@pytest.mark.parametrize("transform", [LogitTransform(), LogitTransform(scale=0.25)])
def test_interpreter_score_actions_equals_the_torch_path(transform: LogitTransform) -> None:
    """The kernel through score_actions: chunks, 1 / T, and a logit scale folded into the multiplier."""
    hidden, targets, inv_t = head_inputs(9, 300, seed=1)
    head = torch.nn.Linear(16, 300, bias=False)
    torch.nn.init.normal_(head.weight, std=0.5, generator=torch.Generator().manual_seed(2))
    for temperature in (inv_t, None):
        run = partial(
            score_actions, hidden=hidden, targets=targets, inv_temperature=temperature, lm_head=head
        )
        with torch.no_grad():
            fused = run(transform=transform, chunk_rows=4, want_entropy=True, fused=True)
            plain = run(transform=transform, chunk_rows=4, want_entropy=True, fused=False)
        torch.testing.assert_close(fused.logprobs, plain.logprobs, atol=1e-5, rtol=1e-6)
        assert fused.entropy is not None
        assert plain.entropy is not None
        torch.testing.assert_close(fused.entropy, plain.entropy, atol=1e-5, rtol=1e-6)


def test_cpu_takes_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """fused=None on CPU never calls the kernel, and gives exactly what fused=False gives."""

    def no_kernel(*args: object, **kwargs: object) -> None:
        raise AssertionError("the fused kernel ran on CPU")

    monkeypatch.setattr(fused_head, "fused_logprobs", no_kernel)
    assert not triton_jit.available(torch.device("cpu"))
    hidden, targets, inv_t = head_inputs(11, 50, seed=3)
    head = torch.nn.Linear(16, 50, bias=False)
    run = partial(score_actions, hidden=hidden, targets=targets, inv_temperature=inv_t, lm_head=head)
    with torch.no_grad():
        auto = run(transform=LogitTransform(), chunk_rows=3, want_entropy=True)
        plain = run(transform=LogitTransform(), chunk_rows=3, want_entropy=True, fused=False)
    assert torch.equal(auto.logprobs, plain.logprobs)
    assert auto.entropy is not None
    assert plain.entropy is not None
    assert torch.equal(auto.entropy, plain.entropy)


def test_soft_capping_cannot_be_forced_onto_the_kernel() -> None:
    hidden, targets, _ = head_inputs(2, 50, seed=4)
    with pytest.raises(ValueError, match="cannot apply"):
        score_actions(
            hidden=hidden,
            targets=targets,
            inv_temperature=None,
            lm_head=torch.nn.Linear(16, 50),
            transform=LogitTransform(softcap=30.0),
            chunk_rows=2,
            want_entropy=False,
            fused=True,
        )


def test_without_triton_the_kernel_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton raises ImportError
    optional.forget()
    try:
        assert not triton_jit.available(torch.device("cuda"))
    finally:
        optional.forget()


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("temperature", "want_entropy", "transform"),
    [
        (False, False, LogitTransform()),
        (True, True, LogitTransform()),
        (True, True, LogitTransform(scale=0.5)),
    ],
)
def test_kernel_equals_the_torch_path_on_cuda(
    monkeypatch: pytest.MonkeyPatch, temperature: bool, want_entropy: bool, transform: LogitTransform
) -> None:
    """Qwen2.5 shapes: bf16 logits [512, 151936] (lm_head is the identity here), in one or two chunks.

    fused=None: score_actions must pick the compiled kernel by itself on CUDA.
    """
    assert triton_jit.available(torch.device("cuda")), "CUDA without triton: the fused head is off"
    launches: list[int] = []
    kernel = fused_head.fused_logprobs

    def counted(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        launches.append(1)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(fused_head, "fused_logprobs", counted)
    gen = torch.Generator(device="cuda").manual_seed(5)
    rows, vocab = 512, 151936
    z = (torch.randn(rows, vocab, device="cuda", generator=gen) * 4).to(torch.bfloat16)
    targets = torch.randint(0, vocab, (rows,), device="cuda", generator=gen)
    inv_t = 1.0 / (0.5 + torch.rand(rows, device="cuda", generator=gen)) if temperature else None
    run = partial(
        score_actions,
        hidden=z,
        targets=targets,
        inv_temperature=inv_t,
        lm_head=torch.nn.Identity(),
        transform=transform,
        chunk_rows=256 if temperature else 512,
        want_entropy=want_entropy,
    )
    fused, plain = run(), run(fused=False)
    assert len(launches) == rows // run.keywords["chunk_rows"]
    torch.testing.assert_close(fused.logprobs, plain.logprobs, atol=1e-4, rtol=0)
    if want_entropy:
        assert fused.entropy is not None
        assert plain.entropy is not None
        torch.testing.assert_close(fused.entropy, plain.entropy, atol=1e-4, rtol=0)

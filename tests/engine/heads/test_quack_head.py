"""The fused lm_head log-prob (heads/quack_head.py): which calls it serves, its split of the rows, its
choice at start and its place in the engine, on the CPU with its torch twin; on a Hopper GPU, quack's
kernels against float32."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from service.core.jobs import SequenceJob
from service.engine.heads import quack_head
from service.engine.heads.base import LogitTransform
from service.engine.heads.quack_head import QuackHead, reference_kernel
from service.engine.scorer.engine import PackedScorer
from service.settings import Settings

Calls = list[tuple[int, torch.dtype, bool]]


def counting(calls: Calls) -> quack_head.Kernel:
    """The twin, recording each call's rows, target dtype and whether it had a scale."""

    def kernel(
        h: torch.Tensor, w_t: torch.Tensor, t: torch.Tensor, s: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append((h.shape[0], t.dtype, s is not None))
        return reference_kernel(h, w_t, t, s)

    return kernel


def float32_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor | None
) -> torch.Tensor:
    z = hidden.double() @ weight.double().t()
    if scale is not None:
        z = z * scale.double()[:, None]
    return torch.log_softmax(z, dim=-1).gather(1, targets[:, None]).squeeze(1)


@pytest.mark.parametrize("scaled", [False, True])
def test_rows_past_one_call_are_split_and_each_gets_its_log_prob(
    scaled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(quack_head, "ROWS_PER_CALL", 5)
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(70, 16, generator=gen) / 2
    hidden = torch.randn(13, 32, generator=gen)[:, ::2]  # a strided view: copied before the kernel
    targets = torch.randint(0, 70, (13,), generator=gen)
    scale = torch.rand(13, generator=gen) + 0.5 if scaled else None
    calls: Calls = []
    got = QuackHead(counting(calls), scaled=True).logprobs(hidden, weight, targets, scale)
    assert got.dtype == torch.float32
    assert calls == [(5, torch.int32, scaled), (5, torch.int32, scaled), (3, torch.int32, scaled)]
    torch.testing.assert_close(
        got.double(), float32_logprobs(hidden, weight, targets, scale), atol=1e-5, rtol=0
    )
    assert QuackHead(counting(calls), scaled=True).logprobs(hidden[:0], weight, targets[:0], None).shape == (
        0,
    )


def test_it_serves_calls_that_ask_for_log_probs_alone() -> None:
    head, unscaled = QuackHead(reference_kernel, scaled=True), QuackHead(reference_kernel, scaled=False)
    plain = LogitTransform()
    assert head.serves(plain, want_entropy=False, extras=False, scaled=True)
    assert unscaled.serves(LogitTransform(scale=1.0), want_entropy=False, extras=False, scaled=False)
    assert not unscaled.serves(plain, want_entropy=False, extras=False, scaled=True)  # a temperature
    assert not head.serves(plain, want_entropy=True, extras=False, scaled=False)
    assert not head.serves(plain, want_entropy=False, extras=True, scaled=False)
    assert not head.serves(LogitTransform(softcap=30.0), want_entropy=False, extras=False, scaled=False)


def _off_by_half(
    h: torch.Tensor, w_t: torch.Tensor, t: torch.Tensor, s: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    lse, target = reference_kernel(h, w_t, t, s)
    return lse + 0.5, target


def _broken(
    h: torch.Tensor, w_t: torch.Tensor, t: torch.Tensor, s: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    raise TypeError("epilogue fn depends on <Logger CUTE_DSL>")


def test_auto_takes_the_fused_head_where_it_can_run_and_its_probe_passes(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cpu = torch.device("cpu")
    lm_head = torch.nn.Linear(32, 300, bias=False).to(torch.bfloat16)
    assert quack_head.choose("chunked", lm_head, cpu, batch_invariant=False) is None
    assert quack_head.choose("auto", lm_head, cpu, batch_invariant=False) is None  # no Hopper GPU: quietly
    assert not caplog.text
    with pytest.raises(RuntimeError, match=r"head_kernel=quack cannot run: .*compute capability 9\.0"):
        quack_head.choose("quack", lm_head, cpu, batch_invariant=False)

    monkeypatch.setattr(quack_head, "_device_can_run", lambda device: True)
    monkeypatch.setattr(quack_head, "importable", lambda: True)
    monkeypatch.setattr(quack_head, "_kernels", lambda: (reference_kernel, reference_kernel))
    chosen = quack_head.choose("auto", lm_head, cpu, batch_invariant=False)
    assert chosen is not None
    assert chosen.scaled
    assert quack_head.choose("auto", lm_head, cpu, batch_invariant=True) is None
    for unfit, why in (
        (torch.nn.Linear(32, 300, bias=True).to(torch.bfloat16), "has a bias"),
        (torch.nn.Linear(32, 300, bias=False), "torch.float32"),
        (torch.nn.Embedding(300, 32), "not a plain Linear"),
    ):
        assert quack_head.eligible(unfit, cpu) is not None
        assert why in str(quack_head.eligible(unfit, cpu))
        assert quack_head.choose("auto", unfit, cpu, batch_invariant=False) is None

    monkeypatch.setattr(quack_head, "_kernels", lambda: (reference_kernel, _broken))
    no_scale = quack_head.choose("auto", lm_head, cpu, batch_invariant=False)
    assert no_scale is not None
    assert not no_scale.scaled
    assert "takes no row scale here (TypeError" in caplog.text

    caplog.clear()
    monkeypatch.setattr(quack_head, "_kernels", lambda: (_off_by_half, _off_by_half))
    assert quack_head.choose("auto", lm_head, cpu, batch_invariant=False) is None
    assert "cannot run here (RuntimeError: its log-probs are 0.5 from float32's)" in caplog.text
    with pytest.raises(RuntimeError, match="from float32's"):
        quack_head.choose("quack", lm_head, cpu, batch_invariant=False)


def _job(entropy: bool, temperature: float = 1.0) -> SequenceJob:
    return SequenceJob(
        tokens=np.arange(3, 40) % 50,
        actions=np.arange(20, 37),
        temperature=temperature,
        return_entropy=entropy,
    )


def test_the_engine_scores_log_prob_only_calls_with_the_fused_head(
    model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """head_kernel reaches the policy's head and /info: a call of log-probs alone (any temperature)
    runs it, with the chunked head's scores; one that asks for entropy runs chunked; kernels=none
    keeps auto on chunked."""
    calls: Calls = []
    monkeypatch.setattr(quack_head, "_device_can_run", lambda device: True)
    monkeypatch.setattr(quack_head, "importable", lambda: True)
    monkeypatch.setattr(quack_head, "_kernels", lambda: (counting(calls), counting(calls)))
    qwen2 = model_dirs["qwen2"]
    fused = PackedScorer.from_config(Settings(model=qwen2, device="cpu", dtype="bfloat16").engine_config())
    chunked = PackedScorer.from_config(
        Settings(model=qwen2, device="cpu", dtype="bfloat16", head_kernel="chunked").engine_config()
    )
    assert (fused.info.head_kernel, chunked.info.head_kernel) == ("quack", "chunked")
    for temperature in (1.0, 0.7):
        calls.clear()
        got = fused.score([_job(False, temperature)])[0]
        [(rows, index, scaled)] = calls  # one call: the 17 actions, padded to the shape step
        assert (rows >= 17, index, scaled) == (True, torch.int32, temperature != 1.0)
        assert got.logprobs.shape == (17,)
        want = chunked.score([_job(False, temperature)])[0]
        np.testing.assert_allclose(got.logprobs, want.logprobs, atol=0.05)  # bf16 logits against float32's
    calls.clear()
    asked = fused.score([_job(True)])[0]
    assert not calls
    assert asked.entropy is not None
    off = PackedScorer.from_config(
        Settings(model=qwen2, device="cpu", dtype="bfloat16", kernels="none").engine_config()
    )
    assert off.info.head_kernel == "chunked"


@pytest.mark.hopper
@pytest.mark.quack
@pytest.mark.parametrize("scaled", [False, True])
def test_quacks_fused_head_gives_float32s_log_probs(scaled: bool) -> None:
    """Qwen2.5-1.5B's head shape, rows over one call, a strided hidden state; within 1e-3 of float32
    (the chunked head's bf16 logits are ~1e-2 off)."""
    device = torch.device("cuda")
    lm_head = torch.nn.Linear(1536, 151936, bias=False, device=device, dtype=torch.bfloat16)
    torch.nn.init.normal_(lm_head.weight, std=0.02)
    head = quack_head.choose("quack", lm_head, device, batch_invariant=False)
    assert head is not None
    assert head.scaled
    gen = torch.Generator(device=device).manual_seed(0)
    rows = quack_head.ROWS_PER_CALL + 300
    hidden = torch.randn(rows, 1536 * 2, device=device, dtype=torch.bfloat16, generator=gen)[:, ::2]
    targets = torch.randint(0, 151936, (rows,), device=device, generator=gen)
    scale = torch.rand(rows, device=device, generator=gen) + 0.5 if scaled else None
    got = head.logprobs(hidden, lm_head.weight, targets, scale)
    for start in (0, quack_head.ROWS_PER_CALL - 100):
        part = slice(start, start + 400)
        want = float32_logprobs(
            hidden[part], lm_head.weight, targets[part], None if scale is None else scale[part]
        )
        torch.testing.assert_close(got[part].double(), want, atol=1e-3, rtol=0)

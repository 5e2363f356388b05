"""The chunked lm_head + log-softmax + entropy, the final-logit transform and its self-check."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from service.core.jobs import SequenceJob
from service.engine.decoder import TransformersDecoder
from service.engine.heads.base import LogitTransform
from service.engine.heads.chunked import score_actions
from service.engine.scorer.models import CausalLM
from service.engine.scorer.self_check import logits_check
from tests.support import models


@pytest.mark.parametrize("chunk_rows", [1, 3, 7, 100])
@pytest.mark.parametrize("transform", [LogitTransform(), LogitTransform(scale=0.5, softcap=1.5)])
def test_chunked_head_equals_full_log_softmax(chunk_rows: int, transform: LogitTransform) -> None:
    gen = torch.Generator().manual_seed(chunk_rows)
    head = torch.nn.Linear(16, 50, bias=False)
    torch.nn.init.normal_(head.weight, std=0.5, generator=gen)
    hidden = torch.randn(11, 16, generator=gen)
    targets = torch.randint(0, 50, (11,), generator=gen)
    inv_t = 1.0 / torch.tensor([1.0, 0.5, 2.0] * 3 + [1.0, 0.7])
    got = score_actions(
        hidden=hidden,
        targets=targets,
        inv_temperature=inv_t,
        lm_head=head,
        transform=transform,
        chunk_rows=chunk_rows,
        want_entropy=True,
    )
    logits = head(hidden).double()
    if transform.softcap:
        logits = torch.tanh(logits * transform.scale / transform.softcap) * transform.softcap
    logp = torch.log_softmax(logits * inv_t.double()[:, None], dim=-1)
    torch.testing.assert_close(
        got.logprobs.double(), logp.gather(1, targets[:, None])[:, 0], atol=1e-5, rtol=0
    )
    assert got.entropy is not None
    torch.testing.assert_close(got.entropy.double(), -(logp.exp() * logp).sum(-1), atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unit_temperature_head_equals_full_log_softmax(dtype: torch.dtype) -> None:
    """No temperature and no transform: the log-softmax upcasts the head's own logits in one op."""
    gen = torch.Generator().manual_seed(7)
    head = torch.nn.Linear(16, 300, bias=False)
    torch.nn.init.normal_(head.weight, std=0.5, generator=gen)
    head = head.to(dtype)
    hidden = torch.randn(13, 16, generator=gen).to(dtype)
    targets = torch.randint(0, 300, (13,), generator=gen)
    got = score_actions(
        hidden=hidden,
        targets=targets,
        inv_temperature=None,
        lm_head=head,
        transform=LogitTransform(),
        chunk_rows=5,
        want_entropy=True,
    )
    logp = torch.log_softmax(head(hidden).double(), dim=-1)  # the same model-dtype logits, in float64
    assert got.logprobs.dtype == torch.float32
    torch.testing.assert_close(
        got.logprobs.double(), logp.gather(1, targets[:, None])[:, 0], atol=1e-5, rtol=0
    )
    assert got.entropy is not None
    torch.testing.assert_close(got.entropy.double(), -(logp.exp() * logp).sum(-1), atol=1e-5, rtol=0)


def test_transform_from_config() -> None:
    assert LogitTransform.from_config(SimpleNamespace()) == LogitTransform()
    assert LogitTransform.from_config(SimpleNamespace(final_logit_softcapping=30.0)).softcap == 30.0
    assert LogitTransform.from_config(SimpleNamespace(logit_scale=0.0625)).scale == 0.0625  # Cohere
    assert LogitTransform.from_config(SimpleNamespace(logits_scaling=4.0)).scale == 0.25  # Granite


def test_self_check_catches_an_unreproduced_final_logit_transform(tmp_path: Path) -> None:
    model = models.build("gemma2")
    lm = CausalLM(model, TransformersDecoder(model.base_model), chunk_rows=8)
    job = SequenceJob(np.arange(3, 20), np.arange(1, 17), 1.0, False)
    cpu = torch.device("cpu")
    assert logits_check(lm, job, cpu) < 1e-4
    object.__setattr__(lm, "transform", LogitTransform())  # forget Gemma2's soft-capping
    with pytest.raises(RuntimeError, match="final-logit transform"):
        logits_check(lm, job, cpu)

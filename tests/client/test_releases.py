"""Each adapter against its framework's released scoring code (requirements-frameworks.txt), on the
same tiny model and batch, within 1e-5 in float32, through a real server.

- OpenRLHF 0.11.2: `Actor.forward(sequences, action_mask, attention_mask, return_output=True,
  return_entropy=True)` on the HF model (its action log-probs, and `output.entropy`, [B, L-1]).
- verl 0.9.1: its FSDP engine's steps without padding (`prepare_model_outputs`, use_remove_padding
  off): each sequence's real tokens from column 0, positions 0.., `logits / T`,
  `verl.utils.torch_functional.entropy_from_logits` and `logprobs_from_logits` of the next token,
  then `verl.workers.utils.padding.no_padding_2_padding` to the `[B, R]` responses.
- TRL 1.16.0: `GRPOTrainer._get_per_token_logps_and_entropies` on a model that TRL's
  `add_fused_lm_head(model, temperature=T, outputs=("log_probs", "entropy"))` patched, as its
  GRPOTrainer does.
"""

from __future__ import annotations

import contextlib
import copy
import sys
import types
from typing import Any

import pytest
import torch
from transformers.utils import import_utils

from service.client import Client
from service.client.adapters import openrlhf_log_probs, trl_log_probs, verl_log_probs
from service.client.conventions import openrlhf_tempered_entropy
from tests.support import releases
from tests.support.frameworks import LAYOUTS, Batch, make_batch

MODELS = ("qwen2", "gemma2")
ATOL = 1e-5


def close(got: torch.Tensor | None, want: torch.Tensor, mask: torch.Tensor) -> None:
    """float32 of the framework's shape; within ATOL on the mask; 0.0 off it, as the adapter gives."""
    assert got is not None
    assert got.dtype == want.dtype == torch.float32
    assert got.shape == want.shape == mask.shape
    torch.testing.assert_close(got[mask], want[mask], atol=ATOL, rtol=0)
    assert torch.equal(got[~mask], torch.zeros_like(got[~mask]))
    assert mask.any()


@torch.no_grad()
def openrlhf_actor(model: Any, batch: Batch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """OpenRLHF's action log-probs `[B, A]` and entropy `[B, L-1]`."""
    actor = releases.openrlhf_actor()(model, temperature=temperature)
    actor.packing_samples = False  # set only when Actor loads a checkpoint by name (as OpenRLHF's tests do)
    # compute_entropy is a torch.compile function: run eagerly, no compiler on the CPU test host
    with torch._dynamo.config.patch(disable=True):
        log_probs, output = actor(
            batch.input_ids,
            batch.action_mask,
            attention_mask=batch.attention_mask,
            return_output=True,
            return_entropy=True,
        )
    return log_probs, output.entropy


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_openrlhf(servers: dict[str, str], reference_models: dict[str, Any], model: str, layout: str) -> None:
    """OpenRLHF >= 0.11.1: entropy and log-probs of the same logits / T, from one request."""
    batch = make_batch(layout, seed=70 + LAYOUTS.index(layout))
    with Client(servers[model]) as client:
        got = openrlhf_log_probs(
            client,
            batch.input_ids,
            batch.attention_mask,
            batch.action_mask,
            temperature=0.7,
            return_entropy=True,
            tempered_entropy=True,
        )
    log_probs, entropy = openrlhf_actor(reference_models[model], batch, temperature=0.7)
    close(got.log_probs, log_probs, batch.action_mask)
    close(got.entropy, entropy[:, -batch.action_mask.shape[1] :], batch.action_mask)


def test_the_default_follows_the_installed_openrlhf(
    servers: dict[str, str], reference_models: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the 0.11.2 release on the path, the default (`tempered_entropy=None`) is its entropy."""
    monkeypatch.setattr(sys, "path", [*sys.path, str(releases.FRAMEWORKS)])
    assert openrlhf_tempered_entropy() is True
    batch = make_batch("left", seed=75)
    with Client(servers["qwen2"]) as client:
        got = openrlhf_log_probs(
            client,
            batch.input_ids,
            batch.attention_mask,
            batch.action_mask,
            temperature=1.4,
            return_entropy=True,
        )
    _, entropy = openrlhf_actor(reference_models["qwen2"], batch, temperature=1.4)
    close(got.entropy, entropy[:, -batch.action_mask.shape[1] :], batch.action_mask)


@pytest.mark.parametrize("model", MODELS)
def test_openrlhf_before_0_11_1(
    servers: dict[str, str], reference_models: dict[str, Any], model: str
) -> None:
    """`tempered_entropy=False`: OpenRLHF <= 0.11.0's entropy of the raw logits, which is what an
    `Actor` at T = 1 gives; the log-probs stay those of the Actor at T."""
    batch = make_batch("split", seed=76)
    with Client(servers[model]) as client:
        got = openrlhf_log_probs(
            client,
            batch.input_ids,
            batch.attention_mask,
            batch.action_mask,
            temperature=0.6,
            return_entropy=True,
            tempered_entropy=False,
        )
    log_probs, tempered = openrlhf_actor(reference_models[model], batch, temperature=0.6)
    _, raw = openrlhf_actor(reference_models[model], batch, temperature=1.0)
    close(got.log_probs, log_probs, batch.action_mask)
    close(got.entropy, raw[:, -batch.action_mask.shape[1] :], batch.action_mask)
    assert float((raw - tempered)[:, -batch.action_mask.shape[1] :][batch.action_mask].abs().max()) > 0.1


@torch.no_grad()
def verl_engine(model: Any, batch: Batch, r: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's log-probs and entropy of the `[B, R]` responses (the last R columns)."""
    verl = releases.verl()
    rows = [ids[mask.bool()] for ids, mask in zip(batch.input_ids, batch.attention_mask, strict=True)]
    lengths = torch.tensor([len(row) for row in rows])
    width = int(lengths.max())
    columns = torch.arange(width)
    real = columns[None, :] < lengths[:, None]  # [B, W]: each sequence's tokens from column 0
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    input_ids[real] = torch.cat(rows)
    position_ids = torch.where(real, columns[None, :], 0)
    logits = model(
        input_ids=input_ids, attention_mask=real.long(), position_ids=position_ids, use_cache=False
    ).logits
    logits = logits / temperature
    entropy = verl.entropy_from_logits(logits)[real]  # (total_nnz,)
    labels = torch.roll(torch.cat(rows), shifts=-1, dims=0)  # the next token of the packed sequences
    log_probs = verl.logprobs_from_logits(logits=logits[real], labels=labels)  # (total_nnz,)
    prompt_columns = batch.input_ids.shape[1] - r
    data = {
        "prompts": batch.input_ids[:, :prompt_columns],
        "responses": batch.input_ids[:, prompt_columns:],
        "attention_mask": batch.attention_mask,
    }
    return verl.no_padding_2_padding(log_probs, data), verl.no_padding_2_padding(entropy, data)


@pytest.mark.parametrize("model", MODELS)
def test_verl(servers: dict[str, str], reference_models: dict[str, Any], model: str) -> None:
    """verl's layout: left-padded prompts, right-padded responses."""
    batch = make_batch("split", seed=80, rows=6, prompts=3)
    r = batch.window
    with Client(servers[model]) as client:
        got = verl_log_probs(
            client,
            batch.input_ids,
            batch.attention_mask,
            batch.input_ids[:, -r:],
            temperature=0.6,
            calculate_entropy=True,
        )
    log_probs, entropy = verl_engine(reference_models[model], batch, r, temperature=0.6)
    response_mask = batch.attention_mask[:, -r:].bool()
    close(got.log_probs, log_probs, response_mask)
    close(got.entropy, entropy, response_mask)


@torch.no_grad()
def trl_grpo(
    model: Any, batch: Batch, logits_to_keep: int, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL GRPO's per-token log-probs and entropies `[B, C]` of the last C columns."""
    trl = releases.trl()
    fused = copy.deepcopy(model)  # add_fused_lm_head patches the model's forward
    trl.add_fused_lm_head(fused, temperature=temperature, outputs=("log_probs", "entropy"))
    # what the method reads of its trainer: the accelerator's autocast, and whether it is the main
    # process (TRL's profiling decorator)
    accelerator = types.SimpleNamespace(autocast=contextlib.nullcontext, is_main_process=True)
    trainer = types.SimpleNamespace(accelerator=accelerator)
    log_probs, entropy, _ = trl.per_token_logps_and_entropies(
        trainer, fused, batch.input_ids, batch.attention_mask, logits_to_keep, compute_entropy=True
    )
    return log_probs, entropy


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("layout", ["split", "left"])
def test_trl(servers: dict[str, str], reference_models: dict[str, Any], model: str, layout: str) -> None:
    batch = make_batch(layout, seed=90 + LAYOUTS.index(layout), rows=6, prompts=2)
    c = batch.window
    with Client(servers[model]) as client:
        got = trl_log_probs(
            client, batch.input_ids, batch.attention_mask, c, temperature=1.3, compute_entropy=True
        )
    log_probs, entropy = trl_grpo(reference_models[model], batch, c, temperature=1.3)
    completion_mask = batch.attention_mask[:, -c:].bool()
    close(got.log_probs, log_probs, completion_mask)
    close(got.entropy, entropy, completion_mask)


def test_no_stand_in_outlives_its_import() -> None:
    """Once the releases are imported, nothing of them is on the path, no stand-in is a module, and
    transformers still sees no peft and no flash-attn."""
    releases.openrlhf_actor(), releases.verl(), releases.trl()
    assert str(releases.FRAMEWORKS) not in sys.path
    for name in ("deepspeed", "flash_attn", "peft", "tensordict", "pandas", "datasets", "pyarrow"):
        assert name not in sys.modules
    assert not import_utils.is_peft_available()
    assert not import_utils.is_flash_attn_2_available()
    assert not import_utils.is_accelerate_available()
    assert not [name for name in sys.modules if name.partition(".")[0] in ("accelerate", "trl", "verl")]

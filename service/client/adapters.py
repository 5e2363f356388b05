"""Torch adapters: each framework's own scoring call, answered by logprobd with the same tensor.

Every function takes the tensors the framework already holds, sends them in the matching padded
layout of SEMANTICS.md, and returns float32 tensors on the input's device, shaped and aligned as
the framework's in-process forward returns them:

- OpenRLHF `Actor.forward(sequences, action_mask, attention_mask)`: `[B, A]` action log-probs, where
  `action_mask` `[B, A]` is about the last A of columns 1..L-1 (A = L-1 in current OpenRLHF, where
  `action_mask[:, j]` is about column j+1); entries outside the mask are 0.0, as OpenRLHF's
  `log_probs * action_mask` makes them; its entropy (`return_entropy`) is of the logits before the
  temperature, as OpenRLHF computes it (a second request at T = 1 when T != 1).
- verl `DataParallelPPOActor._forward_micro_batch`: `[B, R]` log-probs (and entropy) of the last R
  columns, R = `responses.size(-1)`; response_mask = attention_mask[:, -R:].
- TRL `GRPOTrainer._get_per_token_logps`: `[B, C]` log-probs of the last C = `logits_to_keep` columns.

verl and TRL leave unspecified values where their mask is 0 and mask them in every loss; here those
entries are exactly 0.0. Each sync function has an `_async` twin taking an `AsyncClient`.
"""

from __future__ import annotations

from typing import Any

import torch

from service.client._async import AsyncClient
from service.client._plans import TensorScores, openrlhf_plan, trl_plan, verl_plan
from service.client._sync import Client

__all__ = [
    "TensorScores",
    "openrlhf_log_probs",
    "openrlhf_log_probs_async",
    "trl_log_probs",
    "trl_log_probs_async",
    "verl_log_probs",
    "verl_log_probs_async",
]


def openrlhf_log_probs(
    client: Client,
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    **options: Any,
) -> TensorScores:
    """OpenRLHF's action log-probs `[B, A]` for `sequences` `[B, L]` (any padding side)."""
    plan = openrlhf_plan(
        sequences,
        attention_mask,
        action_mask,
        temperature=temperature,
        entropy=return_entropy,
        options=options,
    )
    return plan.run(client)


async def openrlhf_log_probs_async(
    client: AsyncClient,
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    **options: Any,
) -> TensorScores:
    plan = openrlhf_plan(
        sequences,
        attention_mask,
        action_mask,
        temperature=temperature,
        entropy=return_entropy,
        options=options,
    )
    return await plan.run_async(client)


def verl_log_probs(
    client: Client,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    responses: torch.Tensor,
    *,
    temperature: float,
    calculate_entropy: bool = False,
    **options: Any,
) -> TensorScores:
    """verl's `[B, R]` log-probs (and entropy) of `input_ids` `[B, P+R]` ending in `responses` `[B, R]`."""
    plan = verl_plan(
        input_ids,
        attention_mask,
        responses,
        temperature=temperature,
        entropy=calculate_entropy,
        options=options,
    )
    return plan.run(client)


async def verl_log_probs_async(
    client: AsyncClient,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    responses: torch.Tensor,
    *,
    temperature: float,
    calculate_entropy: bool = False,
    **options: Any,
) -> TensorScores:
    plan = verl_plan(
        input_ids,
        attention_mask,
        responses,
        temperature=temperature,
        entropy=calculate_entropy,
        options=options,
    )
    return await plan.run_async(client)


def trl_log_probs(
    client: Client,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    *,
    temperature: float = 1.0,
    compute_entropy: bool = False,
    **options: Any,
) -> TensorScores:
    """TRL GRPO's per-token log-probs `[B, C]` of the last C = `logits_to_keep` columns of `input_ids`."""
    plan = trl_plan(
        input_ids,
        attention_mask,
        logits_to_keep,
        temperature=temperature,
        entropy=compute_entropy,
        options=options,
    )
    return plan.run(client)


async def trl_log_probs_async(
    client: AsyncClient,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    *,
    temperature: float = 1.0,
    compute_entropy: bool = False,
    **options: Any,
) -> TensorScores:
    plan = trl_plan(
        input_ids,
        attention_mask,
        logits_to_keep,
        temperature=temperature,
        entropy=compute_entropy,
        options=options,
    )
    return await plan.run_async(client)

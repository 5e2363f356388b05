"""Torch adapters: each framework's own scoring call, answered by logprobd with the same tensor.

Every function takes the tensors the framework already holds, sends them in the matching padded
layout of docs/semantics.md, and returns float32 tensors on the input's device, shaped and aligned as
the framework's in-process forward returns them:

- OpenRLHF `Actor.forward(sequences, action_mask, attention_mask)`: `[B, A]` action log-probs, where
  `action_mask` `[B, A]` is about the last A of columns 1..L-1 (A = L-1 in current OpenRLHF, where
  `action_mask[:, j]` is about column j+1); entries outside the mask are 0.0, as OpenRLHF's
  `log_probs * action_mask` makes them; its entropy (`return_entropy`) follows the installed
  OpenRLHF: >= 0.11.1 takes it of `logits / T`, the policy the log-probs describe (one request), and
  <= 0.11.0 of the raw logits (a second request at T = 1 when T != 1). `tempered_entropy=True/False`
  chooses; the default None reads the installed version and, without OpenRLHF, takes the current
  convention, `logits / T`.
- verl's FSDP engine (`DataParallelPPOActor._forward_micro_batch` before 0.9): `[B, R]` log-probs
  (and entropy) of the last R columns, R = `responses.size(-1)`; response_mask =
  attention_mask[:, -R:].
- TRL `GRPOTrainer._get_per_token_logps_and_entropies`: `[B, C]` log-probs (and entropy) of the
  last C = `logits_to_keep` columns.

verl and TRL leave unspecified values where their mask is 0 and mask them in every loss; here those
entries are exactly 0.0. Each sync function has an `_async` twin taking an `AsyncClient`.

Everything PPO needs, from the same request (a server started with `--critic` / `--ref-model`):

- `return_values=True` -> `TensorScores.values`: the critic's value head on its hidden state at
  `t-1` for the action at column `t`, i.e. entry for entry the same alignment as `log_probs`. That is
  how each framework slices its critic: OpenRLHF's `CriticModel.forward` takes `head(h)[:, :-1]`
  then the last A columns (its `values`, `[B, A]`, like `action_log_probs`); verl's
  `DataParallelPPOCritic._forward_micro_batch` takes `values[:, -R - 1 : -1]` (its `values`,
  `[B, R]`, masked by response_mask); TRL's `PPOTrainer` takes `full_value[:, context_length - 1 :
  -1]` (`[B, C]`). OpenRLHF critics saved with `normalize_reward` give `(v - mean) / std`, as
  OpenRLHF's forward does.
- `return_ref_log_probs=True` -> `TensorScores.ref_log_probs` (OpenRLHF `base_action_log_probs`,
  verl `ref_log_prob`, TRL `ref_per_token_logps`), computed by the reference model at the call's
  temperature, as the three frameworks do; and `TensorScores.kl`, with r = log_probs -
  ref_log_probs, by `kl_estimator`: `k1` = r, `k2` = r²/2, `k3` = exp(-r) - 1 + r (OpenRLHF's
  `compute_approx_kl` k1/k2/k3; verl's `kl_penalty` kl/mse/low_var_kl, except that OpenRLHF 0.11
  clamps each estimate and verl low_var_kl to [-10, 10], and the server does not; TRL GRPO's
  `per_token_kl` is k3).
- `rollout_log_probs=` the log-probs the inference engine reported at sampling time, shaped like the
  output (OpenRLHF `[B, A]` like `action_mask`, verl `[B, R]` like `responses`, TRL `[B, C]`);
  entries off the mask are not sent. `TensorScores.rollout` then carries the server's
  training-inference mismatch statistics over the scored actions (`RolloutStats`).

`values`, `ref_log_probs` and `kl` are float32, shaped, placed and masked exactly like `log_probs`
(0.0 where `action_mask` is False), and None unless asked for. Other keyword arguments (`timeout_s`,
`eos_token_id`, ...) are sent as they are; request fields the adapter fills itself are refused there.

Routing replay (verl's router replay, R2/R3; docs/api.md, 'Routing replay'): `verl_log_probs(...,
routed_experts=batch["routed_experts"])` replays verl's `[B, L, layers, top_k]` tensor, the layout
verl's agent loop builds from SGLang's or vLLM's capture (`routed_experts[:, start_pos:end_pos]`,
zeros elsewhere: the server ignores padding columns, and trailing all-zero entries, which the rollout
never recorded, route live); `return_routed_experts=True` returns the policy's own routes in the
same layout (`TensorScores.routed_experts`, int16 as verl stores them), and `route_agreement` says
how far the live router strayed from given ones.

GRPO batches repeat each prompt G times: rows whose prompts are the same, token for token (verl:
the columns before `responses`; TRL: before the last `logits_to_keep`; OpenRLHF: before the first
column `action_mask` marks in any row), go out grouped, each prompt once (docs/api.md, 'Grouped
requests'), with the same results. `grouped=False` sends every row in full (a server older than
the grouped form refuses `prompt_ids`).
"""

from __future__ import annotations

from typing import Any

import torch

from service.client._async import AsyncClient
from service.client._plans import Asked, TensorScores, openrlhf_plan, trl_plan, verl_plan
from service.client._sync import Client
from service.client.conventions import openrlhf_tempered_entropy
from service.client.wire import RolloutStats

__all__ = [
    "RolloutStats",
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
    return_values: bool = False,
    return_ref_log_probs: bool = False,
    kl_estimator: str = "k1",
    rollout_log_probs: torch.Tensor | None = None,
    grouped: bool = True,
    tempered_entropy: bool | None = None,
    **options: Any,
) -> TensorScores:
    """OpenRLHF's action log-probs `[B, A]` for `sequences` `[B, L]` (any padding side); with
    `return_values` / `return_ref_log_probs` also the critic's `values` and the reference's
    `base_action_log_probs` (`ref_log_probs`) and `kl`, each `[B, A]` like the log-probs.
    `tempered_entropy`: the entropy of `logits / T` (True) or of the raw logits (False); None: as
    the installed OpenRLHF takes it (`conventions.openrlhf_tempered_entropy`)."""
    asked = Asked(return_entropy, return_values, return_ref_log_probs, kl_estimator, rollout_log_probs)
    plan = openrlhf_plan(
        sequences,
        attention_mask,
        action_mask,
        temperature=temperature,
        asked=asked,
        options=options,
        grouped=grouped,
        tempered_entropy=_tempered(tempered_entropy, return_entropy),
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
    return_values: bool = False,
    return_ref_log_probs: bool = False,
    kl_estimator: str = "k1",
    rollout_log_probs: torch.Tensor | None = None,
    grouped: bool = True,
    tempered_entropy: bool | None = None,
    **options: Any,
) -> TensorScores:
    asked = Asked(return_entropy, return_values, return_ref_log_probs, kl_estimator, rollout_log_probs)
    plan = openrlhf_plan(
        sequences,
        attention_mask,
        action_mask,
        temperature=temperature,
        asked=asked,
        options=options,
        grouped=grouped,
        tempered_entropy=_tempered(tempered_entropy, return_entropy),
    )
    return await plan.run_async(client)


def _tempered(chosen: bool | None, asked: bool) -> bool:
    """The caller's choice, else the installed OpenRLHF's (looked up only when entropy is asked)."""
    if chosen is not None:
        return chosen
    return openrlhf_tempered_entropy() if asked else True


def verl_log_probs(
    client: Client,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    responses: torch.Tensor,
    *,
    temperature: float,
    calculate_entropy: bool = False,
    return_values: bool = False,
    return_ref_log_probs: bool = False,
    kl_estimator: str = "k1",
    rollout_log_probs: torch.Tensor | None = None,
    grouped: bool = True,
    routed_experts: torch.Tensor | None = None,
    return_routed_experts: bool = False,
    **options: Any,
) -> TensorScores:
    """verl's `[B, R]` log-probs (and entropy) of `input_ids` `[B, P+R]` ending in `responses` `[B, R]`;
    with `return_values` / `return_ref_log_probs` also the critic's `values` and the reference's
    `ref_log_prob` (`ref_log_probs`) and `kl`, each `[B, R]`. `routed_experts`: verl's router-replay
    tensor `[B, P+R, layers, top_k]` (`batch["routed_experts"]`, laid out like `input_ids`), replayed
    (R3); `return_routed_experts`: the policy's own routes back in that layout (R2)."""
    asked = Asked(
        calculate_entropy,
        return_values,
        return_ref_log_probs,
        kl_estimator,
        rollout_log_probs,
        routed_experts,
        return_routed_experts,
    )
    plan = verl_plan(
        input_ids,
        attention_mask,
        responses,
        temperature=temperature,
        asked=asked,
        options=options,
        grouped=grouped,
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
    return_values: bool = False,
    return_ref_log_probs: bool = False,
    kl_estimator: str = "k1",
    rollout_log_probs: torch.Tensor | None = None,
    grouped: bool = True,
    routed_experts: torch.Tensor | None = None,
    return_routed_experts: bool = False,
    **options: Any,
) -> TensorScores:
    asked = Asked(
        calculate_entropy,
        return_values,
        return_ref_log_probs,
        kl_estimator,
        rollout_log_probs,
        routed_experts,
        return_routed_experts,
    )
    plan = verl_plan(
        input_ids,
        attention_mask,
        responses,
        temperature=temperature,
        asked=asked,
        options=options,
        grouped=grouped,
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
    return_values: bool = False,
    return_ref_log_probs: bool = False,
    kl_estimator: str = "k1",
    rollout_log_probs: torch.Tensor | None = None,
    grouped: bool = True,
    **options: Any,
) -> TensorScores:
    """TRL GRPO's per-token log-probs `[B, C]` of the last C = `logits_to_keep` columns of `input_ids`;
    with `return_ref_log_probs` also `ref_per_token_logps` (`ref_log_probs`) and `kl` (GRPO uses
    `kl_estimator="k3"`), with `return_values` the critic's `values` (TRL PPO), each `[B, C]`."""
    asked = Asked(compute_entropy, return_values, return_ref_log_probs, kl_estimator, rollout_log_probs)
    plan = trl_plan(
        input_ids,
        attention_mask,
        logits_to_keep,
        temperature=temperature,
        asked=asked,
        options=options,
        grouped=grouped,
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
    return_values: bool = False,
    return_ref_log_probs: bool = False,
    kl_estimator: str = "k1",
    rollout_log_probs: torch.Tensor | None = None,
    grouped: bool = True,
    **options: Any,
) -> TensorScores:
    asked = Asked(compute_entropy, return_values, return_ref_log_probs, kl_estimator, rollout_log_probs)
    plan = trl_plan(
        input_ids,
        attention_mask,
        logits_to_keep,
        temperature=temperature,
        asked=asked,
        options=options,
        grouped=grouped,
    )
    return await plan.run_async(client)

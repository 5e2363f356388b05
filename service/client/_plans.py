"""Tensors in, request bodies out, and responses back to tensors: the layout work of the adapters.

One `Plan` per framework call: the padded-layout body of SEMANTICS.md built from the framework's
tensors, and which columns of the server's action window the framework's output keeps.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import torch

from service.client._async import AsyncClient
from service.client._sync import Client
from service.client.wire import Scores


@dataclass(frozen=True, slots=True)
class TensorScores:
    """Float32 tensors `[B, W]` on the caller's device, aligned as the framework aligns its output."""

    log_probs: torch.Tensor
    entropy: torch.Tensor | None  # when asked for, else None
    action_mask: torch.Tensor  # bool: the entries the server scored


@dataclass(frozen=True, slots=True)
class Plan:
    """A request body, and how to turn its response into the framework's tensors."""

    body: dict[str, Any]
    keep: int  # the framework's output is the last `keep` columns of the server's window
    device: torch.device
    entropy_body: dict[str, Any] | None = None  # entropy asked at another temperature (OpenRLHF)

    def run(self, client: Client) -> TensorScores:
        entropy = None if self.entropy_body is None else client.score_request(self.entropy_body)
        return self.finish(client.score_request(self.body), entropy)

    async def run_async(self, client: AsyncClient) -> TensorScores:
        if self.entropy_body is None:
            return self.finish(await client.score_request(self.body), None)
        scores, entropy = await asyncio.gather(
            client.score_request(self.body), client.score_request(self.entropy_body)
        )
        return self.finish(scores, entropy)

    def finish(self, scores: Scores, entropy_scores: Scores | None) -> TensorScores:
        def tensor(rows: list[list[float]] | list[list[int]], dtype: torch.dtype) -> torch.Tensor:
            full = torch.tensor(rows, dtype=dtype)  # [B, W]
            return full[:, full.shape[1] - self.keep :].to(self.device)

        entropy = (entropy_scores or scores).entropy
        return TensorScores(
            log_probs=tensor(scores.logprobs, torch.float32),
            entropy=None if entropy is None else tensor(entropy, torch.float32),
            action_mask=tensor(scores.action_mask, torch.bool),
        )


def openrlhf_plan(
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    temperature: float,
    entropy: bool,
    options: dict[str, Any],
) -> Plan:
    batch, length = _check_padded(sequences, attention_mask)
    if action_mask.dim() != 2 or action_mask.shape[0] != batch or not 0 <= action_mask.shape[1] < length:
        raise ValueError(
            f"action_mask must be [B, A] with A <= L-1 = {length - 1}, got {list(action_mask.shape)}"
        )
    actions = action_mask.shape[1]
    window = torch.zeros(batch, length - 1, dtype=torch.int64)  # [B, L-1]: column j+1 is an action
    window[:, length - 1 - actions :] = action_mask.detach().cpu().to(torch.int64)
    # OpenRLHF takes the entropy of the logits before dividing them by the temperature
    separate = entropy and temperature != 1.0
    body = _body(
        sequences, attention_mask, temperature=temperature, entropy=entropy and not separate, options=options
    )
    body["action_mask"] = window.tolist()
    entropy_body = {**body, "temperature": 1.0, "return_entropy": True} if separate else None
    return Plan(body=body, keep=actions, device=sequences.device, entropy_body=entropy_body)


def verl_plan(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    responses: torch.Tensor,
    *,
    temperature: float,
    entropy: bool,
    options: dict[str, Any],
) -> Plan:
    batch, length = _check_padded(input_ids, attention_mask)
    r = responses.shape[-1]
    if responses.dim() != 2 or responses.shape[0] != batch or r >= length:
        raise ValueError(f"responses must be [B, R] with R < {length}, got {list(responses.shape)}")
    if not torch.equal(input_ids[:, length - r :].cpu(), responses.cpu()):
        raise ValueError("responses must be the last R columns of input_ids, as verl lays them out")
    body = _body(input_ids, attention_mask, temperature=temperature, entropy=entropy, options=options)
    body["response_length"] = r
    return Plan(body=body, keep=r, device=input_ids.device)


def trl_plan(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    *,
    temperature: float,
    entropy: bool,
    options: dict[str, Any],
) -> Plan:
    _, length = _check_padded(input_ids, attention_mask)
    if not 0 <= logits_to_keep < length:
        raise ValueError(f"logits_to_keep must be in [0, {length}), got {logits_to_keep}")
    body = _body(input_ids, attention_mask, temperature=temperature, entropy=entropy, options=options)
    body["response_length"] = int(logits_to_keep)
    return Plan(body=body, keep=int(logits_to_keep), device=input_ids.device)


def _check_padded(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[int, int]:
    if input_ids.dim() != 2 or input_ids.shape != attention_mask.shape:
        raise ValueError(
            f"input ids and attention_mask must both be [B, L], got {list(input_ids.shape)} and "
            f"{list(attention_mask.shape)}"
        )
    return int(input_ids.shape[0]), int(input_ids.shape[1])


def _body(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    temperature: float,
    entropy: bool,
    options: dict[str, Any],
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "input_ids": input_ids.detach().cpu().tolist(),
        "attention_mask": attention_mask.detach().cpu().to(torch.int64).tolist(),
        "temperature": float(temperature),
        **options,
    }
    if entropy:
        body["return_entropy"] = True
    return body

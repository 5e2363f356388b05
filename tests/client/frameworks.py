"""Each framework's in-process scoring, re-implemented from SEMANTICS.md and the frameworks' public
code (read, not imported): the HF model's own forward on the padded batch, float32.

- OpenRLHF `Actor.forward`: position ids cumsum(mask)-1 (1 on padding), logits[:, :-1] / T,
  log-softmax gathered at sequences[:, 1:], the last A columns, times action_mask.
- verl `_forward_micro_batch` (padded path): position ids clamp(cumsum(mask)-1, 0), logits / T,
  columns -R-1..-2, gathered at `responses`; entropy = logsumexp - sum(p * logits).
- TRL `_get_per_token_logps(_and_entropies)`: no position ids (the model counts columns),
  `logits_to_keep=C+1`, logits[:, :-1][:, -C:] / T gathered at input_ids[:, -C:]; entropy of those.

Like the frameworks themselves, these leave whatever the model gives where the mask is 0.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch

from tests import models

LAYOUTS = ("left", "right", "split")


@dataclass(frozen=True)
class Batch:
    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    action_mask: torch.Tensor  # [B, L-1] bool: column j+1 is a response token (OpenRLHF)
    window: int  # R: the last R columns hold every response token (verl responses, TRL logits_to_keep)


def make_batch(layout: str, seed: int, rows: int = 5) -> Batch:
    """Random prompt+response rows; `left`: left-padded, `right`: right-padded, `split`: left-padded
    prompt then right-padded response (verl, TRL). Prompts are long enough that no row's first real
    token falls in the last-R-columns window."""
    rng = random.Random(seed)
    responses = [[rng.randrange(models.VOCAB) for _ in range(rng.randint(1, 8))] for _ in range(rows)]
    longest = max(map(len, responses))
    prompts = [
        [rng.randrange(models.VOCAB) for _ in range(rng.randint(longest + 1, longest + 10))]
        for _ in responses
    ]
    ids, mask, acts = [], [], []
    width_p, width = (
        max(map(len, prompts)),
        max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True)),
    )
    for p, r in zip(prompts, responses, strict=True):
        if layout == "split":
            left, right = width_p - len(p), longest - len(r)
        elif layout == "left":
            left, right = width - len(p) - len(r), 0
        else:
            left, right = 0, width - len(p) - len(r)
        ids.append([0] * left + p + r + [0] * right)
        mask.append([0] * left + [1] * (len(p) + len(r)) + [0] * right)
        acts.append([0] * (left + len(p)) + [1] * len(r) + [0] * right)
    first_response = min(a.index(1) for a in acts)
    return Batch(
        input_ids=torch.tensor(ids),
        attention_mask=torch.tensor(mask),
        action_mask=torch.tensor(acts)[:, 1:].bool(),
        window=len(ids[0]) - first_response,
    )


@torch.no_grad()
def openrlhf(model: Any, batch: Batch, action_mask: torch.Tensor, temperature: float) -> torch.Tensor:
    sequences, attention_mask = batch.input_ids, batch.attention_mask
    position_ids = attention_mask.long().cumsum(-1) - 1
    position_ids.masked_fill_(attention_mask == 0, 1)
    logits = model(sequences, attention_mask=attention_mask, position_ids=position_ids).logits.float()
    log_probs = _gather(logits[:, :-1] / temperature, sequences[:, 1:])  # [B, L-1]
    return log_probs[:, -action_mask.shape[1] :] * action_mask.float()


@torch.no_grad()
def openrlhf_entropy(model: Any, batch: Batch) -> torch.Tensor:
    """OpenRLHF `return_entropy`: the entropy of every column's next-token distribution, [B, L-1],
    taken before `log_probs_from_logits` divides the logits by the temperature (in place)."""
    position_ids = (batch.attention_mask.cumsum(-1) - 1).masked_fill(batch.attention_mask == 0, 1)
    logits = model(batch.input_ids, attention_mask=batch.attention_mask, position_ids=position_ids).logits
    return _entropy(logits.float()[:, :-1])


@torch.no_grad()
def verl(
    model: Any, batch: Batch, responses: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    r = responses.shape[-1]
    position_ids = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
    output = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=position_ids,
        use_cache=False,
    )
    logits = (output.logits.float() / temperature)[:, -r - 1 : -1]  # [B, R, V]
    return _gather(logits, responses), _entropy(logits)


@torch.no_grad()
def trl(
    model: Any, batch: Batch, logits_to_keep: int, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    c = logits_to_keep
    logits = model(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, logits_to_keep=c + 1
    ).logits.float()
    logits = logits[:, :-1][:, -c:] / temperature  # [B, C, V]
    return _gather(logits, batch.input_ids[:, -c:]), _entropy(logits)


def _gather(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(-1)

"""Each framework's in-process scoring, re-implemented from docs/semantics.md and the frameworks' public
code (read, not imported): the HF model's own forward on the padded batch, float32. test_releases.py runs
the frameworks' released code itself (tests/support/releases.py).

- OpenRLHF `Actor.forward`: position ids cumsum(mask)-1 (1 on padding), logits[:, :-1] / T,
  log-softmax gathered at sequences[:, 1:], the last A columns, times action_mask; entropy of the
  same logits / T (0.11.1 on; before, of the raw logits).
- verl `_forward_micro_batch` (padded path): position ids clamp(cumsum(mask)-1, 0), logits / T,
  columns -R-1..-2, gathered at `responses`; entropy = logsumexp - sum(p * logits).
- TRL `_get_per_token_logps(_and_entropies)`: no position ids (the model counts columns),
  `logits_to_keep=C+1`, logits[:, :-1][:, -C:] / T gathered at input_ids[:, -C:]; entropy of those.

Like the frameworks themselves, these leave whatever the model gives where the mask is 0.

For what a PPO server adds (critic values, reference log-probs, KL), `by_column` is the per-sequence
reference of docs/semantics.md instead: each unpadded sequence scored alone (the policy's and the
reference model's own forward; values `head(h_{t-1})` read straight from the critic's safetensors by
`tests.support.critics.expected_values`), every score placed at the column of the token it scores; `kl` is
k1/k2/k3 of Schulman's note. A framework's output is then the columns it keeps.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tests.support import critics, models
from tests.support.device import TOLERANCE

LAYOUTS = ("left", "right", "split")


@dataclass(frozen=True)
class Batch:
    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    action_mask: torch.Tensor  # [B, L-1] bool: column j+1 is a response token (OpenRLHF)
    window: int  # R: the last R columns hold every response token (verl responses, TRL logits_to_keep)


def make_batch(layout: str, seed: int, rows: int = 5, prompts: int | None = None) -> Batch:
    """Random prompt+response rows; `left`: left-padded, `right`: right-padded, `split`: left-padded
    prompt then right-padded response (verl, TRL). Prompts are long enough that no row's first real
    token falls in the last-R-columns window. With `prompts`, only that many distinct prompts, row i
    having prompt i % prompts (a GRPO batch, groups interleaved)."""
    rng = random.Random(seed)
    responses = [[rng.randrange(models.VOCAB) for _ in range(rng.randint(1, 8))] for _ in range(rows)]
    longest = max(map(len, responses))
    distinct = [
        [rng.randrange(models.VOCAB) for _ in range(rng.randint(longest + 1, longest + 10))]
        for _ in range(prompts or rows)
    ]
    prompt_rows = [distinct[i % len(distinct)] for i in range(rows)]
    ids, mask, acts = [], [], []
    width_p, width = (
        max(map(len, prompt_rows)),
        max(len(p) + len(r) for p, r in zip(prompt_rows, responses, strict=True)),
    )
    for p, r in zip(prompt_rows, responses, strict=True):
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
def openrlhf_entropy(model: Any, batch: Batch, temperature: float) -> torch.Tensor:
    """OpenRLHF `return_entropy`: the entropy of every column's next-token distribution, [B, L-1], of
    `logits / T` (OpenRLHF >= 0.11.1); at T = 1, that of the raw logits (OpenRLHF <= 0.11.0)."""
    position_ids = (batch.attention_mask.cumsum(-1) - 1).masked_fill(batch.attention_mask == 0, 1)
    logits = model(batch.input_ids, attention_mask=batch.attention_mask, position_ids=position_ids).logits
    return _entropy(logits.float()[:, :-1] / temperature)


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


@dataclass(frozen=True)
class ByColumn:
    """Per-sequence reference scores `[B, L]` (float64), each at the column of the token it scores;
    0.0 at padding and at each row's first real token, which nothing scores."""

    log_probs: torch.Tensor
    ref_log_probs: torch.Tensor
    values: torch.Tensor


def sequence_log_probs(model: Any, tokens: list[int], temperature: float) -> list[float]:
    """log_softmax(z_{t-1} / T)[x_t] for t = 1..L-1, the model's own forward on the one sequence."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens], device=model.device)).logits[0].double().cpu()
    logp = torch.log_softmax(logits[:-1] / temperature, dim=-1)
    return [float(v) for v in logp.gather(-1, torch.tensor(tokens[1:])[:, None]).squeeze(-1)]


def by_column(batch: Batch, policy: Any, reference: Any, critic_dir: Path, temperature: float) -> ByColumn:
    shape = batch.input_ids.shape
    lp, ref, values = (torch.zeros(shape, dtype=torch.float64) for _ in range(3))
    for i in range(shape[0]):
        columns = batch.attention_mask[i].nonzero().flatten().tolist()
        tokens = batch.input_ids[i, columns].tolist()
        per_lp = sequence_log_probs(policy, tokens, temperature)  # index t-1: the token at position t
        per_ref = sequence_log_probs(reference, tokens, temperature)
        per_value = critics.expected_values(critic_dir, tokens)  # index t-1: head(h_{t-1}), action t
        for t in range(1, len(tokens)):
            c = columns[t]
            lp[i, c], ref[i, c], values[i, c] = per_lp[t - 1], per_ref[t - 1], per_value[t - 1]
    return ByColumn(lp, ref, values)


def kl(lp: torch.Tensor, ref: torch.Tensor, estimator: str) -> torch.Tensor:
    """k1 = r, k2 = r²/2, k3 = exp(-r) - 1 + r, with r = lp - ref."""
    r = lp - ref
    return {"k1": r, "k2": r * r / 2, "k3": torch.expm1(-r) + r}[estimator]


def check(got: torch.Tensor, want: torch.Tensor, mask: torch.Tensor) -> None:
    """Equal within the tolerance where `mask`, exactly 0.0 elsewhere; float32, same shape."""
    assert got.dtype == torch.float32
    assert got.shape == want.shape == mask.shape
    torch.testing.assert_close(got[mask], want[mask].float(), atol=TOLERANCE, rtol=0)
    assert torch.equal(got[~mask], torch.zeros_like(got[~mask]))
    assert mask.any()

"""One PPO-style experience step with logprobd: old log-probs of a rollout, then GAE advantages.

    make serve                                   # in another shell: the demo model on :8000
    python -m examples.ppo_step --url http://127.0.0.1:8000 [--api-key KEY]

The rollout is random tokens in OpenRLHF's layout (left-padded prompts, right-padded responses,
`action_mask` [B, L-1] about columns 1..L-1); in a trainer it comes from generation. The old
log-probs come from logprobd through the OpenRLHF adapter, exactly as `Actor.forward` computes them.

Reference log-probs and critic values come from the critic issue's server options (`--ref-model`,
`--critic`; request flags `return_ref_logprobs`, `return_values`), which the adapters do not map to
framework tensors yet and a plain `make serve` does not have. So this step uses what every server
has: the reference policy is the policy itself (KL = 0) and the critic a zero baseline, so the
advantages are plain discounted returns. On a server with them, `client.score(...,
return_ref_logprobs=True, return_values=True)` already returns their rows (in `Scores.extra`).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

import torch

from service.client import Client
from service.client.adapters import openrlhf_log_probs

PAD = 0


@dataclass(frozen=True)
class Rollout:
    sequences: torch.Tensor  # [B, L] prompt + response, left/right padded
    attention_mask: torch.Tensor  # [B, L]
    action_mask: torch.Tensor  # [B, L-1] bool: column j+1 is a response token
    rewards: torch.Tensor  # [B] one scalar reward per sequence (a reward model's or a verifier's)


@dataclass(frozen=True)
class Experience:
    old_log_probs: torch.Tensor  # [B, L-1], 0.0 off the action mask
    advantages: torch.Tensor  # [B, L-1], whitened over the actions
    returns: torch.Tensor  # [B, L-1]


def random_rollout(vocab_size: int, batch: int = 4, seed: int = 0) -> Rollout:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab_size, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g)
               for _ in range(batch)]  # fmt: skip
    responses = [torch.randint(1, vocab_size, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g)
                 for _ in range(batch)]  # fmt: skip
    p_width, r_width = max(len(p) for p in prompts), max(len(r) for r in responses)
    sequences = torch.full((batch, p_width + r_width), PAD)
    attention_mask = torch.zeros_like(sequences)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        sequences[i, p_width - len(p) : p_width + len(r)] = torch.cat([p, r])
        attention_mask[i, p_width - len(p) : p_width + len(r)] = 1
    columns = torch.arange(p_width + r_width)
    action_mask = (columns >= p_width) & attention_mask.bool()  # [B, L]: response columns
    return Rollout(sequences, attention_mask, action_mask[:, 1:], torch.rand(batch, generator=g))


def token_rewards(
    rewards: torch.Tensor,
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
) -> torch.Tensor:
    """Per-action reward: -kl_coef * (log p - log p_ref) everywhere, plus the sequence reward at its
    last action (OpenRLHF's `compute_reward` with the k1 estimator)."""
    shaped = -kl_coef * (log_probs - ref_log_probs) * mask
    last = mask.shape[1] - 1 - mask.long().flip(-1).argmax(-1)  # [B] column of each row's last action
    return shaped.scatter_add(1, last[:, None], rewards[:, None].to(shaped.dtype))


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over [B, T] (T the action window), masked positions zeroed:
    A_t = delta_t + gamma * lam * A_{t+1}, delta_t = r_t + gamma * V_{t+1} - V_t; returns A + V."""
    rewards, values = rewards * mask, values * mask
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        next_value = values[:, t + 1] if t + 1 < rewards.shape[1] else torch.zeros_like(running)
        running = rewards[:, t] + gamma * next_value - values[:, t] + gamma * lam * running
        advantages[:, t] = running
    return advantages, advantages + values


def whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    n = mask.sum()
    mean = (x * mask).sum() / n
    var = ((x - mean) ** 2 * mask).sum() / n
    return (x - mean) * torch.rsqrt(var + 1e-8) * mask


def ppo_experience(
    client: Client, rollout: Rollout, *, temperature: float = 1.0, kl_coef: float = 0.01
) -> Experience:
    mask = rollout.action_mask.float()
    old = openrlhf_log_probs(
        client, rollout.sequences, rollout.attention_mask, rollout.action_mask, temperature=temperature
    ).log_probs
    ref = old.clone()  # the critic issue: `return_ref_logprobs=True` (a reference model on the server)
    values = torch.zeros_like(old)  # the critic issue: `return_values=True` (the critic's value head)
    rewards = token_rewards(rollout.rewards, old, ref, mask, kl_coef)
    advantages, returns = gae(rewards, values, mask, gamma=1.0, lam=0.95)
    return Experience(old_log_probs=old, advantages=whiten(advantages, mask), returns=returns)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--url", default="http://127.0.0.1:8000", help="logprobd base URL (or comma-separated)"
    )
    parser.add_argument("--api-key", default=None)
    args = parser.parse_args(argv)
    with Client(args.url.split(","), api_key=args.api_key) as client:
        client.wait_ready(timeout=600)
        rollout = random_rollout(int(client.info()["vocab_size"]))
        step = ppo_experience(client, rollout)
    mask = rollout.action_mask
    summary = {
        "actions": int(mask.sum()),
        "mean_old_log_prob": float(step.old_log_probs[mask].mean()),
        "mean_return": float(step.returns[mask].mean()),
        "advantage_std": float(step.advantages[mask].std()),
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())

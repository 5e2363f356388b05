"""One PPO-style experience step with logprobd: old log-probs, reference log-probs, KL and critic
values of a rollout in one request, then KL-shaped token rewards and GAE advantages.

    make serve                                   # in another shell: the demo model on :8000
    # or: python -m service serve --model ACTOR --ref-model SFT --critic CRITIC
    python -m examples.ppo_step --url http://127.0.0.1:8000 [--api-key KEY] [--kl-estimator k3]

The rollout is random tokens in OpenRLHF's layout (left-padded prompts, right-padded responses,
`action_mask` [B, L-1] about columns 1..L-1); in a trainer it comes from generation. Everything
comes from logprobd through the OpenRLHF adapter, aligned as OpenRLHF's own forwards give it:
`action_log_probs`, and, when the server was started with them (`/info` lists each model's role),
`base_action_log_probs` and `kl` from `--ref-model` (`return_ref_log_probs=True`) and the critic's
`values` from `--critic` (`return_values=True`), all [B, L-1].

A server without a reference model (a plain `make serve`) scores the reference as the policy
itself (KL = 0); one without a critic gives a zero baseline, so the advantages are plain
discounted returns.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any

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
    """[B, L-1] tensors, 0.0 off the action mask."""

    old_log_probs: torch.Tensor
    ref_log_probs: torch.Tensor  # the server's reference model, or the policy itself
    kl: torch.Tensor  # the server's per-token KL estimate, or 0.0 without a reference model
    values: torch.Tensor  # the server's critic, or 0.0 without one
    advantages: torch.Tensor  # whitened over the actions
    returns: torch.Tensor
    critic: bool  # values came from a critic
    reference: bool  # ref_log_probs and kl came from a reference model
    weights_version: str | None = None  # the policy weights the old log-probs came from


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
    rewards: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, kl_coef: float
) -> torch.Tensor:
    """Per-action reward: -kl_coef * kl everywhere, plus the sequence reward at its last action
    (OpenRLHF's `compute_reward`)."""
    shaped = -kl_coef * kl * mask
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


def model_roles(info: dict[str, Any]) -> set[str]:
    """The roles of the models a server's `/info` lists: `policy`, and `reference` (`--ref-model`) and
    `critic` (`--critic`) when it was started with them."""
    return {str(model["role"]) for model in info.get("models", [])}


def ppo_experience(
    client: Client,
    rollout: Rollout,
    *,
    temperature: float = 1.0,
    kl_coef: float = 0.01,
    kl_estimator: str = "k1",
    roles: set[str] | None = None,
    weights_version: str | None = None,
) -> Experience:
    """Score the rollout in one request and compute GAE; `roles` default to the server's own.
    `weights_version` pins the policy weights that sampled the rollout: old log-probs from any other
    weights would be wrong, so the server answers 409 (LogprobdError) rather than score them."""
    roles = model_roles(client.info()) if roles is None else roles
    mask = rollout.action_mask.float()
    pin: dict[str, Any] = {} if weights_version is None else {"weights_version": weights_version}
    scores = openrlhf_log_probs(
        client,
        rollout.sequences,
        rollout.attention_mask,
        rollout.action_mask,
        temperature=temperature,
        return_values="critic" in roles,
        return_ref_log_probs="reference" in roles,
        kl_estimator=kl_estimator,
        **pin,
    )
    old = scores.log_probs
    if scores.ref_log_probs is not None and scores.kl is not None:
        ref, kl = scores.ref_log_probs, scores.kl
    else:  # no reference model: the policy is its own reference
        ref, kl = old.clone(), torch.zeros_like(old)
    values = scores.values if scores.values is not None else torch.zeros_like(old)
    rewards = token_rewards(rollout.rewards, kl, mask, kl_coef)
    advantages, returns = gae(rewards, values, mask, gamma=1.0, lam=0.95)
    return Experience(
        old_log_probs=old,
        ref_log_probs=ref,
        kl=kl,
        values=values,
        advantages=whiten(advantages, mask),
        returns=returns,
        critic=scores.values is not None,
        reference=scores.ref_log_probs is not None,
        weights_version=scores.weights_version,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--url", default="http://127.0.0.1:8000", help="logprobd base URL (or comma-separated)"
    )
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--kl-estimator", choices=("k1", "k2", "k3"), default="k1")
    parser.add_argument(
        "--weights-version",
        default=None,
        help="pin the policy weights that sampled the rollout (409 if not served)",
    )
    args = parser.parse_args(argv)
    with Client(args.url.split(","), api_key=args.api_key) as client:
        client.wait_ready(timeout=600)
        info = client.info()
        rollout = random_rollout(int(info["vocab_size"]))
        step = ppo_experience(
            client,
            rollout,
            kl_estimator=args.kl_estimator,
            roles=model_roles(info),
            weights_version=args.weights_version,
        )
    mask = rollout.action_mask
    summary = {
        "actions": int(mask.sum()),
        "weights_version": step.weights_version,
        "critic": step.critic,
        "reference": step.reference,
        "mean_old_log_prob": float(step.old_log_probs[mask].mean()),
        "mean_kl": float(step.kl[mask].mean()),
        "mean_value": float(step.values[mask].mean()),
        "mean_return": float(step.returns[mask].mean()),
        "advantage_std": float(step.advantages[mask].std()),
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())

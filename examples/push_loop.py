"""A training loop that pushes its weights to logprobd every step and scores with them, pinned.

    python -m service serve --model MODEL --admin-api-keys ADMIN    # in another shell (or a fleet)
    python -m examples.push_loop --url http://127.0.0.1:8000 --admin-key ADMIN --model MODEL

The trainer loads the checkpoint the replicas serve and pushes it as `step-0`. Each step then takes a
random rollout in OpenRLHF's layout (examples/ppo_step.py), scores it pinned to the version just
pushed (the old log-probs), takes one gradient step of a policy-gradient loss on its own forward
(random rewards, whitened), pushes the new weights as `step-N` (`WeightPusher.push`, returning once
every replica serves them) and scores the rollout again, pinned to `step-N`: those scores equal the
trainer's own forward of the new weights (`max_abs_diff`), and differ from the old ones by what the
step moved (`moved`). One JSON line per step. `--url` may be
given several times (a fleet: one group, ranks 1..n).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch

from examples.ppo_step import Rollout, random_rollout
from service.client import Client, WeightPusher
from service.client.adapters import openrlhf_log_probs


def own_log_probs(model: Any, rollout: Rollout) -> torch.Tensor:
    """OpenRLHF's action log-probs [B, L-1] from the trainer's own forward (with gradients)."""
    mask = rollout.attention_mask
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    logits = model(rollout.sequences, attention_mask=mask, position_ids=positions).logits.float()
    log_probs = torch.log_softmax(logits[:, :-1], dim=-1)
    taken = log_probs.gather(-1, rollout.sequences[:, 1:, None]).squeeze(-1)
    return taken * rollout.action_mask


def train_step(model: Any, optimizer: torch.optim.Optimizer, rollout: Rollout, old: torch.Tensor) -> float:
    """One policy-gradient step: advantages are the whitened rewards, per sequence; the ratio is
    taken against the old (served) log-probs, as PPO's is."""
    advantages = (rollout.rewards - rollout.rewards.mean()) / (rollout.rewards.std() + 1e-8)
    ratio = torch.exp(own_log_probs(model, rollout) - old) * rollout.action_mask
    loss = -(ratio * advantages[:, None]).sum() / rollout.action_mask.sum()
    optimizer.zero_grad()
    loss.backward()  # type: ignore[no-untyped-call]
    optimizer.step()
    return float(loss.detach())


def pinned(client: Client, rollout: Rollout, version: str) -> torch.Tensor:
    scores = openrlhf_log_probs(
        client, rollout.sequences, rollout.attention_mask, rollout.action_mask, weights_version=version
    )
    return scores.log_probs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", action="append", required=True, help="a replica (repeat for a fleet)")
    parser.add_argument("--admin-key", required=True)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--model", required=True, help="the checkpoint the replicas serve")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--backend", choices=("nccl", "gloo"), default=None)
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    vocab = int(model.config.vocab_size)
    with (
        Client(args.url, api_key=args.api_key) as client,
        WeightPusher(args.url, admin_key=args.admin_key, backend=args.backend) as pusher,
    ):
        version = "step-0"
        pusher.push(model, version=version)
        for step in range(1, args.steps + 1):
            rollout = random_rollout(vocab, batch=4, seed=step)
            old = pinned(client, rollout, version)
            loss = train_step(model, optimizer, rollout, old)
            version = f"step-{step}"
            pushed = pusher.push(model, version=version)
            with torch.no_grad():
                mine = own_log_probs(model, rollout)
            served = pinned(client, rollout, version)
            print(json.dumps({
                "step": step, "version": version, "loss": loss, "buckets": pushed.buckets,
                "bytes": pushed.nbytes, "push_seconds": round(pushed.seconds, 4),
                "max_abs_diff": float((served - mine).abs().max()),
                "moved": float((served - old).abs().max()),
            }), flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

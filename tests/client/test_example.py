"""examples/ppo_step.py: its GAE against a hand computation, and a whole step against a server."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from examples import ppo_step
from service.client import Client
from tests.client import frameworks
from tests.client.frameworks import Batch


def test_gae_matches_a_hand_computation() -> None:
    rewards = torch.tensor([[0.0, 1.0, 0.0, 2.0, 0.0]])
    values = torch.tensor([[9.0, 0.5, 0.2, 0.1, 9.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0]])  # the 9.0s are off the mask and must not count
    advantages, returns = ppo_step.gae(rewards, values, mask, gamma=0.9, lam=0.8)
    # A3 = 2 - 0.1 = 1.9; A2 = 0.9*0.1 - 0.2 + 0.72*1.9 = 1.258; A1 = 1 + 0.9*0.2 - 0.5 + 0.72*1.258
    torch.testing.assert_close(advantages[0, 1:4], torch.tensor([1.58576, 1.258, 1.9]))
    torch.testing.assert_close(returns[0, 1:4], torch.tensor([2.08576, 1.458, 2.0]))


def test_token_rewards_put_the_sequence_reward_on_the_last_action() -> None:
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    log_probs = torch.tensor([[0.0, -1.0, -2.0, 0.0], [-1.0, -1.0, -1.0, -1.0]])
    ref = torch.tensor([[0.0, -1.5, -2.0, 0.0], [-1.0, -1.0, -1.0, -3.0]])
    got = ppo_step.token_rewards(torch.tensor([3.0, 5.0]), log_probs, ref, mask, kl_coef=0.1)
    torch.testing.assert_close(got, torch.tensor([[0.0, -0.05, 3.0, 0.0], [0.0, 0.0, 0.0, 4.8]]))


def test_a_step_against_a_server(
    qwen2_replicas: tuple[str, str], reference_models: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    rollout = ppo_step.random_rollout(vocab_size=96, batch=5, seed=3)
    with Client(qwen2_replicas[0]) as client:
        step = ppo_step.ppo_experience(client, rollout)
    batch = Batch(rollout.sequences, rollout.attention_mask, rollout.action_mask, window=0)
    want = frameworks.openrlhf(reference_models["qwen2"], batch, rollout.action_mask, temperature=1.0)
    torch.testing.assert_close(step.old_log_probs, want, atol=1e-4, rtol=0)
    mask = rollout.action_mask
    assert torch.equal(step.advantages[~mask], torch.zeros_like(step.advantages[~mask]))
    assert abs(float(step.advantages[mask].mean())) < 1e-5  # whitened
    assert ppo_step.main(["--url", qwen2_replicas[1]]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["actions"] > 0
    assert summary["mean_old_log_prob"] < 0

"""examples/ppo_step.py: its GAE against a hand computation, and a whole step against a plain server
(fallback: the policy as its own reference, a zero baseline) and against one with a critic and a
reference model (their values, reference log-probs and KL, checked against the per-sequence
reference)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from examples import ppo_step
from service.client import Client, LogprobdError
from tests.support import frameworks
from tests.support.frameworks import Batch
from tests.support.servers import PpoServer, with_critics


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
    got = ppo_step.token_rewards(torch.tensor([3.0, 5.0]), log_probs - ref, mask, kl_coef=0.1)
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
    assert not step.critic
    assert not step.reference
    assert torch.equal(step.ref_log_probs, step.old_log_probs)
    assert not step.kl.any()
    assert not step.values.any()
    assert torch.equal(step.advantages[~mask], torch.zeros_like(step.advantages[~mask]))
    assert abs(float(step.advantages[mask].mean())) < 1e-5  # whitened
    assert ppo_step.main(["--url", qwen2_replicas[1]]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["actions"] > 0
    assert summary["mean_old_log_prob"] < 0
    assert (summary["critic"], summary["reference"]) == (False, False)
    assert summary["weights_version"] == "initial"
    assert ppo_step.main(["--url", qwen2_replicas[1], "--weights-version", "initial"]) == 0
    assert json.loads(capsys.readouterr().out)["weights_version"] == "initial"
    with pytest.raises(LogprobdError) as stale:  # old log-probs from other weights: refused
        ppo_step.main(["--url", qwen2_replicas[1], "--weights-version", "step-3"])
    assert (stale.value.status, stale.value.type) == (409, "weights_version_mismatch")


@with_critics("openrlhf")
def test_a_step_against_a_server_with_a_critic_and_a_reference(
    ppo_server: PpoServer,
    reference_models: dict[str, Any],
    ref_model: Any,
    capsys: pytest.CaptureFixture[str],
) -> None:
    rollout = ppo_step.random_rollout(vocab_size=96, batch=5, seed=4)
    with Client(ppo_server.url) as client:
        step = ppo_step.ppo_experience(client, rollout, kl_coef=0.5, kl_estimator="k3")
    assert step.critic
    assert step.reference
    mask = rollout.action_mask
    batch = Batch(rollout.sequences, rollout.attention_mask, mask, window=0)
    want = frameworks.by_column(batch, reference_models["qwen2"], ref_model, ppo_server.critic_dir, 1.0)
    lp, ref, values = (t[:, 1:] * mask for t in (want.log_probs, want.ref_log_probs, want.values))
    for got, expected in ((step.old_log_probs, lp), (step.ref_log_probs, ref), (step.values, values)):
        torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(step.kl.double(), frameworks.kl(lp, ref, "k3") * mask, atol=1e-4, rtol=0)
    assert values[mask].abs().min() > 0  # a real baseline, not the fallback's zeros
    # the advantages are GAE of the KL-shaped rewards over these values
    m = mask.float()
    rewards = ppo_step.token_rewards(rollout.rewards, frameworks.kl(lp, ref, "k3").float(), m, kl_coef=0.5)
    advantages, returns = ppo_step.gae(rewards, values.float(), m, gamma=1.0, lam=0.95)
    torch.testing.assert_close(step.returns, returns, atol=1e-4, rtol=0)
    torch.testing.assert_close(step.advantages, ppo_step.whiten(advantages, m), atol=1e-3, rtol=0)

    assert ppo_step.main(["--url", ppo_server.url, "--kl-estimator", "k2"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["critic"], summary["reference"]) == (True, True)
    assert summary["mean_kl"] > 0  # k2 = r²/2 of a reference with other weights

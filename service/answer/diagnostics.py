"""KL estimators and training-inference mismatch statistics, over action tokens (numpy, float64)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from service.core.jobs import FloatArray
from service.wire.schemas import RolloutMismatch

LN2 = float(np.log(2.0))


def kl(logprobs: FloatArray, base: FloatArray, estimator: str) -> FloatArray:
    """Per-token KL estimate of the policy against `base` (Schulman's k1, k2, k3), r = logp - base."""
    r = logprobs.astype(np.float64) - base.astype(np.float64)
    if estimator == "k1":
        out = r
    elif estimator == "k2":
        out = 0.5 * r * r
    elif estimator == "k3":
        out = np.expm1(-r) + r
    else:
        raise ValueError(f"unknown KL estimator {estimator!r}")
    return out.astype(np.float32)


def rollout_mismatch(logprobs: Sequence[FloatArray], rollout: Sequence[FloatArray]) -> RolloutMismatch:
    """How far the scores are from what the inference engine reported, over all action tokens.

    The rollout sampled the tokens, so the k3 estimate is of KL(rollout || policy): exp(d) - 1 - d.
    """
    d = np.concatenate([np.zeros(0), *logprobs]) - np.concatenate([np.zeros(0), *rollout])  # float64
    if d.size == 0:
        return RolloutMismatch(
            tokens=0, mean_abs_diff=0.0, max_abs_diff=0.0, mean_kl_k3=0.0, ratio_outside_fraction=0.0
        )
    return RolloutMismatch(
        tokens=int(d.size),
        mean_abs_diff=float(np.abs(d).mean()),
        max_abs_diff=float(np.abs(d).max()),
        mean_kl_k3=float((np.expm1(d) - d).mean()),  # KL(rollout || policy): the rollout sampled them
        ratio_outside_fraction=float((np.abs(d) > LN2).mean()),
    )


def rollout_statistics(
    logprobs: Sequence[FloatArray],
    rollout: Sequence[FloatArray] | None,
    processed: Sequence[FloatArray] | None,
) -> RolloutMismatch | None:
    """The response's `rollout`: the mismatch against `rollout` log-probs where given, and the share
    of action tokens outside the sampler's kept set (processed log-prob -inf) where `processed` is."""
    if rollout is None and processed is None:
        return None
    stats = (
        rollout_mismatch(logprobs, rollout)
        if rollout is not None
        else RolloutMismatch(tokens=sum(int(lp.shape[0]) for lp in logprobs))
    )
    if processed is not None:
        every = np.concatenate([np.zeros(0, dtype=np.float32), *processed])
        stats.outside_kept_fraction = float(np.isneginf(every).mean()) if every.size else 0.0
    return stats

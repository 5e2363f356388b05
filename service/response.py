"""Per-sequence scores -> the request's layout: one row per request row, aligned to its window."""

from __future__ import annotations

import numpy as np
import orjson

from service.jobs import SequenceScores
from service.normalise import ScoringPlan


def render(plan: ScoringPlan, scores: list[SequenceScores], model: str) -> bytes:
    """JSON body of a LogprobsResponse. Non-action entries of a window are exactly 0.0."""
    want_entropy = any(job.return_entropy for job in plan.jobs)
    logprobs, entropy, masks = [], [], []
    for window, score in zip(plan.windows, scores, strict=True):
        row = np.zeros(window.width, dtype=np.float32)
        row[window.slots] = score.logprobs
        logprobs.append(row)
        mask = np.zeros(window.width, dtype=np.int8)
        mask[window.slots] = 1
        masks.append(mask)
        if want_entropy:
            ent = np.zeros(window.width, dtype=np.float32)
            if score.entropy is not None:
                ent[window.slots] = score.entropy
            entropy.append(ent)
    body = {
        "model": model,
        "logprobs": logprobs,
        "entropy": entropy if want_entropy else None,
        "action_mask": masks,
        "usage": {"input_tokens": plan.input_tokens, "scored_tokens": plan.scored_tokens},
    }
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)

"""The float64 reference of docs/semantics.md, 'Beyond the log-prob', written independently of the
service: a full softmax of one position's logits in numpy, an explicit sort and explicit truncation.

vLLM v1's sampler defines the order (vllm/v1/sample/sampler.py: temperature, then the min-p
processor, then ops/topk_topp_sampler.py's top-k and top-p); ties are broken by the lower id.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Position:
    top_ids: np.ndarray  # [K]
    top_logprobs: np.ndarray  # [K]
    rank: int
    candidates: np.ndarray  # [C]
    processed: float


def logprobs(logits: np.ndarray, temperature: float) -> np.ndarray:
    """float64 log_softmax(logits / T) of one position [V]."""
    z = np.asarray(logits, dtype=np.float64) / temperature
    z = z - z.max()
    out: np.ndarray = z - np.log(np.exp(z).sum())
    return out


def order(logp: np.ndarray) -> np.ndarray:
    """Token ids, most likely first, equal log-probs by the lower id (a stable sort of -logp)."""
    out: np.ndarray = np.argsort(-logp, kind="stable")
    return out


def kept_set(logp: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """[V] bool: the tokens vLLM's sampler can draw, after min-p, top-k (ties at the k-th kept),
    top-p over what is left (a token stays while the more likely survivors hold less than p)."""
    p = np.exp(logp)
    keep: np.ndarray = p >= min_p * p.max()
    vocab = logp.shape[0]
    if 0 < top_k < vocab:
        kth = np.sort(logp)[::-1][top_k - 1]
        keep &= logp >= kth
    if top_p < 1.0:
        mass = p[keep].sum()
        before = 0.0
        chosen = np.zeros_like(keep)
        for token in order(logp):
            if not keep[token]:
                continue
            if before >= top_p * mass:
                break
            chosen[token] = True
            before += p[token]
        keep = chosen
    return keep


def position(
    logits: np.ndarray,
    target: int,
    *,
    temperature: float = 1.0,
    top: int = 0,
    candidates: list[int] | None = None,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> Position:
    logp = logprobs(logits, temperature)
    ids = order(logp)[:top]
    keep = kept_set(logp, top_k, top_p, min_p)
    processed = logp[target] - np.log(np.exp(logp[keep]).sum()) if keep[target] else -np.inf
    return Position(
        top_ids=ids,
        top_logprobs=logp[ids],
        rank=int((logp >= logp[target]).sum()),
        candidates=logp[np.asarray(candidates or [], dtype=np.int64)],
        processed=float(processed),
    )

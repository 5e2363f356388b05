"""The head's scores from a vocabulary-parallel lm_head (parallel/vocab_layers.py's VocabParallelHead):
each rank holds rows [start, end) of the vocabulary, and the head never gathers logits.

Per chunk of action rows each rank computes its [c, V/N] logits z (float32, after the logit transform
and 1 / T) and three statistics per row, relative to the row's global max m (one all-reduce MAX):

    s = Σ exp(z - m)              t = Σ exp(z - m)·(z - m)          x = z[target] (0 off this rank)

summed over the ranks in ONE all-reduce of [c, 3]. Then, as in heads/chunked.py's unsharded softmax:

    log p(target) = (x - m) - log S          entropy = log S - T / S

(S, T the sums; entropy = -Σ p log p with log p = (z - m) - log S).

Rows that ask more (Extras) get it from each rank's z - m and log S (heads/extras.py with a Join
of the ranks: the top K merged from every rank's top K, sums and maxima all-reduced).
"""

from __future__ import annotations

import torch

from service.engine.batch.asks import Extras
from service.engine.heads import extras as extra
from service.engine.heads.base import ActionScores, ExtraScores, LogitTransform
from service.engine.parallel.vocab_layers import VocabParallelHead


def score_actions(
    *,
    hidden: torch.Tensor,  # [A, H] final hidden state at t-1 for each action t (the same on every rank)
    targets: torch.Tensor,  # [A] token ids of the whole vocabulary
    inv_temperature: torch.Tensor | None,  # [A]; None: every T is 1
    lm_head: torch.nn.Module,
    transform: LogitTransform,
    chunk_rows: int,
    want_entropy: bool,
    fused: bool | None = None,  # the signature of head.score_actions; always the torch path here
    extras: Extras | None = None,
) -> ActionScores:
    """head.score_actions over a VocabParallelHead: the same scores, on every rank, from its rows."""
    assert isinstance(lm_head, VocabParallelHead)
    start, width, shard = lm_head.start, lm_head.out_features, lm_head.shard
    rows = hidden.shape[0]
    logprobs = torch.empty(rows, dtype=torch.float32, device=hidden.device)
    entropy = torch.empty_like(logprobs) if want_entropy else None
    join = extra.Join(start, lm_head.vocab_size, shard)
    parts: list[ExtraScores] = []
    for begin in range(0, rows, chunk_rows):
        end = min(begin + chunk_rows, rows)
        z = transform(lm_head(hidden[begin:end]).float())  # [c, V/N] float32
        if inv_temperature is not None:
            z.mul_(inv_temperature[begin:end, None])
        local = targets[begin:end] - start
        mine = (local >= 0) & (local < width)
        m = z.amax(dim=-1)  # [c]
        shard.all_reduce_max_(m)
        z.sub_(m[:, None])  # z - m, in place
        p = torch.exp(z)
        stats = torch.stack(
            (
                p.sum(dim=-1),
                (p * z).sum(dim=-1) if entropy is not None else torch.zeros_like(m),
                z.gather(1, local.clamp(0, width - 1)[:, None]).squeeze(1).masked_fill(~mine, 0.0),
            ),
            dim=1,
        )  # [c, 3]: s, t, x - m
        del p
        shard.all_reduce_(stats)
        log_total = torch.log(stats[:, 0])
        if extras is not None:
            for asks, picked in extra.passes(extras, begin, end, lm_head.vocab_size):
                parts.append(extra.score(z[picked], log_total[picked], targets[asks.index], asks, join))
        del z
        logprobs[begin:end] = stats[:, 2] - log_total
        if entropy is not None:
            entropy[begin:end] = log_total - stats[:, 1] / stats[:, 0]
    return ActionScores(logprobs=logprobs, entropy=entropy, extras=extra.cat(parts) if parts else None)

"""The two ways trainers score today, for comparison: both on a padded batch of 8 rows.

naive: `attention_mask`, full [rows, L, vocab] logits, float32 log_softmax over all of them.
trl:   left-padded prompt + right-padded response, `logits_to_keep`, log-softmax one row at a time.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from benchmarks.workload import Sample

ROWS = 8


def _batches(samples: list[Sample], rows: int = ROWS) -> list[list[Sample]]:
    return [samples[i : i + rows] for i in range(0, len(samples), rows)]


@torch.inference_mode()
def naive(model: Any, samples: list[Sample], device: torch.device, rows: int = ROWS) -> list[np.ndarray]:
    out: list[np.ndarray] = []
    for batch in _batches(samples, rows):
        width = max(len(s.tokens) for s in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, s in enumerate(batch):  # right padding: position ids 0..L-1 are right
            ids[i, : len(s.tokens)] = torch.tensor(s.tokens)
            mask[i, : len(s.tokens)] = 1
        ids, mask = ids.to(device), mask.to(device)
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits  # [B, L, V]
        logp = torch.log_softmax(logits.float(), dim=-1)  # [B, L, V] float32
        per_token = logp[:, :-1].gather(2, ids[:, 1:, None])[..., 0]  # [B, L-1]
        for i, s in enumerate(batch):
            start = len(s.prompt) - 1
            out.append(per_token[i, start : start + len(s.response)].cpu().numpy())
    return out


@torch.inference_mode()
def trl(model: Any, samples: list[Sample], device: torch.device) -> list[np.ndarray]:
    out: list[np.ndarray] = []
    for batch in _batches(samples):
        p_width = max(len(s.prompt) for s in batch)
        c_width = max(len(s.response) for s in batch)
        ids = torch.zeros(len(batch), p_width + c_width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, s in enumerate(batch):
            left = p_width - len(s.prompt)
            ids[i, left : p_width + len(s.response)] = torch.tensor(s.tokens)
            mask[i, left : p_width + len(s.response)] = 1
        ids, mask = ids.to(device), mask.to(device)
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=c_width + 1).logits
        logits = logits[:, :-1]  # [B, C, V]: position p_width-1+k predicts completion token k
        completion = ids[:, p_width:]
        rows = [
            torch.log_softmax(row.float(), dim=-1).gather(1, tok[:, None])[:, 0]
            for row, tok in zip(logits, completion, strict=True)
        ]
        for i, s in enumerate(batch):
            out.append(rows[i][: len(s.response)].cpu().numpy())
    return out

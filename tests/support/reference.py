"""The per-sequence reference of docs/semantics.md, written independently of the service.

For each request row: find its real tokens and action window by direct reading of the layout
table, run the model's own forward (eager attention, float32) on the unpadded sequence alone, and
fill the window with log_softmax(logits[t-1] / T)[x_t] for every action t.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tests.support.device import TOLERANCE


@dataclass
class Expected:
    logprobs: list[list[float]]
    entropy: list[list[float]]
    action_mask: list[list[int]]


def row_tokens_and_window(request: dict[str, Any], i: int) -> tuple[list[int], list[int | None]]:
    """Real tokens of row i, and for each window entry the position it refers to (None: padding)."""
    ids = request["input_ids"][i]
    if "attention_mask" not in request:
        length = len(ids)
        if "num_actions" in request:
            n = request["num_actions"]
            n = n if isinstance(n, int) else n[i]
            return list(ids), list(range(length - n, length))
        return list(ids), list(range(1, length))
    mask = request["attention_mask"][i]
    tokens, positions, p = [], [], 0
    for token, m in zip(ids, mask, strict=True):
        positions.append(p if m else None)
        if m:
            tokens.append(token)
            p += 1
    first = 1 if "action_mask" in request else len(ids) - request["response_length"]
    return tokens, positions[first:]


def _is_action(request: dict[str, Any], i: int, k: int, position: int | None) -> bool:
    if position is None:
        return False
    if "action_mask" in request:
        return bool(request["action_mask"][i][k + 1 if "attention_mask" not in request else k])
    return True


def expected(model: Any, request: dict[str, Any]) -> Expected:
    temperature = request.get("temperature", 1.0)
    eos = request.get("eos_token_id")
    eos_set = set([eos] if isinstance(eos, int) else eos or [])
    out = Expected([], [], [])
    for i in range(len(request["input_ids"])):
        tokens, window = row_tokens_and_window(request, i)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([tokens], device=model.device)).logits[0].double()  # [L, V]
        logp = torch.log_softmax(logits / temperature, dim=-1)
        lp_row, ent_row, mask_row = [0.0] * len(window), [0.0] * len(window), [0] * len(window)
        ended = False
        for k, position in enumerate(window):
            if ended or not _is_action(request, i, k, position):
                continue
            assert position is not None
            assert position >= 1
            lp_row[k] = float(logp[position - 1, tokens[position]])
            ent_row[k] = float(-(logp[position - 1].exp() * logp[position - 1]).sum())
            mask_row[k] = 1
            ended = tokens[position] in eos_set
        out.logprobs.append(lp_row)
        out.entropy.append(ent_row)
        out.action_mask.append(mask_row)
    return out


def reference_routes(model: Any, request: dict[str, Any]) -> list[list[Any]]:
    """Each row's `routed_experts` as the reference's own routers choose them on its unpadded sequence
    alone ([L, sparse layers, top_k], transformers' TopKRouter outputs in layer order), laid out as the
    request's rows: per position of a ragged row, per column of a padded one (padding columns: experts
    0 .. k-1, which the service ignores)."""
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    out = []
    for i in range(len(request["input_ids"])):
        tokens, _ = row_tokens_and_window(request, i)
        chosen: list[torch.Tensor] = []

        def keep(_module: Any, _args: Any, output: Any, into: list[torch.Tensor] = chosen) -> None:
            into.append(output[2].detach().cpu())  # (logits, weights, ids)

        hooks = [r.register_forward_hook(keep) for r in routers]
        try:
            with torch.no_grad():
                model(input_ids=torch.tensor([tokens], device=model.device))
        finally:
            for hook in hooks:
                hook.remove()
        routes = torch.stack(chosen, dim=1)  # [L, layers, k]
        if "attention_mask" in request:
            mask = torch.tensor(request["attention_mask"][i], dtype=torch.bool)
            columns = torch.arange(routes.shape[-1]).expand(mask.shape[0], *routes.shape[1:]).clone()
            columns[mask] = routes
            routes = columns
        out.append(routes.tolist())
    return out


def mean_diff(got: list[list[float]], want: list[list[float]], mask: list[list[int]]) -> float:
    """The mean |got - want| over the actions (mask 1) of ragged rows."""
    diffs = [
        abs(g - w)
        for gr, wr, mr in zip(got, want, mask, strict=True)
        for g, w, m in zip(gr, wr, mr, strict=True)
        if m
    ]
    return sum(diffs) / len(diffs) if diffs else 0.0


def max_diff(got: list[list[float]], want: list[list[float]]) -> float:
    """The largest |got - want| over ragged rows of equal lengths (0.0 for none)."""
    assert len(got) == len(want)
    worst = 0.0
    for g, w in zip(got, want, strict=True):
        assert len(g) == len(w)
        if g:
            worst = max(worst, float(np.max(np.abs(np.asarray(g) - np.asarray(w)))))
    return worst


def assert_values_close(got: list[list[float]], want: list[list[float]], atol: float, rtol: float) -> None:
    """Critic values row by row: |got - want| <= atol + rtol·max|want| of the row (ragged rows of
    equal lengths): a half precision rounds each value on the scale of the row's hidden states, so a
    value near 0 beside values near 10 carries their rounding."""
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        want_row = np.asarray(w, dtype=np.float64)
        scale = float(np.abs(want_row).max()) if want_row.size else 0.0
        np.testing.assert_allclose(
            np.asarray(g, dtype=np.float64), want_row, atol=atol + rtol * scale, rtol=0
        )


def check_reply(reply: Any, request: dict[str, Any], model: Any, tolerance: float | None = None) -> float:
    """A 200 reply whose scores equal the reference within `tolerance` (the suite's by default), with
    the action mask, exact zeros off it and scored_tokens; returns the largest |Δ| of log-probs and
    entropy."""
    tolerance = TOLERANCE if tolerance is None else tolerance
    assert reply.status_code == 200, reply.text
    body = reply.json()
    want = expected(model, request)
    assert body["action_mask"] == want.action_mask
    diff = max_diff(body["logprobs"], want.logprobs)
    if request.get("return_entropy"):
        diff = max(diff, max_diff(body["entropy"], want.entropy))
    else:
        assert body["entropy"] is None
    for row, mask in zip(body["logprobs"], body["action_mask"], strict=True):
        assert all(v == 0.0 for v, m in zip(row, mask, strict=True) if not m)
    assert body["usage"]["scored_tokens"] == sum(map(sum, want.action_mask))
    assert diff <= tolerance, f"max |Δ| {diff:.3g} > {tolerance}"
    return diff


def assert_scores(model: Any, request: dict[str, Any], logprobs: list[list[float]]) -> None:
    """`logprobs` are the reference's for `request` on `model`, within TOLERANCE."""
    want = expected(model, request).logprobs
    assert len(logprobs) == len(want)
    for got_row, want_row in zip(logprobs, want, strict=True):
        np.testing.assert_allclose(got_row, want_row, atol=TOLERANCE, rtol=0)

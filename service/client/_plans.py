"""Tensors in, request bodies out, and responses back to tensors: the layout work of the adapters.

One `Plan` per framework call: the padded-layout body of docs/semantics.md built from the framework's
tensors, and which columns of the server's action window the framework's output keeps. Every
per-token output (log-probs, entropy, values, reference log-probs, KL) is a row of that same window,
so one slice aligns them all.

Rows whose prompts (the real tokens before the response columns) are the same go out grouped: each
prompt once in `prompt_ids`, the response columns as the rows (docs/api.md, 'Grouped requests').
The server scores the same sequences and actions either way; only the window is narrower (the
responses), and columns before it hold no action.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from typing import Any

import torch

from service.client._async import AsyncClient
from service.client._sync import Client
from service.client.errors import LogprobdError
from service.client.wire import RolloutStats, RouteAgreementStats, Scores, group_prompts

KL_ESTIMATORS = ("k1", "k2", "k3")

# request fields an adapter fills from its own arguments; in `**options` they would contradict them
_OWN_FIELDS = {
    "input_ids": "the adapter's token tensor",
    "action_mask": "the adapter's layout arguments",
    "num_actions": "the adapter's layout arguments",
    "response_length": "the adapter's layout arguments",
    "prompt_ids": "grouped=True (the default: rows that share a prompt are grouped)",
    "prompt_index": "grouped=True (the default: rows that share a prompt are grouped)",
    "return_ref_logprobs": "return_ref_log_probs=True",
    "rollout_logprobs": "rollout_log_probs=, a tensor shaped like the output",
    "routed_experts": "routed_experts=, verl's [B, L, layers, top_k] tensor",
    "prompt_routed_experts": "routed_experts=, verl's [B, L, layers, top_k] tensor",
    "return_routed_experts": "return_routed_experts=True",
}


@dataclass(frozen=True, slots=True)
class TensorScores:
    """Float32 tensors `[B, W]` on the caller's device, aligned as the framework aligns its output.

    Every tensor has the shape and alignment of `log_probs` and is exactly 0.0 where `action_mask`
    is False; the optional ones are None unless the call asked for them.
    """

    log_probs: torch.Tensor
    entropy: torch.Tensor | None  # when asked for, else None
    action_mask: torch.Tensor  # bool: the entries the server scored
    values: torch.Tensor | None = None  # the critic's head(h_{t-1}) for action t (`return_values`)
    ref_log_probs: torch.Tensor | None = None  # the reference model's log-probs (`return_ref_log_probs`)
    kl: torch.Tensor | None = None  # per-token KL estimate of `kl_estimator` (`return_ref_log_probs`)
    rollout: RolloutStats | None = None  # mismatch statistics (when `rollout_log_probs` was given)
    weights_version: str | None = None  # the policy weights that produced every score
    # verl's layout, [B, L, layers, top_k] like `input_ids`, 0 at padding (`return_routed_experts`)
    routed_experts: torch.Tensor | None = None
    route_agreement: RouteAgreementStats | None = None  # when routes were given


@dataclass(frozen=True, slots=True)
class Asked:
    """What a call asks for beyond the log-probs."""

    entropy: bool = False
    values: bool = False
    ref_log_probs: bool = False
    kl_estimator: str = "k1"
    rollout_log_probs: torch.Tensor | None = None  # shaped like the framework's output
    routed_experts: torch.Tensor | None = None  # verl: [B, L, layers, top_k] like input_ids
    return_routed_experts: bool = False

    def __post_init__(self) -> None:
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(
                f"kl_estimator must be one of {', '.join(KL_ESTIMATORS)} (verl's low_var_kl is k3, "
                f"its kl k1, its mse k2), got {self.kl_estimator!r}"
            )


@dataclass(frozen=True, slots=True)
class Plan:
    """A request body, and how to turn its response into the framework's tensors."""

    body: dict[str, Any]
    keep: int  # the framework's output is the last `keep` columns of the server's window
    device: torch.device
    asked: Asked
    entropy_body: dict[str, Any] | None = None  # entropy asked at another temperature (OpenRLHF)
    attention_mask: torch.Tensor | None = None  # [B, L] on the CPU: where recorded routes go back

    def run(self, client: Client) -> TensorScores:
        entropy = None if self.entropy_body is None else client.score_request(self.entropy_body)
        return self.finish(client.score_request(self.body), entropy)

    async def run_async(self, client: AsyncClient) -> TensorScores:
        if self.entropy_body is None:
            return self.finish(await client.score_request(self.body), None)
        scores, entropy = await asyncio.gather(
            client.score_request(self.body), client.score_request(self.entropy_body)
        )
        return self.finish(scores, entropy)

    def finish(self, scores: Scores, entropy_scores: Scores | None) -> TensorScores:
        def tensor(rows: list[list[float]] | list[list[int]], dtype: torch.dtype) -> torch.Tensor:
            full = torch.tensor(rows, dtype=dtype)  # [B, W]
            if full.shape[1] < self.keep:  # a grouped window (the responses): no action before it
                wide = torch.zeros(full.shape[0], self.keep, dtype=dtype)
                wide[:, self.keep - full.shape[1] :] = full
                full = wide
            return full[:, full.shape[1] - self.keep :].to(self.device)

        def returned(name: str, asked: bool) -> Any:
            if not asked:
                return None
            value = scores.extra.get(name)
            if value is None:
                raise LogprobdError(
                    f"the request asked for `{name}` and the response has none",
                    status=None,
                    error_type="bad_response",
                )
            return value

        entropy = (entropy_scores or scores).entropy
        values = returned("values", self.asked.values)
        ref_log_probs = returned("ref_logprobs", self.asked.ref_log_probs)
        kl = returned("kl", self.asked.ref_log_probs)
        rollout = returned("rollout", self.asked.rollout_log_probs is not None)
        return TensorScores(
            log_probs=tensor(scores.logprobs, torch.float32),
            entropy=None if entropy is None else tensor(entropy, torch.float32),
            action_mask=tensor(scores.action_mask, torch.bool),
            values=None if values is None else tensor(values, torch.float32),
            ref_log_probs=None if ref_log_probs is None else tensor(ref_log_probs, torch.float32),
            kl=None if kl is None else tensor(kl, torch.float32),
            rollout=None if rollout is None else RolloutStats.from_body(rollout),
            weights_version=scores.weights_version,
            routed_experts=self._routes(scores) if self.asked.return_routed_experts else None,
            route_agreement=scores.route_agreement,
        )

    def _routes(self, scores: Scores) -> torch.Tensor:
        """The recorded routes laid out as verl lays `routed_experts`: [B, L, layers, top_k], each
        real column its token's experts, 0 at padding."""
        rows, moe = scores.routed_experts, scores.extra.get("moe")
        if rows is None or moe is None or self.attention_mask is None:
            raise LogprobdError(
                "the request asked for `routed_experts` and the response has none",
                status=None,
                error_type="bad_response",
            )
        batch, length = self.attention_mask.shape
        dtype = torch.int16 if int(moe["experts"]) <= 32767 else torch.int32
        out = torch.zeros(batch, length, int(moe["layers"]), int(moe["top_k"]), dtype=dtype)
        for i, row in enumerate(rows):
            recorded = torch.from_numpy(row).to(dtype)
            if recorded.shape[0] == length:  # a padded answer: per column already
                out[i] = recorded
            else:  # a grouped answer: per position of the sequence
                out[i, self.attention_mask[i].nonzero().flatten()] = recorded
        return out.to(self.device)


def openrlhf_plan(
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    temperature: float,
    asked: Asked,
    options: dict[str, Any],
    grouped: bool = True,
    tempered_entropy: bool = True,
) -> Plan:
    """`tempered_entropy`: the entropy of `logits / T` (OpenRLHF >= 0.11.1), else of the raw logits
    (OpenRLHF <= 0.11.0), which at T != 1 takes a second request at T = 1 that asks for nothing else."""
    batch, length = _check_padded(sequences, attention_mask)
    if action_mask.dim() != 2 or action_mask.shape[0] != batch or not 0 <= action_mask.shape[1] < length:
        raise ValueError(
            f"action_mask must be [B, A] with A <= L-1 = {length - 1}, got {list(action_mask.shape)}"
        )
    actions = action_mask.shape[1]
    mask = action_mask.detach().cpu().bool()
    window = torch.zeros(batch, length - 1, dtype=torch.int64)  # [B, L-1]: column j+1 is an action
    window[:, length - 1 - actions :] = mask.to(torch.int64)
    # the response starts at the first column any row marks: its prompt is what comes before
    marked = window.any(dim=0).nonzero()
    groups = _groups(sequences, attention_mask, int(marked[0]) + 1) if grouped and marked.numel() else None
    sent = window if groups is None else window[:, groups.start - 1 :]  # column j+1 -> entry j
    separate = asked.entropy and not tempered_entropy and temperature != 1.0
    main = replace(asked, entropy=asked.entropy and not separate)
    body = _body(
        sequences, attention_mask, temperature=temperature, asked=main, options=options, groups=groups
    )
    body["action_mask"] = sent.tolist()
    if asked.rollout_log_probs is not None:
        rollout = torch.zeros(batch, length - 1, dtype=torch.float32)
        rollout[:, length - 1 - actions :] = _rollout(asked.rollout_log_probs, mask, "action_mask")
        body["rollout_logprobs"] = rollout[:, length - 1 - sent.shape[1] :].tolist()
    entropy_body = None
    if separate:
        entropy_body = _body(
            sequences,
            attention_mask,
            temperature=1.0,
            asked=Asked(entropy=True),
            options=options,
            groups=groups,
        )
        entropy_body["action_mask"] = body["action_mask"]
    return Plan(body=body, keep=actions, device=sequences.device, asked=asked, entropy_body=entropy_body)


def verl_plan(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    responses: torch.Tensor,
    *,
    temperature: float,
    asked: Asked,
    options: dict[str, Any],
    grouped: bool = True,
) -> Plan:
    batch, length = _check_padded(input_ids, attention_mask)
    r = responses.shape[-1]
    if responses.dim() != 2 or responses.shape[0] != batch or r >= length:
        raise ValueError(f"responses must be [B, R] with R < {length}, got {list(responses.shape)}")
    if not torch.equal(input_ids[:, length - r :].cpu(), responses.cpu()):
        raise ValueError("responses must be the last R columns of input_ids, as verl lays them out")
    return _last_columns_plan(
        input_ids,
        attention_mask,
        r,
        temperature=temperature,
        asked=asked,
        options=options,
        named="responses",
        grouped=grouped,
    )


def trl_plan(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    *,
    temperature: float,
    asked: Asked,
    options: dict[str, Any],
    grouped: bool = True,
) -> Plan:
    _, length = _check_padded(input_ids, attention_mask)
    if not 0 <= logits_to_keep < length:
        raise ValueError(f"logits_to_keep must be in [0, {length}), got {logits_to_keep}")
    c = int(logits_to_keep)
    return _last_columns_plan(
        input_ids,
        attention_mask,
        c,
        temperature=temperature,
        asked=asked,
        options=options,
        named="logits_to_keep",
        grouped=grouped,
    )


def _last_columns_plan(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    r: int,
    *,
    temperature: float,
    asked: Asked,
    options: dict[str, Any],
    named: str,
    grouped: bool,
) -> Plan:
    """verl and TRL: the window is the last `r` columns, and so is the framework's output; grouped,
    the window is the same columns, sent as the responses."""
    routes = asked.routed_experts
    recorded = _recorded(routes, attention_mask, r) if routes is not None else None
    start = input_ids.shape[1] - r
    groups = _groups(input_ids, attention_mask, start, recorded) if grouped else None
    body = _body(
        input_ids, attention_mask, temperature=temperature, asked=asked, options=options, groups=groups
    )
    if groups is None:
        body["response_length"] = r
    if recorded is not None:
        body.update(_route_fields(recorded, groups))
    if asked.rollout_log_probs is not None:
        real = attention_mask.detach().cpu()[:, attention_mask.shape[1] - r :].bool()
        body["rollout_logprobs"] = _rollout(asked.rollout_log_probs, real, named).tolist()
    mask = attention_mask.detach().cpu()
    return Plan(body=body, keep=r, device=input_ids.device, asked=asked, attention_mask=mask)


def _rollout(rollout: torch.Tensor, mask: torch.Tensor, named: str) -> torch.Tensor:
    """The caller's rollout log-probs on the CPU, float32; entries off `mask` (never actions) are
    sent as 0.0, so padding filled with NaN or -inf does not make the request invalid."""
    if rollout.shape != mask.shape:
        raise ValueError(
            f"rollout_log_probs must be shaped like the output, {list(mask.shape)} (from {named}), "
            f"got {list(rollout.shape)}"
        )
    values = rollout.detach().cpu().to(torch.float32)
    return torch.where(mask, values, torch.zeros_like(values))


def _check_padded(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[int, int]:
    if input_ids.dim() != 2 or input_ids.shape != attention_mask.shape:
        raise ValueError(
            f"input ids and attention_mask must both be [B, L], got {list(input_ids.shape)} and "
            f"{list(attention_mask.shape)}"
        )
    return int(input_ids.shape[0]), int(input_ids.shape[1])


@dataclass(frozen=True, slots=True)
class _Groups:
    """Rows whose prompts (the real tokens of columns < start) repeat: each prompt once."""

    start: int  # the first response column
    prompt_ids: list[list[int]]
    prompt_index: list[int]  # per row


def _groups(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, start: int, routes: _Recorded | None = None
) -> _Groups | None:
    """The prompts before column `start`, compared token for token (and, with routes, expert for
    expert: rows the rollout routed differently over the same prompt are not merged); None when no
    prompt repeats, a row's prompt is empty or the mask is not 0/1 (the full rows go, and the server
    names any fault)."""
    mask = attention_mask.detach().cpu()
    if start < 1 or not bool(((mask == 0) | (mask == 1)).all()):
        return None
    ids, real = input_ids.detach().cpu()[:, :start].tolist(), mask[:, :start].tolist()
    prompts = [
        [t for t, m in zip(row, marks, strict=True) if m] for row, marks in zip(ids, real, strict=True)
    ]
    if not all(prompts):
        return None
    keys = prompts
    if routes is not None:  # the prompt's routes join its key (-1 keeps ids and routes apart)
        keys = [[*prompt, -1, *routes.prompt_key(i, len(prompt))] for i, prompt in enumerate(prompts)]
    _, prompt_index = group_prompts(keys)
    firsts = list(dict.fromkeys(prompt_index))
    first_row = {p: prompt_index.index(p) for p in firsts}
    prompt_ids = [prompts[first_row[p]] for p in range(len(firsts))]
    return _Groups(start, prompt_ids, prompt_index) if len(prompt_ids) < len(prompts) else None


@dataclass(frozen=True, slots=True)
class _Recorded:
    """verl's `routed_experts` [B, L, layers, top_k] read per row: the experts of each real token
    the rollout recorded, in order (`per_row[i]` [n_i, layers, top_k]); None for a row with none."""

    per_row: list[Any]  # numpy int arrays or None
    columns: list[Any]  # per row: verl's columns 0 .. its last recorded column, [c+1, layers, top_k]

    def prompt_key(self, i: int, prompt_length: int) -> list[int]:
        row = self.per_row[i]
        return [] if row is None else row[:prompt_length].ravel().tolist()


def _recorded(routes: torch.Tensor, attention_mask: torch.Tensor, response: int) -> _Recorded:
    """Each row's routes over the tokens verl replays: every real token but the last of a row with a
    response, none of a row without (verl's `build_r3_replay_mask`, utils/megatron/
    router_replay_utils.py: the final token was never forwarded by the rollout, and its slot holds
    the zeros `agent_loop.py` fills around `routed_experts[:, start_pos:end_pos]`). The last `response`
    columns are the response."""
    if routes.dim() != 4 or routes.shape[:2] != attention_mask.shape:
        raise ValueError(
            f"routed_experts must be [B, L, layers, top_k] like input_ids {list(attention_mask.shape)}, "
            f"got {list(routes.shape)}"
        )
    values = routes.detach().cpu().to(torch.int64).numpy()
    mask = attention_mask.detach().cpu().bool().numpy()
    per_row: list[Any] = []
    columns: list[Any] = []
    for i in range(values.shape[0]):
        real = mask[i].nonzero()[0][:-1]  # the last real token routes live
        if not response or not mask[i, mask.shape[1] - response :].any() or not real.shape[0]:
            per_row.append(None)
            columns.append(None)
            continue
        per_row.append(values[i][real])
        columns.append(values[i][: int(real[-1]) + 1])
    return _Recorded(per_row, columns)


def _route_fields(recorded: _Recorded, groups: _Groups | None) -> dict[str, Any]:
    """The request's route fields. Ungrouped: each row's columns up to its last recorded one, as verl
    lays them (the server ignores padding columns). Grouped: each prompt's routes once, each row's
    response routes after them (positions)."""
    from service.client.routed_experts import encode_row

    if groups is None:
        return {"routed_experts": [None if row is None else encode_row(row) for row in recorded.columns]}
    lengths = [len(p) for p in groups.prompt_ids]
    prompts: list[Any] = [None] * len(groups.prompt_ids)
    rows = []
    for i, row in enumerate(recorded.per_row):
        p, n = groups.prompt_index[i], lengths[groups.prompt_index[i]]
        if prompts[p] is None and row is not None:
            prompts[p] = encode_row(row[:n])
        rows.append(None if row is None or row.shape[0] <= n else encode_row(row[n:]))
    return {"prompt_routed_experts": prompts, "routed_experts": rows}


def _body(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    temperature: float,
    asked: Asked,
    options: dict[str, Any],
    groups: _Groups | None = None,
) -> dict[str, Any]:
    """The padded body of the rows, or with `groups` the grouped one: columns start.. as responses."""
    for name in options:
        if name in _OWN_FIELDS:
            raise TypeError(f"`{name}` is set by the adapter; give it as {_OWN_FIELDS[name]}")
    start = 0 if groups is None else groups.start
    body: dict[str, Any] = {
        "input_ids": input_ids.detach().cpu()[:, start:].tolist(),
        "attention_mask": attention_mask.detach().cpu()[:, start:].to(torch.int64).tolist(),
        "temperature": float(temperature),
        **options,
    }
    if groups is not None:
        body["prompt_ids"], body["prompt_index"] = groups.prompt_ids, groups.prompt_index
    if asked.entropy:
        body["return_entropy"] = True
    if asked.values:
        body["return_values"] = True
    if asked.ref_log_probs:
        body["return_ref_logprobs"] = True
        body["kl_estimator"] = asked.kl_estimator
    if asked.return_routed_experts:
        body["return_routed_experts"] = True
    return body

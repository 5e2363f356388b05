"""The wire format of `POST /logprobs`, seen from the client: request bodies in, `Scores` out.

Requests are built from plain Python lists; anything with a `.tolist()` (numpy arrays, torch
tensors) is converted here. Answers are Python lists, except the [rows][window][K] fields
(`top_ids`, `top_logprobs`, `candidate_logprobs`): per row a numpy array [window, K] (int64 ids,
float32 log-probs), read straight from a frame's arrays, decoded from JSON's base64 strings
(`distribution_format: "base64"`, K from `columns`) or converted from JSON lists. numpy is imported
only when an answer carries them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from service.wire.frame import ArraySpec, FrameError, decode_rows, encode_rows, pack, unpack

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    IdBlocks = list[npt.NDArray[np.int64]]  # per row [window, K]
    FloatBlocks = list[npt.NDArray[np.float32]]  # per row [window, K] or [window, C]

# response fields this client names; any other field the server adds lands in Scores.extra
_KNOWN = frozenset(
    {
        "model",
        "logprobs",
        "entropy",
        "action_mask",
        "usage",
        "weights_version",
        "top_ids",
        "top_logprobs",
        "ranks",
        "candidate_logprobs",
        "processed_logprobs",
        "columns",
    }
)
VERSIONS = ("weights_version", "ref_weights_version", "critic_weights_version")
# request fields a compact frame carries as arrays, with the dtypes tried in order
_FRAME_ARRAYS = {
    "input_ids": ("i4", "i8"),
    "prompt_ids": ("i4", "i8"),
    "attention_mask": ("u1", "i8"),
    "action_mask": ("u1", "i8"),
    "rollout_logprobs": ("f4",),
}
# routed experts travel flattened per row, in the narrowest dtype that holds every id (routes.frame_rows)
_ROUTE_ARRAYS = ("routed_experts", "prompt_routed_experts")


@runtime_checkable
class ToList(Protocol):
    """A numpy array or torch tensor."""

    def tolist(self) -> Any: ...


IntRows = Sequence[Sequence[int]] | ToList


@dataclass(frozen=True, slots=True)
class Usage:
    input_tokens: int
    scored_tokens: int
    computed_tokens: int | None = None  # run through the decoder (None: a server that does not say)
    cached_tokens: int | None = None  # served by the server's prefix cache (None: a server that does not say)


@dataclass(frozen=True, slots=True)
class RolloutStats:
    """The response's `rollout` object: training-inference mismatch over the request's action tokens,
    with d = logprob - rollout_logprob (a request with `rollout_logprobs` gets it)."""

    tokens: int
    mean_abs_diff: float | None  # mean |d| (None: no rollout_logprobs were sent)
    max_abs_diff: float | None  # max |d|
    mean_kl_k3: float | None  # mean k3 estimate of the KL between rollout and policy (docs/api.md)
    ratio_outside_fraction: float | None  # share of tokens whose ratio exp(d) is outside [0.5, 2]
    outside_kept_fraction: float | None = None  # with `sampling`: share outside the sampler's kept set

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> RolloutStats:
        def number(name: str) -> float | None:
            value = body.get(name)
            return None if value is None else float(value)

        return cls(
            tokens=int(body["tokens"]),
            mean_abs_diff=number("mean_abs_diff"),
            max_abs_diff=number("max_abs_diff"),
            mean_kl_k3=number("mean_kl_k3"),
            ratio_outside_fraction=number("ratio_outside_fraction"),
            outside_kept_fraction=number("outside_kept_fraction"),
        )


@dataclass(frozen=True, slots=True)
class RouteAgreementStats:
    """The response's `route_agreement`: over the (position, sparse layer) pairs the request gave
    routes for, how far the server's live router would have strayed from them."""

    compared: int
    exact_fraction: float  # pairs whose live top-k set equals the given set
    mean_overlap: float  # mean |given ∩ live| / top_k

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> RouteAgreementStats:
        return cls(
            compared=int(body["compared"]),
            exact_fraction=float(body["exact_fraction"]),
            mean_overlap=float(body["mean_overlap"]),
        )


@dataclass(frozen=True, slots=True)
class Scores:
    """One response, rows in request order, each aligned to its row's action window (docs/semantics.md).

    `weights_version` is the policy weights that produced every score (one version, whichever
    replicas answered). `extra` holds the response fields this class does not name (`values`,
    `ref_logprobs`, `kl`, `rollout`, `ref_weights_version`, `critic_weights_version`, and any the
    server adds later), merged across chunks like the others; the torch adapters turn them into
    tensors and `RolloutStats`.
    """

    model: str
    logprobs: list[list[float]]
    action_mask: list[list[int]]
    usage: Usage
    entropy: list[list[float]] | None = None
    weights_version: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # with top_logprobs / candidate_ids / sampling (docs/api.md, 'Beyond the log-prob'), per window entry:
    top_ids: IdBlocks | None = None  # per row int64 [window, K]
    top_logprobs: FloatBlocks | None = None  # per row float32 [window, K]
    ranks: list[list[int]] | None = None  # [B][window] vLLM's rank of the action token
    candidate_logprobs: FloatBlocks | None = None  # per row float32 [window, C]
    processed_logprobs: list[list[float]] | None = None  # [B][window]; -inf outside the kept set

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Scores:
        usage = body["usage"]
        columns = body.get("columns") or {}
        return cls(
            model=body["model"],
            logprobs=body["logprobs"],
            action_mask=body["action_mask"],
            usage=Usage(
                input_tokens=usage["input_tokens"],
                scored_tokens=usage["scored_tokens"],
                computed_tokens=usage.get("computed_tokens"),
                cached_tokens=usage.get("cached_tokens"),
            ),
            entropy=body.get("entropy"),
            weights_version=body.get("weights_version"),
            extra={k: v for k, v in body.items() if k not in _KNOWN},
            top_ids=_blocks(body.get("top_ids"), "int64", columns.get("top_ids")),
            top_logprobs=_blocks(body.get("top_logprobs"), "float32", columns.get("top_logprobs")),
            ranks=body.get("ranks"),
            candidate_logprobs=_blocks(
                body.get("candidate_logprobs"), "float32", columns.get("candidate_logprobs")
            ),
            processed_logprobs=_neg_inf(body.get("processed_logprobs")),
        )

    @property
    def routed_experts(self) -> list[Any] | None:
        """With `return_routed_experts`: per row, int64 numpy arrays [positions, moe_layers, top_k]
        (every column of a padded row, every position of a ragged or grouped row's sequence)."""
        rows, moe = self.extra.get("routed_experts"), self.extra.get("moe")
        if rows is None or moe is None:
            return None
        from service.client.routed_experts import decode  # numpy, only for callers of routes

        return decode(rows, moe)

    @property
    def route_agreement(self) -> RouteAgreementStats | None:
        """With `routed_experts`: the agreement over the request (per row: `extra['route_exact_fraction']`
        and `extra['route_mean_overlap']`)."""
        body = self.extra.get("route_agreement")
        return None if body is None else RouteAgreementStats.from_body(body)


def _blocks(rows: Sequence[Any] | None, dtype: str, width: int | None = None) -> Any:
    """Per row a numpy array [window, K] of `dtype`: a frame's blocks as they are, JSON's base64
    strings decoded (little-endian int32 ids or float32, `width` K), JSON's nested lists converted
    (null, a -inf JSON cannot carry, back to -inf); an empty row is [0, K]."""
    if rows is None:
        return None
    import numpy as np

    blocks = [
        np.asarray(row, dtype=dtype)
        if isinstance(row, np.ndarray)
        else _decoded(row, dtype, width)
        if isinstance(row, str)
        else _listed(row, dtype)
        for row in rows
    ]
    width = next((b.shape[1] for b in blocks if b.ndim == 2), 0)
    return [b if b.ndim == 2 else b.reshape(0, width) for b in blocks]


def _decoded(row: str, dtype: str, width: int | None) -> Any:
    """A base64 row of little-endian int32 (ids) or float32 as a [window, K] block of `dtype`."""
    import binascii

    import numpy as np

    if not isinstance(width, int) or width < 0:
        raise ValueError(f"a base64 row needs its K in the answer's columns, got {width!r}")
    wire = "<f4" if dtype.startswith("float") else "<i4"
    flat = np.frombuffer(binascii.a2b_base64(row), dtype=wire).astype(dtype)
    return flat.reshape(-1, width) if width else flat.reshape(0, 0)


def _listed(row: Sequence[Sequence[Any]], dtype: str) -> Any:
    import numpy as np

    block = np.array(row, dtype=dtype)  # JSON's null reads as nan
    if block.dtype.kind == "f":
        np.copyto(block, -np.inf, where=np.isnan(block))
    return block


def _neg_inf(rows: list[list[float | None]] | None) -> list[list[float]] | None:
    """JSON's null (a -inf the JSON form cannot carry) back to -inf."""
    if rows is None:
        return None
    return [[float("-inf") if v is None else v for v in row] for row in rows]


@dataclass(frozen=True, slots=True)
class Distribution:
    """What to ask beyond the log-prob (docs/api.md, 'Beyond the log-prob'): `top_logprobs` K;
    `candidate_ids` one list for every action, or per row one list per window entry; `sampling`
    {top_k, top_p, min_p} for processed log-probs."""

    top_logprobs: int | None = None
    candidate_ids: Any = None  # [C] ids, or [B][window][C]; lists, numpy arrays or tensors
    sampling: Mapping[str, Any] | None = None

    def fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.top_logprobs is not None:
            out["top_logprobs"] = int(self.top_logprobs)
        if self.candidate_ids is not None:
            ids = self.candidate_ids
            out["candidate_ids"] = ids.tolist() if isinstance(ids, ToList) else _lists(ids)
        if self.sampling is not None:
            out["sampling"] = dict(self.sampling)
        return out


def _lists(value: Any) -> Any:
    if isinstance(value, ToList):
        return value.tolist()
    if isinstance(value, Sequence) and not isinstance(value, str):
        return [_lists(v) for v in value]
    return value


def rows(value: IntRows) -> list[list[int]]:
    listed = value.tolist() if isinstance(value, ToList) else value
    return [list(row) for row in listed]


def group_prompts(prompts: IntRows) -> tuple[list[list[int]], list[int]]:
    """Each distinct prompt once, in order of first appearance, and for every row the index of its
    prompt: the `prompt_ids` and `prompt_index` of a grouped request. Rows are compared by their
    token ids (a dict of tuples: equal hashes alone never merge two prompts)."""
    where: dict[tuple[int, ...], int] = {}
    index = [where.setdefault(tuple(row), len(where)) for row in rows(prompts)]
    return [list(prompt) for prompt in where], index


def build_body(
    input_ids: IntRows,
    *,
    attention_mask: IntRows | None,
    num_actions: int | Sequence[int] | ToList | None,
    action_mask: IntRows | None,
    response_length: int | None,
    temperature: float,
    eos_token_id: int | Sequence[int] | ToList | None,
    return_entropy: bool,
    options: Mapping[str, Any],
    prompt_ids: IntRows | None = None,
    prompt_index: Sequence[int] | ToList | None = None,
    distribution: Distribution | None = None,
) -> dict[str, Any]:
    """A request body; fields left None are left out, `options` (future flags) are passed through.
    With `prompt_ids` and `prompt_index` it is grouped: `input_ids` rows are the responses."""
    body: dict[str, Any] = {"input_ids": rows(input_ids), "temperature": float(temperature)}
    if prompt_ids is not None:
        body["prompt_ids"] = rows(prompt_ids)
    if prompt_index is not None:
        listed = prompt_index.tolist() if isinstance(prompt_index, ToList) else prompt_index
        body["prompt_index"] = list(listed)
    if attention_mask is not None:
        body["attention_mask"] = rows(attention_mask)
    if num_actions is not None:
        listed = num_actions.tolist() if isinstance(num_actions, ToList) else num_actions
        body["num_actions"] = listed if isinstance(listed, int) else list(listed)
    if action_mask is not None:
        body["action_mask"] = rows(action_mask)
    if response_length is not None:
        body["response_length"] = int(response_length)
    if eos_token_id is not None:
        eos = eos_token_id.tolist() if isinstance(eos_token_id, ToList) else eos_token_id
        body["eos_token_id"] = eos if isinstance(eos, int) else list(eos)
    if return_entropy:
        body["return_entropy"] = True
    if distribution is not None:
        body.update(distribution.fields())
    body.update(options)
    for name in ("routed_experts", "prompt_routed_experts"):
        if body.get(name) is not None:
            from service.client.routed_experts import encode  # numpy, only for callers of routes

            body[name] = encode(body[name])
    return body


def to_frame(body: Mapping[str, Any]) -> bytes | None:
    """A request body as a compact frame; None when an array field holds what no dtype takes."""
    arrays: list[tuple[ArraySpec, bytes]] = []
    for name, dtypes in _FRAME_ARRAYS.items():
        rows = body.get(name)
        if rows is None:
            continue
        for dtype in dtypes:
            try:
                arrays.append(encode_rows(name, rows, dtype))
                break
            except (OverflowError, TypeError):
                continue
        else:
            return None
    for name in _ROUTE_ARRAYS:
        if body.get(name) is None:
            continue
        from service.client.routed_experts import frame_rows  # numpy, only for callers of routes

        routes = frame_rows(name, body[name])
        if routes is None:
            return None
        arrays.append(routes)
    fields = {k: v for k, v in body.items() if k not in _FRAME_ARRAYS and k not in _ROUTE_ARRAYS}
    return pack(json.dumps(fields, separators=(",", ":")).encode(), arrays)


def from_frame(raw: bytes) -> dict[str, Any]:
    """A compact-frame answer as the dict its JSON form would parse to, except the fields the JSON
    part's `columns` names (`top_ids`, `top_logprobs`, `candidate_logprobs`): per row a numpy array
    [window, K] (int64 ids, float32 log-probs); and `routed_experts`: per row a flat numpy array of
    the wire's dtype (Scores.routed_experts shapes them), never millions of Python ints. FrameError
    for arrays that do not fit their K."""
    frame = unpack(raw)
    body: dict[str, Any] = json.loads(frame.fields)
    columns = body.pop("columns", None) or {}
    for name, (spec, data) in frame.arrays.items():
        if name in columns:
            body[name] = _frame_blocks(spec, data, columns[name])
        elif name == "routed_experts":
            body[name] = _frame_flat_rows(spec, data)
        else:
            body[name] = decode_rows(spec, data)
    return body


def _frame_flat_rows(spec: ArraySpec, data: memoryview) -> list[Any]:
    """An array's rows as numpy views of one copy, in the wire's dtype."""
    import numpy as np

    flat = np.frombuffer(data, dtype=np.dtype(spec.dtype).newbyteorder("<")).copy()
    return np.split(flat, np.cumsum(spec.lengths, dtype=np.int64)[:-1]) if spec.lengths else []


def _frame_blocks(spec: ArraySpec, data: memoryview, width: Any) -> list[Any]:
    """An array of [window, K] rows, each flattened, as numpy blocks: one copy in int64 (ids) or
    float32, split into per-row views."""
    import numpy as np

    if not isinstance(width, int) or width < 0 or any(width and n % width for n in spec.lengths):
        raise FrameError(
            f"{spec.name}: rows of {list(spec.lengths)} values do not hold {width!r} columns", field=spec.name
        )
    if width == 0 and any(spec.lengths):
        raise FrameError(f"{spec.name}: 0 columns but values", field=spec.name)
    wire = np.frombuffer(data, dtype=np.dtype(spec.dtype).newbyteorder("<"))
    flat = wire.astype(np.float32 if spec.dtype.startswith("f") else np.int64)
    ends = np.cumsum(spec.lengths, dtype=np.int64)
    return [
        flat[end - n : end].reshape(n // width if width else 0, width)
        for n, end in zip(spec.lengths, ends.tolist(), strict=True)
    ]

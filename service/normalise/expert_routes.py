"""Routing replay (R3): each row's `routed_experts` -> the GivenRoutes of its job, checked.

A row's routes are `[P, moe_layers, top_k]` expert ids, read from nested lists, from SGLang's
`meta_info.routed_experts` (base64 of little-endian int32, reshaped `[-1, moe_layers, top_k]`, as
sglang's `extract_routed_experts_from_meta_info` decodes it) or from a compact frame's flat row; the
JSON reader may have decoded the first two already (wire/jsonrows.py: a Base64Ids, an array).
They cover `routed_experts_start` .. `routed_experts_start + P - 1` of the row, counted as:

- padded layouts: columns of the padded row (verl's `routed_experts` [B, L, layers, k] lies so);
  the entries of padding columns are ignored, those of real columns land on their tokens'
  positions (whatever the padding side);
- ragged layouts: positions of the row's sequence;
- grouped form: positions of the row's sequence, prompt then response. `prompt_routed_experts[p]`
  covers prompt p's positions 0 .. P-1, sent once; a row's own routes then start where they end.

Routes stay narrow: a frame's row and the JSON reader's are read in their own dtype (no copy: u1
where the ids fit), a base64 str as int32, lists through one np.asarray; once their ids are in range
they are narrowed to jobs.route_dtype (uint8 up to 256 experts). Every check is vectorised and works
on that dtype: ids in [0, experts) (min / max first, a fault located only once found), distinct
within one (position, layer) (the k slots compared pairwise, no sort), the layer count and top_k of
the policy, no position past the row. The range and distinctness checks are one pass of the native
reader (service/wire/_jsonrows.c's route_faults, the GIL released once) where it is built, else
numpy's. Faults are 422s naming field and row.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from service.core.errors import InvalidRequest
from service.core.jobs import GivenRoutes, RouteArray, route_dtype
from service.engine.contract import MoeShape
from service.normalise.rows import Row, per_row
from service.wire.jsonrows import native
from service.wire.schemas import Base64Ids, LogprobsRequest

FIELD, PROMPT_FIELD = "routed_experts", "prompt_routed_experts"


def route_format(request: LogprobsRequest) -> str:
    """How a JSON answer writes routes: as asked, else base64 when the request sent base64 strings."""
    if request.routed_experts_format is not None:
        return request.routed_experts_format
    sent = [*(request.routed_experts or ()), *(request.prompt_routed_experts or ())]
    return "base64" if any(isinstance(r, str | Base64Ids) for r in sent) else "lists"


def given_routes(request: LogprobsRequest, rows: list[Row], moe: MoeShape | None) -> list[GivenRoutes | None]:
    """Each row's given routes as sequence positions (None: the live router everywhere)."""
    if request.return_routed_experts and moe is None:
        raise InvalidRequest(
            "return_routed_experts needs a mixture-of-experts policy; this server's policy is dense",
            field="return_routed_experts",
        )
    if request.routed_experts is None and request.prompt_routed_experts is None:
        return [None] * len(rows)
    if moe is None:
        name = FIELD if request.routed_experts is not None else PROMPT_FIELD
        raise InvalidRequest(
            f"{name}: routes replay a mixture-of-experts policy; this one is dense", field=name
        )
    batch = len(rows)
    given = request.routed_experts
    if given is not None and len(given) != batch:
        raise InvalidRequest(f"routed_experts has {len(given)} rows, input_ids has {batch}", field=FIELD)
    starts = None
    if request.routed_experts_start is not None:
        starts = per_row(request.routed_experts_start, batch, "routed_experts_start")
    prompts = _prompt_routes(request, rows, moe)
    out: list[GivenRoutes | None] = []
    for i, row in enumerate(rows):
        experts = read_routes(given[i], moe, FIELD, i) if given is not None else None
        start = starts[i] if starts is not None else None
        if row.columns is not None:
            out.append(_padded(experts, start, row, moe, i=i, width=len(request.input_ids[i])))
        else:
            before = prompts.get(row.prompt) if row.prompt is not None else None
            out.append(_positions(experts, start, before, row, moe, i=i))
    return out


def read_routes(value: Any, moe: MoeShape, field: str, i: int, name: str | None = None) -> RouteArray | None:
    """[P, layers, top_k] ids from nested lists (int64; the JSON reader's: an array, its dtype), a
    base64 string (int32; the JSON reader's: a Base64Ids, its dtype) or a frame's flat row (its dtype,
    a view); None: null. Not yet checked or narrowed (check_experts does both)."""
    if value is None:
        return None
    name = name or f"{field} row {i}"
    shape = (moe.layers, moe.top_k)
    per = moe.layers * moe.top_k
    if isinstance(value, str):
        try:
            raw = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidRequest(
                f"{name} is not valid base64 (SGLang's meta_info.routed_experts: base64 of "
                "little-endian int32)",
                field=field,
                row=i,
            ) from None
        if len(raw) % (4 * per):
            raise _base64_length(name, len(raw), moe, field, i)
        return np.frombuffer(raw, dtype="<i4").reshape(-1, *shape)
    if isinstance(value, Base64Ids):
        if value.ids.size % per:
            raise _base64_length(name, 4 * value.ids.size, moe, field, i)
        return value.ids.reshape(-1, *shape)
    if isinstance(value, np.ndarray) and value.ndim == 1:  # a compact frame's row, flattened
        if value.size % per:
            raise InvalidRequest(
                f"{name} holds {value.size} ids, not a multiple of {per} ({moe.layers} sparse layers x top_k "
                f"{moe.top_k})",
                field=field,
                row=i,
            )
        return value.reshape(-1, *shape)
    if isinstance(value, np.ndarray):  # nested lists, read by the JSON reader
        experts = value
    else:
        try:
            experts = np.asarray(value, dtype=np.int64)
        except (ValueError, OverflowError):  # ragged nesting, or ids past int64
            experts = np.zeros(0, dtype=object)
    if experts.size == 0 and experts.dtype.kind in "iu":
        return experts.reshape(0, *shape)
    if experts.ndim != 3 or experts.shape[1:] != shape:
        got = list(experts.shape) if experts.dtype.kind in "iu" else "ragged nesting"
        raise InvalidRequest(
            f"{name} must be [positions, {moe.layers}, {moe.top_k}] ({moe.layers} sparse layers, top_k "
            f"{moe.top_k}), got {got}",
            field=field,
            row=i,
        )
    return experts


def _base64_length(name: str, size: int, moe: MoeShape, field: str, i: int) -> InvalidRequest:
    return InvalidRequest(
        f"{name} decodes to {size} bytes, not a multiple of {4 * moe.layers * moe.top_k} (int32 x "
        f"{moe.layers} sparse layers x top_k {moe.top_k})",
        field=field,
        row=i,
    )


def check_experts(
    experts: RouteArray, moe: MoeShape, field: str, i: int, *, name: str, keep: Any = None
) -> RouteArray:
    """Ids in [0, experts) and distinct within each (position, layer) (`keep` [P] bool: only those
    positions); the ids in route_dtype (no copy where they are in it already)."""
    fault = _fault(experts, moe, keep)
    if fault is not None and fault.slot is not None:
        p, layer, slot = fault.position, fault.layer, fault.slot
        raise InvalidRequest(
            f"{name}[{p}][{layer}][{slot}] is {experts[p, layer, slot]}; expert ids are 0 .. "
            f"{moe.experts - 1}",
            field=field,
            row=i,
        )
    if fault is not None:
        raise InvalidRequest(
            f"{name}[{fault.position}][{fault.layer}] names an expert twice "
            f"({experts[fault.position, fault.layer].tolist()}); the top_k ids of one position and layer "
            "are distinct",
            field=field,
            row=i,
        )
    return experts.astype(route_dtype(moe.experts), copy=False)


@dataclass(frozen=True, slots=True)
class _Fault:
    """The first fault of a row's routes: an id out of range at (position, layer, slot), else a
    (position, layer) that names an expert twice (slot None)."""

    position: int
    layer: int
    slot: int | None = None


def _fault(experts: RouteArray, moe: MoeShape, keep: Any) -> _Fault | None:
    """The first fault: the native reader's one pass where it is built and takes the dtype (the GIL
    released once: numpy's checks take it back ~60 times a row, and each time can wait the
    interpreter's switch interval behind a thread that runs Python), else numpy's."""
    reader = native()
    if experts.size == 0 or reader is None or experts.dtype.str not in _NATIVE_IDS:
        return _numpy_fault(experts, moe, keep)
    ids = np.ascontiguousarray(experts)
    kept = None if keep is None else np.ascontiguousarray(keep, dtype=np.uint8)
    kind, at = reader.route_faults(
        ids, ids.itemsize, ids.dtype.kind == "i", moe.layers, moe.top_k, moe.experts, kept
    )
    if kind == _OUT_OF_RANGE:
        p, layer, slot = (int(x) for x in np.unravel_index(at, ids.shape))
        return _Fault(p, layer, slot)
    if kind == _TWICE:
        return _Fault(*divmod(at, moe.layers))
    return None


_NATIVE_IDS = frozenset({"|u1", "<u2", "<i4", "<i8"})  # the dtypes route_faults reads (little-endian)
_OUT_OF_RANGE, _TWICE = 1, 2  # route_faults' kinds of fault


def _numpy_fault(experts: RouteArray, moe: MoeShape, keep: Any) -> _Fault | None:
    """_fault with numpy: min / max over the whole array (a fault located only past that), then the k
    slots compared pairwise."""
    if experts.size == 0:
        return None
    signed = experts.dtype.kind == "i"
    if int(experts.max()) >= moe.experts or (signed and int(experts.min()) < 0):
        bad = experts >= moe.experts
        if signed:
            bad |= experts < 0
        if keep is not None:
            bad &= keep[:, None, None]
        if bad.any():
            p, layer, slot = (int(x) for x in np.argwhere(bad)[0])
            return _Fault(p, layer, slot)
    twice = _repeats(experts.astype(route_dtype(moe.experts), copy=False))
    if twice is not None and keep is not None:
        twice &= keep[:, None]
    if twice is not None and twice.any():
        p, layer = (int(x) for x in np.argwhere(twice)[0])
        return _Fault(p, layer)
    return None


def _repeats(experts: RouteArray) -> np.ndarray | None:
    """[P, layers] bool: where one (position, layer) names an expert twice; None: nowhere. The k
    slots are compared pairwise (k (k - 1) / 2 compares of [P * layers], slot-major)."""
    k = experts.shape[-1]
    if k < 2 or experts.size == 0:
        return None
    slots = np.ascontiguousarray(np.moveaxis(experts, -1, 0)).reshape(k, -1)  # [k, P * layers]
    twice = np.zeros(slots.shape[1], dtype=np.bool_)
    same = np.empty_like(twice)
    for a in range(k - 1):
        for b in range(a + 1, k):
            np.equal(slots[a], slots[b], out=same)
            twice |= same
    if not twice.any():
        return None
    return twice.reshape(experts.shape[:-1])


def _padded(
    experts: RouteArray | None, start: int | None, row: Row, moe: MoeShape, *, i: int, width: int
) -> GivenRoutes | None:
    """Columns start .. start+P-1 of a padded row; padding columns' entries are ignored. Real columns
    in one run (a row padded on either side) keep their routes as a view, others are gathered."""
    if experts is None or experts.shape[0] == 0:
        return None
    assert row.columns is not None
    s, p = start or 0, int(experts.shape[0])
    if s + p > width:
        raise InvalidRequest(
            f"routed_experts row {i} covers columns {s} .. {s + p - 1}; the padded row has {width} columns",
            field=FIELD,
            row=i,
        )
    real = np.zeros(p, dtype=bool)  # [P] entries that fall on a real token
    inside = row.columns[(row.columns >= s) & (row.columns < s + p)]
    real[inside - s] = True
    experts = check_experts(experts, moe, FIELD, i, name=f"routed_experts[{i}]", keep=real)
    if not inside.size:
        return None
    first = int(np.searchsorted(row.columns, inside[0]))  # the position of the first covered token
    a, b = int(inside[0]) - s, int(inside[-1]) - s + 1
    kept = experts[a:b] if b - a == inside.size else experts[real]
    return GivenRoutes(start=first, experts=np.ascontiguousarray(kept))


def _positions(
    experts: RouteArray | None,
    start: int | None,
    before: RouteArray | None,
    row: Row,
    moe: MoeShape,
    *,
    i: int,
) -> GivenRoutes | None:
    """Positions of the row's sequence; `before`: its prompt's routes, from position 0."""
    length = int(row.tokens.shape[0])
    head = 0 if before is None else int(before.shape[0])
    if experts is None or experts.shape[0] == 0:
        return GivenRoutes(0, before) if before is not None and head else None
    s, p = (head if start is None else start), int(experts.shape[0])
    if s + p > length:
        raise InvalidRequest(
            f"routed_experts row {i} covers positions {s} .. {s + p - 1}; the row's sequence has {length} "
            "tokens",
            field=FIELD,
            row=i,
        )
    experts = check_experts(experts, moe, FIELD, i, name=f"routed_experts[{i}]")
    if before is None or head == 0:
        return GivenRoutes(start=s, experts=experts)
    if s != head:
        raise InvalidRequest(
            f"routed_experts row {i} starts at position {s}; its prompt's routes (prompt_routed_experts"
            f"[{row.prompt}]) end at position {head}: a row's routes continue its prompt's",
            field="routed_experts_start",
            row=i,
        )
    return GivenRoutes(start=0, experts=np.concatenate([before, experts]))


def _prompt_routes(request: LogprobsRequest, rows: Sequence[Row], moe: MoeShape) -> dict[int, RouteArray]:
    """prompt index -> its routes [P, layers, k], P <= its length, for the prompts some row names;
    a prompt's fault is reported at the first row that continues it."""
    given = request.prompt_routed_experts
    if given is None:
        return {}
    if request.prompt_ids is None:
        raise InvalidRequest("prompt_routed_experts needs the grouped form (prompt_ids)", field=PROMPT_FIELD)
    if len(given) != len(request.prompt_ids):
        raise InvalidRequest(
            f"prompt_routed_experts has {len(given)} entries for {len(request.prompt_ids)} prompts",
            field=PROMPT_FIELD,
        )
    out: dict[int, RouteArray] = {}
    seen: set[int] = set()
    for i, row in enumerate(rows):
        p = row.prompt
        if p is None or p in seen:
            continue
        seen.add(p)
        name = f"prompt_routed_experts[{p}]"
        experts = read_routes(given[p], moe, PROMPT_FIELD, i, name=name)
        if experts is None or experts.shape[0] == 0:
            continue
        if experts.shape[0] > row.prompt_length:
            raise InvalidRequest(
                f"{name} covers {experts.shape[0]} positions; the prompt has {row.prompt_length} tokens "
                f"(input_ids row {i} continues it)",
                field=PROMPT_FIELD,
                row=i,
            )
        out[p] = check_experts(experts, moe, PROMPT_FIELD, i, name=name)
    return out

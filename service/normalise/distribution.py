"""The request's asks beyond the log-prob -> each job's top_logprobs, candidate_ids and sampling.

`top_logprobs` K: 1 <= K <= the server's max_top_logprobs. `candidate_ids`: one list for every
action of every row (a job's [C]), or per row one list per action window entry, laid out like the
response's rows (a job's [A, C]: the lists at its action slots, after the EOS cut); every list holds
C >= 1 ids of the vocabulary. `sampling`: vLLM's ranges (wire/schemas.py) with top_k -1 read as 0 (off).
Faults are 422s naming the field and the row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from service.core.errors import InvalidRequest
from service.core.jobs import IntArray, Sampling
from service.normalise.rows import int64
from service.wire.schemas import LogprobsRequest


@dataclass(frozen=True, slots=True)
class Asks:
    """What every row asks beyond the log-prob; candidates: [C] shared, or per row [width, C]."""

    top_logprobs: int = 0
    shared: IntArray | None = None
    per_row: list[IntArray] | None = None
    sampling: Sampling | None = None

    def candidates(self, i: int, slots: IntArray) -> IntArray | None:
        """Row i's candidate ids for the actions at window `slots`: [C] or [A, C]."""
        if self.per_row is not None:
            return self.per_row[i][slots]
        return self.shared


def read_asks(request: LogprobsRequest, max_top_logprobs: int, vocab_size: int, widths: list[int]) -> Asks:
    """The request's asks, checked against the server's limit on K, the vocabulary and each row's
    window width."""
    k = request.top_logprobs or 0
    if k > max_top_logprobs:
        raise InvalidRequest(
            f"top_logprobs is {k}; this server returns at most {max_top_logprobs} (max_top_logprobs)",
            field="top_logprobs",
        )
    shared, per_row = _candidates(request, vocab_size, widths)
    sampling = None
    if request.sampling is not None:
        s = request.sampling
        sampling = Sampling(top_k=max(s.top_k, 0), top_p=s.top_p, min_p=s.min_p)
    return Asks(top_logprobs=k, shared=shared, per_row=per_row, sampling=sampling)


def _candidates(
    request: LogprobsRequest, vocab: int, widths: list[int]
) -> tuple[IntArray | None, list[IntArray] | None]:
    given = request.candidate_ids
    if given is None:
        return None, None
    if not given:
        raise InvalidRequest("candidate_ids is empty; give at least one token id", field="candidate_ids")
    if all(isinstance(c, int) for c in given):
        ids = int64(given, "candidate_ids", None, name="candidate_ids")  # type: ignore[arg-type]
        _inside(ids, vocab, None)
        return ids, None
    rows = given
    if len(rows) != len(widths):
        raise InvalidRequest(
            f"candidate_ids has {len(rows)} rows, the request has {len(widths)}", field="candidate_ids"
        )
    out: list[IntArray] = []
    count: int | None = None
    for i, (row, width) in enumerate(zip(rows, widths, strict=True)):
        assert isinstance(row, list)
        if len(row) != width:
            raise InvalidRequest(
                f"candidate_ids row {i} has {len(row)} lists; its action window has {width} entries",
                field="candidate_ids",
                row=i,
            )
        lengths = {len(ids) for ids in row}
        if row and (len(lengths) != 1 or (count is not None and lengths != {count})):
            raise InvalidRequest(
                f"candidate_ids row {i}: every list must hold the same number of ids "
                f"(found lengths {sorted(lengths | ({count} if count is not None else set()))})",
                field="candidate_ids",
                row=i,
            )
        if row:
            count = lengths.pop()
            if count == 0:
                raise InvalidRequest(f"candidate_ids row {i} holds empty lists", field="candidate_ids", row=i)
        ids = int64(row, "candidate_ids", i).reshape(width, -1) if row else np.zeros((0, 0), np.int64)
        _inside(ids, vocab, i)
        out.append(ids)
    c = count or 0
    return None, [ids if ids.shape[1] == c else np.zeros((0, c), np.int64) for ids in out]


def _inside(ids: IntArray, vocab: int, row: int | None) -> None:
    outside = ids[ids >= vocab]
    if outside.size:
        where = "candidate_ids" if row is None else f"candidate_ids row {row}"
        raise InvalidRequest(
            f"{where}: token id {outside.flat[0]} is outside the vocabulary [0, {vocab})",
            field="candidate_ids",
            row=row,
        )

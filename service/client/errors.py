"""The one exception a caller of the client sees, built from logprobd's `{"error": {...}}` body.

Knows nothing of the server's code: it reads the wire format (docs/api.md) and nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx


class LogprobdError(Exception):
    """logprobd (or a proxy in front of it) answered with an error, or no replica could be reached.

    `status` is the HTTP status (None when no response came back), `type` the server's error type
    (`invalid_request`, `not_ready`, `engine_failure`, ...; `http_error` for a body that is not
    logprobd's), `message` its text, `field` and `row` the culprit when the server named one.
    `row` is an index into the batch the caller passed, even when the batch was sent in chunks;
    the server's own `message` counts rows within its chunk, rows `chunk_start..` of the batch.
    `replicas` maps each replica that failed a call made to several (a weight push) to its reason.
    """

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        error_type: str = "http_error",
        field: str | None = None,
        row: int | None = None,
        url: str | None = None,
        attempts: int = 1,
        chunk_start: int = 0,
        replicas: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = error_type
        self.field = field
        self.row = row
        self.url = url
        self.attempts = attempts
        self.chunk_start = chunk_start
        self.replicas = replicas or {}

    def __reduce__(self) -> tuple[Any, ...]:
        # keyword-only state survives pickling (errors cross process boundaries in Ray trainers)
        return type(self), (self.message,), self.__dict__

    def __str__(self) -> str:
        named = (("field", self.field), ("row", self.row))
        where = [f"{name} {value}" for name, value in named if value is not None]
        if self.chunk_start:
            where.append(f"the server saw row {self.chunk_start} of the batch as its row 0")
        if self.attempts > 1:
            where.append(f"after {self.attempts} attempts")
        status = self.status if self.status is not None else "no response"
        return f"{status} {self.type}: {self.message}" + (f" ({'; '.join(where)})" if where else "")


class LogprobdConnectionError(LogprobdError):
    """No response came back: connection refused or reset, timeout, protocol error."""


def from_response(
    response: httpx.Response, *, chunk_start: int = 0, rows: Sequence[int] | None = None
) -> LogprobdError:
    """The error a non-2xx response stands for; `row` is shifted from chunk to batch coordinates (by
    `rows`, the batch's row of each of the chunk's, where the chunk's rows are not contiguous)."""
    detail = _error_detail(response)
    if detail is None:
        text = response.text.strip()[:500] or response.reason_phrase
        url = str(response.url)
        return LogprobdError(text, status=response.status_code, error_type="http_error", url=url)
    row = detail.get("row")
    if isinstance(row, int):
        row = rows[row] if rows is not None and 0 <= row < len(rows) else row + chunk_start
    return LogprobdError(
        str(detail.get("message", "")),
        status=response.status_code,
        error_type=str(detail.get("type", "http_error")),
        field=detail.get("field") if isinstance(detail.get("field"), str) else None,
        row=row if isinstance(row, int) else None,
        url=str(response.url),
        chunk_start=chunk_start,
    )


def from_transport(exc: httpx.TransportError, url: str) -> LogprobdConnectionError:
    return LogprobdConnectionError(
        f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__,
        status=None,
        error_type="connection_error",
        url=url,
    )


def _error_detail(response: httpx.Response) -> dict[str, Any] | None:
    try:
        body = response.json()
    except ValueError:
        return None
    detail = body.get("error") if isinstance(body, dict) else None
    return detail if isinstance(detail, dict) else None

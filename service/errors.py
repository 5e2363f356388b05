"""The error taxonomy and its one table of HTTP status codes.

Every failure a client can see is one of these; `status_for` is the only place that maps them.
"""

from __future__ import annotations

from typing import Any


class ServiceError(Exception):
    """Base of every error the service reports to a client."""

    kind = "internal_error"

    def __init__(self, message: str, *, field: str | None = None, row: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.row = row

    def body(self) -> dict[str, Any]:
        error: dict[str, Any] = {"type": self.kind, "message": self.message}
        if self.field is not None:
            error["field"] = self.field
        if self.row is not None:
            error["row"] = self.row
        return {"error": error}


class InvalidRequest(ServiceError):
    """The request is well-formed JSON but asks for something that cannot be scored."""

    kind = "invalid_request"


class NotReady(ServiceError):
    """The model is not loaded or warmed up yet, or the service is shutting down."""

    kind = "not_ready"


class EngineFailure(ServiceError):
    """The forward pass failed for a reason that is not the client's."""

    kind = "engine_failure"


_STATUS: dict[type[ServiceError], int] = {
    InvalidRequest: 422,
    NotReady: 503,
    EngineFailure: 500,
    ServiceError: 500,
}


def status_for(error: ServiceError) -> int:
    for cls in type(error).__mro__:
        if cls in _STATUS:
            return _STATUS[cls]
    return 500

"""The error taxonomy and its one table of HTTP status codes.

Every failure a client can see is one of these; `status_for` is the only place that maps them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


class ServiceError(Exception):
    """Base of every error the service reports to a client."""

    kind = "internal_error"

    def __init__(self, message: str, *, field: str | None = None, row: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.row = row

    def headers(self) -> dict[str, str]:
        return {}

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


class PayloadTooLarge(ServiceError):
    """Over a size limit of the server (body bytes, sequences or tokens per request); names the limit."""

    kind = "payload_too_large"


class SequenceTooLarge(ServiceError):
    """One sequence is longer than the server can hold the keys and values of, or does not fit in
    accelerator memory even alone."""

    kind = "sequence_too_large"


class Unauthorized(ServiceError):
    kind = "unauthorized"

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": "Bearer"}


class Overloaded(ServiceError):
    """The queue holds more tokens than the server accepts; try again after `retry_after` seconds."""

    kind = "overloaded"

    def __init__(self, message: str, *, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)}


class DeadlineExceeded(ServiceError):
    """The request waited longer than its deadline; its unscored work was dropped."""

    kind = "deadline_exceeded"


class ClientDisconnected(ServiceError):
    """The client went away before its answer; its unscored work was dropped. Counted, never sent."""

    kind = "client_disconnected"


class VersionMismatch(ServiceError):
    """The request pinned weights this replica does not serve (any more, or yet)."""

    kind = "weights_version_mismatch"

    def __init__(self, *, target: str, requested: str, serving: str | None) -> None:
        pin = "weights_version" if target == "policy" else f"{_PIN_PREFIX[target]}_weights_version"
        super().__init__(
            f"{pin}: the request pins {target} weights {requested!r}, this replica serves {serving!r}",
            field=pin,
        )
        self.target = target
        self.requested = requested
        self.serving = serving

    def body(self) -> dict[str, Any]:
        body = super().body()
        body["error"].update(
            target=self.target, requested_version=self.requested, serving_version=self.serving
        )
        return body


_PIN_PREFIX = {"reference": "ref", "critic": "critic"}


class ReloadConflict(ServiceError):
    """Another weight reload is under way; one runs at a time."""

    kind = "reload_in_progress"


class WeightsRefused(ServiceError):
    """The checkpoint cannot replace the served weights; they keep serving."""

    kind = "weights_rejected"


class WeightPushFailed(ServiceError):
    """A route of SGLang's weight-push protocol failed; the answer is SGLang's own shape."""

    kind = "weight_push_failed"

    def body(self) -> dict[str, Any]:
        return {"success": False, "message": self.message}


class WeightPushConflict(WeightPushFailed):
    """A trainer group beyond weight_push_max_groups, a bucket of another version while a version
    other groups sent to is pending, or a push while a checkpoint reload runs (or the other way
    round)."""

    kind = "weight_push_conflict"


class WeightPushInvalid(ServiceError):
    """A body of SGLang's weight-push protocol that does not validate: SGLang's error object."""

    kind = "weight_push_invalid"

    def body(self) -> dict[str, Any]:
        return {"object": "error", "message": self.message, "type": "Bad Request", "param": None, "code": 400}


class Forbidden(ServiceError):
    """The route is switched off on this server."""

    kind = "forbidden"


class NotReady(ServiceError):
    """The model is not loaded or warmed up yet, or the service is shutting down."""

    kind = "not_ready"


class NoRoute(ServiceError):
    """The path or the method names no route. Not a scoring request: not counted as an outcome."""


class NotFound(NoRoute):
    kind = "not_found"


class MethodNotAllowed(NoRoute):
    kind = "method_not_allowed"

    def __init__(self, message: str, *, allow: str) -> None:
        super().__init__(message)
        self.allow = allow

    def headers(self) -> dict[str, str]:
        return {"Allow": self.allow}


class EngineFailure(ServiceError):
    """The forward pass failed for a reason that is not the client's."""

    kind = "engine_failure"


_STATUS: dict[type[ServiceError], int] = {
    InvalidRequest: 422,
    PayloadTooLarge: 413,
    SequenceTooLarge: 413,
    Unauthorized: 401,
    Forbidden: 403,
    NotFound: 404,
    MethodNotAllowed: 405,
    VersionMismatch: 409,
    ReloadConflict: 409,
    WeightsRefused: 422,
    WeightPushFailed: 400,
    WeightPushConflict: 409,
    WeightPushInvalid: 400,
    Overloaded: 429,
    DeadlineExceeded: 504,
    ClientDisconnected: 499,
    NotReady: 503,
    EngineFailure: 500,
    ServiceError: 500,
}


# every `outcome` label of logprobd_requests_total: exported at 0 from the start, so that rate() and
# the alerts see the first requests of an outcome (a series that appears at N has no increase)
OUTCOMES = ("ok", *sorted({cls.kind for cls in _STATUS if not issubclass(cls, NoRoute)}))


def status_for(error: ServiceError) -> int:
    for cls in type(error).__mro__:
        if cls in _STATUS:
            return _STATUS[cls]
    return 500


# Swagger UI and ReDoc, served with --docs-ui (settings.docs_ui)
DOCS_UI_PATHS = frozenset({"/docs", "/redoc", "/docs/oauth2-redirect"})


def from_routing(status: int, method: str, path: str, allow: str | None) -> NoRoute | None:
    """The router's 404 or 405 as an error of this table; None for any other status."""
    route = f"{method} {path[:200]}"
    if status == 404 and path.rstrip("/") in DOCS_UI_PATHS:  # only ever 404 when --docs-ui is off
        return NotFound(
            f"{route}: the interactive API docs are off; start the server with --docs-ui to serve them "
            "(they load their scripts from public CDNs). The routes are listed at /openapi.json"
        )
    if status == 404:
        return NotFound(f"{route}: no such route (the routes are listed at /openapi.json)")
    if status == 405 and allow:
        return MethodNotAllowed(f"{route}: method not allowed; {path[:200]} takes {allow}", allow=allow)
    return None


# fields with one entry per input row: an index into them is the row at fault
_ROW_FIELDS = frozenset({"input_ids", "attention_mask", "action_mask", "num_actions", "prompt_index"})


def _nested_field(part: object) -> bool:
    """A field name of a nested object (sampling's top_p), not a union branch's type tag."""
    return isinstance(part, str) and part.isidentifier() and part not in {"int", "float", "str", "bool"}


def from_pydantic(errors: Sequence[Mapping[str, Any]]) -> InvalidRequest:
    """The first pydantic validation error, as an InvalidRequest naming the field and, when known, the row."""
    first = errors[0]
    if first.get("type") == "json_invalid":  # not a field: the body is not JSON
        at = [part for part in first.get("loc", ()) if isinstance(part, int)]
        where = f" at character {at[0]}" if at else ""
        reason = first.get("ctx", {}).get("error") or first.get("msg", "")
        return InvalidRequest(f"body: not valid JSON{where} ({reason})", field="body")

    def path(error: Mapping[str, Any]) -> list[str | int]:
        """Field name then list indices and nested fields (sampling.top_p); drops "body" and union
        branch tags ("list[constrained-int]")."""
        loc = [part for part in error.get("loc", ()) if part != "body"]
        return loc[:1] + [part for part in loc[1:] if isinstance(part, int) or _nested_field(part)]

    # a union field (num_actions, eos_token_id) gives one error per branch; the deepest names the entry
    same_field = [error for error in errors if path(error)[:1] == path(first)[:1]]
    chosen = max(same_field, key=lambda error: len(path(error)))
    loc = path(chosen)
    field = str(loc[0]) if loc else "body"
    row = loc[1] if len(loc) > 1 and isinstance(loc[1], int) and field in _ROW_FIELDS else None
    where = field + "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc[1:])
    others = len(errors) - 1
    more = f" (and {others} more error{'s' if others > 1 else ''})" if others else ""
    return InvalidRequest(f"{where}: {chosen.get('msg', 'invalid')}{more}", field=field, row=row)

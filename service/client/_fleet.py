"""The HTTP side of a weight push: the same call to every replica at once, each on a thread of its own
(the group's calls block until the broadcasts they wait for are done), and their answers.

Every call carries `Authorization: Bearer <admin key>`. An answer is read in any of the three shapes a
replica sends: SGLang's `{"success", "message"}` (the weight routes), SGLang's error object
`{"object": "error", "message"}` (a body that does not validate), logprobd's `{"error": {"type",
"message"}}` (401, 403, 503, ...). `failure` makes one error naming every replica that failed.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx

from service import __version__
from service.client.errors import LogprobdConnectionError, LogprobdError

# an idle connection is dropped after this long: below the server's keep-alive (uvicorn's 5 s), so
# that a call never goes out on a connection the server is closing at that moment (httpx's default
# expiry, 5 s, is uvicorn's: a push one training step after the last can meet that race)
KEEPALIVE_EXPIRY_S = 2.0


@dataclass(frozen=True, slots=True)
class Reply:
    """One replica's answer: `status` None when none came (`kind` connection_error)."""

    url: str
    status: int | None
    kind: str
    message: str
    body: Any = None

    @property
    def ok(self) -> bool:
        return self.status == 200


class Fleet:
    """The replicas of one push, by base URL, and the threads their calls run on."""

    def __init__(self, urls: Sequence[str], admin_key: str | None, timeout_s: float) -> None:
        self.urls = tuple(url.rstrip("/") for url in urls)
        if not self.urls:
            raise ValueError("give at least one replica URL")
        headers = {"user-agent": f"logprobd-client/{__version__}"}
        if admin_key:
            headers["authorization"] = f"Bearer {admin_key}"
        self._http = httpx.Client(
            headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            limits=httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY_S),
        )
        self._threads = ThreadPoolExecutor(max(2, 2 * len(self.urls)), thread_name_prefix="logprobd-push")

    def send(
        self,
        method: str,
        path: str,
        bodies: Sequence[Any] | None = None,
        *,
        urls: Sequence[str] | None = None,
        timeout: float | None = None,
    ) -> list[Future[Reply]]:
        """Start `method path` on every replica of `urls` (default: all), the i-th with bodies[i];
        their futures, in order."""
        urls = self.urls if urls is None else urls
        given = bodies if bodies is not None else [None] * len(urls)
        return [
            self._threads.submit(self._call, method, url, path, body, timeout)
            for url, body in zip(urls, given, strict=True)
        ]

    def call(self, method: str, path: str, bodies: Sequence[Any] | None = None) -> list[Reply]:
        return [future.result() for future in self.send(method, path, bodies)]

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
        self._http.close()

    def _call(self, method: str, url: str, path: str, body: Any, timeout: float | None) -> Reply:
        extra: dict[str, Any] = {} if timeout is None else {"timeout": httpx.Timeout(timeout, connect=10.0)}
        try:
            response = self._http.request(method, f"{url}{path}", json=body, **extra)
        except httpx.TransportError as exc:
            return Reply(url, None, "connection_error", f"{type(exc).__name__}: {exc}".rstrip(": "))
        return read(url, response)


def read(url: str, response: httpx.Response) -> Reply:
    """A replica's answer, whichever of its shapes it came in."""
    try:
        body = response.json()
    except ValueError:
        body = None
    status = response.status_code
    if isinstance(body, dict) and isinstance(body.get("error"), dict):  # logprobd's
        error = body["error"]
        return Reply(url, status, str(error.get("type", "http_error")), str(error.get("message", "")), body)
    if isinstance(body, dict) and "message" in body:  # SGLang's answer or error object
        kind = "ok" if status == 200 else "weight_push_conflict" if status == 409 else "weight_push_failed"
        if body.get("object") == "error":
            kind = "weight_push_invalid"
        return Reply(url, status, kind, str(body["message"]), body)
    text = response.text.strip()[:500] or response.reason_phrase
    return Reply(url, status, "ok" if status == 200 else "http_error", text, body)


def failure(replies: Sequence[Reply], what: str) -> LogprobdError | None:
    """One error naming every replica whose answer was not 200 (a connection error if one gave no
    answer), or None."""
    failed = [reply for reply in replies if not reply.ok]
    if not failed:
        return None
    detail = "; ".join(f"{r.url}: {r.status or 'no answer'} {r.message}" for r in failed)
    cls = LogprobdConnectionError if any(r.status is None for r in failed) else LogprobdError
    first = failed[0]
    return cls(
        f"{what}: {len(failed)} of {len(replies)} replicas failed: {detail}",
        status=first.status,
        error_type=first.kind,
        url=first.url,
        replicas={r.url: f"{r.status or 'no answer'} {r.message}" for r in failed},
    )

"""What the sync and async clients share: their settings, one attempt's outcome, the final merge.

Both clients run the same loop per chunk: lease a replica, post, and on failure either raise or
back off and try again; only the sleeping and the HTTP calls differ between them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from service import __version__
from service.client import group_keys
from service.client.errors import LogprobdError, from_response, from_transport
from service.client.fanout import Chunk, merge, reorder, split
from service.client.retry import RETRYABLE_ERRORS, RetryPolicy, parse_retry_after
from service.client.wire import VERSIONS, Scores, from_frame, to_frame
from service.wire.frame import MEDIA_TYPE

Timeout = float | httpx.Timeout


@dataclass(frozen=True, slots=True)
class ClientConfig:
    urls: tuple[str, ...]
    headers: dict[str, str]
    timeout: httpx.Timeout
    max_chunk_tokens: int
    max_chunk_rows: int
    max_concurrency: int
    retry: RetryPolicy
    frames: bool = True  # send and accept compact frames (frame.py); False: JSON both ways
    group_key_tokens: int | None = None  # a row's group key hashes its prompt's first tokens only
    split_groups: bool = False  # one request per group (for a load balancer hashing the group header)

    @classmethod
    def create(
        cls,
        base_url: str | Sequence[str],
        *,
        api_key: str | None,
        timeout: Timeout,
        max_chunk_tokens: int,
        max_chunk_rows: int,
        max_concurrency: int,
        retry: RetryPolicy | None,
        frames: bool = True,
        group_key_tokens: int | None = None,
        split_groups: bool = False,
    ) -> ClientConfig:
        urls = (base_url,) if isinstance(base_url, str) else tuple(base_url)
        if not urls:
            raise ValueError("give a base URL or a list of replica URLs")
        if min(max_chunk_tokens, max_chunk_rows, max_concurrency) < 1:
            raise ValueError("max_chunk_tokens, max_chunk_rows and max_concurrency must be >= 1")
        headers = {"content-type": "application/json", "user-agent": f"logprobd-client/{__version__}"}
        if api_key:
            headers["authorization"] = f"Bearer {api_key}"
        return cls(
            urls=tuple(url.rstrip("/") for url in urls),
            headers=headers,
            timeout=timeout if isinstance(timeout, httpx.Timeout) else httpx.Timeout(timeout, connect=10.0),
            max_chunk_tokens=max_chunk_tokens,
            max_chunk_rows=max_chunk_rows,
            max_concurrency=max_concurrency,
            retry=retry or RetryPolicy(),
            frames=frames,
            group_key_tokens=group_key_tokens,
            split_groups=split_groups,
        )

    def chunks(self, body: Mapping[str, Any]) -> list[Chunk]:
        """The requests of one batch: rows of one group key (group_keys.py) to one replica (each group a
        request of its own with split_groups), each request naming its first row's key."""
        return split(
            body,
            max_chunk_tokens=self.max_chunk_tokens,
            max_chunk_rows=self.max_chunk_rows,
            min_chunks=len(self.urls),
            keys=group_keys.row_keys(body, self.group_key_tokens),
            replicas=len(self.urls),
            by_group=self.split_groups,
        )


@dataclass(frozen=True, slots=True)
class Failure:
    """An attempt that got no usable answer."""

    error: LogprobdError
    retryable: bool
    retry_after: float | None


@dataclass(frozen=True, slots=True)
class Encoded:
    """A chunk's body, encoded once and reused by every attempt, with its headers."""

    content: bytes
    headers: dict[str, str]


def encode(chunk: Chunk, frames: bool) -> Encoded:
    """A compact frame when asked for and the rows fit one (else JSON: the server names the fault),
    with the group header of its first row."""
    group = {} if chunk.group is None else {group_keys.HEADER: group_keys.header_value(chunk.group)}
    if frames:
        framed = to_frame(chunk.body)
        if framed is not None:
            accept = f"{MEDIA_TYPE}, application/json"
            return Encoded(framed, {"content-type": MEDIA_TYPE, "accept": accept, **group})
    return Encoded(
        json.dumps(chunk.body, separators=(",", ":")).encode(), {"content-type": "application/json", **group}
    )


def reply_body(response: httpx.Response) -> dict[str, Any]:
    """The JSON object (or compact frame) of a 200 response, as a dict of Python values."""
    body: Any
    try:
        if response.headers.get("content-type", "").startswith(MEDIA_TYPE):
            body = from_frame(response.content)
        else:
            body = response.json()
    except ValueError:  # FrameError is one
        body = None
    if not isinstance(body, dict):
        raise LogprobdError(
            f"a 200 response that is not a JSON object: {response.text[:200]!r}",
            status=response.status_code,
            error_type="bad_response",
            url=str(response.url),
        )
    return body


def response_failure(response: httpx.Response, chunk: Chunk, policy: RetryPolicy) -> Failure:
    return Failure(
        error=from_response(response, chunk_start=chunk.start, rows=chunk.rows),
        retryable=response.status_code in policy.statuses,
        retry_after=parse_retry_after(response.headers.get("retry-after")),
    )


def transport_failure(exc: httpx.TransportError, url: str) -> Failure:
    error = from_transport(exc, url)
    error.__cause__ = exc
    return Failure(error=error, retryable=isinstance(exc, RETRYABLE_ERRORS), retry_after=None)


def give_up_unless_retryable(failure: Failure, attempt: int, policy: RetryPolicy) -> None:
    """Raise the failure's error if it cannot pass or attempt `attempt` (0-based) was the last."""
    if not failure.retryable or attempt + 1 >= policy.max_attempts:
        failure.error.attempts = attempt + 1
        raise failure.error


def finish(chunks: Sequence[Chunk], replies: Sequence[Mapping[str, Any]]) -> Scores:
    """The caller's Scores from the chunks' replies; replicas must all serve the same model."""
    models = sorted({str(reply.get("model")) for reply in replies})
    if len(models) > 1:
        raise LogprobdError(
            f"replicas serve different models ({', '.join(models)}); one batch must be scored by one model",
            status=None,
            error_type="replica_mismatch",
        )
    for key in VERSIONS:
        versions = sorted({str(reply[key]) for reply in replies if reply.get(key) is not None})
        if len(versions) > 1:
            raise LogprobdError(
                f"replicas answered with different {key}s ({', '.join(versions)}): the batch would mix "
                "weights. Pin `weights_version`, or `update_weights` on every replica first",
                status=None,
                error_type="replica_mismatch",
            )
    try:
        merged = reorder(merge(replies), chunks)
    except ValueError as exc:
        raise LogprobdError(str(exc), status=None, error_type="bad_response") from None
    scores = Scores.from_body(merged)
    expected = sum(len(c.rows) if c.rows is not None else c.stop - c.start for c in chunks)
    if len(scores.logprobs) != expected:
        raise LogprobdError(
            f"the server returned {len(scores.logprobs)} rows for {expected}",
            status=None,
            error_type="bad_response",
        )
    return scores


def weights_request(
    path: str, version: str, target: str, mode: str | None, admin_key: str | None
) -> tuple[dict[str, Any], dict[str, str]]:
    """The body and headers of `POST /admin/weights` (wait until the weights serve)."""
    body: dict[str, Any] = {"path": path, "version": version, "target": target, "wait": True}
    if mode is not None:
        body["mode"] = mode
    return body, ({"authorization": f"Bearer {admin_key}"} if admin_key else {})


def reload_failures(outcomes: Mapping[str, httpx.Response | httpx.TransportError]) -> LogprobdError | None:
    """One error naming every replica whose reload did not answer 200, or None."""
    errors = [
        from_transport(o, url) if isinstance(o, httpx.TransportError) else from_response(o)
        for url, o in outcomes.items()
        if not (isinstance(o, httpx.Response) and o.status_code == 200)
    ]
    if not errors:
        return None
    detail = "; ".join(f"{e.url}: {e.message}" for e in errors)
    first = errors[0]
    return LogprobdError(
        f"{len(errors)} of {len(outcomes)} replicas did not reload: {detail}",
        status=first.status,
        error_type=first.type,
        field=first.field,
        url=first.url,
    )


def serving_version(info: Mapping[str, Any], target: str) -> str | None:
    """The version a replica's `/info` says `target` serves."""
    weights = info.get("weights") or {}
    entry = weights.get(target) if isinstance(weights, dict) else None
    return str(entry["version"]) if isinstance(entry, dict) and "version" in entry else None

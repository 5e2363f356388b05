"""When to try a request again and how long to wait first.

Scoring is idempotent (the same body always gets the same scores), so any attempt that failed for
a reason that may pass (429, 503, a gateway's 502, a dropped connection, a timeout) is safe to
repeat, on the same replica or another one. 504 is not retried by default: logprobd sends it when
a request outlived its deadline, and trying again would only spend that time once more.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from email.utils import parsedate_to_datetime

import httpx

# failures of the connection, never of the request: worth another attempt
RETRYABLE_ERRORS: tuple[type[httpx.TransportError], ...] = (
    httpx.NetworkError,  # connect / read / write / close
    httpx.TimeoutException,
    httpx.RemoteProtocolError,  # the server went away mid-response
)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Exponential backoff with jitter, with `Retry-After` as a floor.

    Attempt k (0-based) that failed waits a uniform draw in [b/2, b] with b = min(max_backoff,
    backoff * 2**k), or the server's `Retry-After` (capped at `max_retry_after`) if that is longer.
    """

    max_attempts: int = 6
    backoff: float = 0.25
    max_backoff: float = 10.0
    max_retry_after: float = 60.0
    statuses: frozenset[int] = frozenset({429, 502, 503})

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.backoff < 0 or self.max_backoff < 0 or self.max_retry_after < 0:
            raise ValueError("backoff, max_backoff and max_retry_after must be >= 0")

    def delay(self, attempt: int, retry_after: float | None, rng: random.Random) -> float:
        """Seconds to wait after failed attempt `attempt` (0-based)."""
        ceiling = min(self.max_backoff, self.backoff * 2.0**attempt)
        wait = rng.uniform(ceiling / 2, ceiling)
        if retry_after is not None:
            wait = max(wait, min(retry_after, self.max_retry_after))
        return wait


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """`Retry-After` in seconds: delta-seconds or an HTTP date (RFC 9110 10.2.3); None if absent or bad."""
    if value is None:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:
            return None
        seconds = when.timestamp() - (time.time() if now is None else now)
    return None if math.isnan(seconds) else max(0.0, seconds)

"""Which replica gets the next chunk: the least loaded among those not backing off, in turn.

Shared by every call of one client (and by its threads), so chunks of concurrent calls spread too.
A replica that answered 429/503 or could not be reached is skipped until its back-off ends, unless
every replica is backing off, in which case the caller waits for the first one to come back.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

from service.client.errors import LogprobdConnectionError


@dataclass(slots=True)
class Replica:
    url: str
    in_flight: int = 0  # chunks leased to it and not yet released
    ready_at: float = 0.0  # time.monotonic() before which it is not tried


@dataclass(frozen=True, slots=True)
class Lease:
    """One attempt's replica; `wait` seconds to sleep before sending (0 unless all are backing off)."""

    replica: Replica
    wait: float


class ReplicaPool:
    def __init__(self, urls: tuple[str, ...]) -> None:
        if not urls:
            raise ValueError("give at least one replica URL")
        self.replicas = [Replica(url) for url in urls]
        self._lock = threading.Lock()
        self._turn = 0  # round-robin tie-break among equally loaded replicas

    def acquire(self, prefer: int | None = None) -> Lease:
        """A replica for the next attempt: `prefer` (where a chunk's groups go) unless it is backing
        off, else the least loaded."""
        with self._lock:
            now = time.monotonic()
            n = len(self.replicas)
            if prefer is not None and self.replicas[prefer % n].ready_at <= now:
                replica = self.replicas[prefer % n]
                replica.in_flight += 1
                return Lease(replica, 0.0)

            def rank(i: int) -> tuple[float, int, int]:
                r = self.replicas[i]
                return max(0.0, r.ready_at - now), r.in_flight, (i - self._turn) % n

            chosen = min(range(n), key=rank)
            self._turn = (chosen + 1) % n
            replica = self.replicas[chosen]
            replica.in_flight += 1
            return Lease(replica, max(0.0, replica.ready_at - now))

    def release(self, replica: Replica) -> None:
        with self._lock:
            replica.in_flight -= 1

    def back_off(self, replica: Replica, seconds: float) -> None:
        with self._lock:
            replica.ready_at = max(replica.ready_at, time.monotonic() + seconds)


def resolve_replicas(host: str, port: int, *, scheme: str = "http") -> list[str]:
    """Base URLs of every address `host` resolves to, sorted: behind a headless Kubernetes Service
    (clusterIP: None) that is one per ready pod, so a trainer can reach every replica (to update all
    their weights) rather than whichever one a load balancer picks."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise LogprobdConnectionError(
            f"cannot resolve {host}: {exc}", status=None, error_type="connection_error"
        ) from exc
    urls = {
        f"{scheme}://[{address[0]}]:{port}"
        if family == socket.AF_INET6
        else f"{scheme}://{address[0]}:{port}"
        for family, _, _, _, address in infos
    }
    return sorted(urls)

"""The trainer's side of a weight-update group: rank 0, made exactly as SGLang's servers (and logprobd's
replicas) make theirs, so that they meet:

1. a TCPStore this process hosts at master_address:master_port (the replicas' rendezvous connects to
   it as clients; port 0 picks a free port, known before any replica is told);
2. `PrefixStore(group_name, store)`;
3. torch's `_new_process_group_helper(world_size, 0, [], Backend(backend), store, group_name=...,
   timeout=...)`: no default (WORLD) process group is made or needed, so a trainer's own groups
   (FSDP's, DeepSpeed's) are untouched; then `pg_group_ranks[pg] = {i: i}`, so that
   `broadcast(src=0, group=pg)` names ranks as the group does.

gloo connects every rank when the group is made (it blocks until every replica has joined); NCCL makes
its communicator at the first broadcast. `Rank0.join` runs the making on a thread of its own so that
the caller can watch the replicas' answers meanwhile: a replica that refuses to join would otherwise
leave it waiting for the whole timeout. torch is imported here only, when a group is made.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import os
import socket
import threading
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:
    import torch

# torch's NCCL groups read this when made: a collective that fails or times out aborts the group's
# communicator and raises, instead of torch's default of ending the whole (trainer) process
_NCCL_ERRORS = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
_ENV_LOCK = threading.Lock()


def reach_address(url: str) -> str:
    """The local address this host uses to reach `url`'s host: what a replica dials back to reach the
    trainer's store (a UDP socket's connect sends nothing)."""
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind, proto) as probe:
        probe.connect(address)
        local: str = probe.getsockname()[0]
    return local


def uses_cuda(backend: str) -> bool:
    """Whether a group of `backend` broadcasts from a GPU ("nccl", "cpu:gloo,cuda:nccl") or host memory."""
    return "nccl" in backend


class Rank0:
    """One group, rank 0 of `world_size`: the store is up once constructed (`port`), `join` makes the
    group, `broadcast` sends, `close` leaves (never raises)."""

    def __init__(
        self, name: str, backend: str, world_size: int, *, address: str, port: int, timeout_s: float
    ) -> None:
        from torch.distributed import TCPStore  # type: ignore[attr-defined]

        self.name, self.backend, self.world_size = name, backend, world_size
        self.address = address
        self._timeout = datetime.timedelta(seconds=timeout_s)
        # wait_for_workers=False: the replicas' arrival is known from their answers, and with port 0 the
        # port must be known (and sent to them) before any arrives
        self._store = TCPStore(
            address, port, world_size, True, timeout=self._timeout, wait_for_workers=False, multi_tenant=True
        )
        self.port: int = self._store.port
        self.pg: Any = None  # torch.distributed.ProcessGroup, once joined
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None

    def start(self) -> None:
        """Begin making the group on a thread (blocks there until every replica joined, for gloo)."""
        self._thread = threading.Thread(target=self._join, name="logprobd-push-join", daemon=True)
        self._thread.start()

    def joined(self, wait_s: float) -> bool:
        """Whether the group is made, waiting up to `wait_s`; raises what making it raised."""
        assert self._thread is not None, "start() first"
        self._thread.join(wait_s)
        if self._failure is not None:
            raise self._failure
        return self.pg is not None

    def broadcast(self, tensor: torch.Tensor) -> Any:
        """Start broadcasting `tensor` to every replica; the work (is_completed, wait)."""
        import torch.distributed as dist

        return dist.broadcast(tensor, src=0, group=self.pg, async_op=True)

    def close(self) -> None:
        """Leave the group: a CUDA group's communicator aborted first (a broadcast may be stuck in it)."""
        import torch.distributed as dist

        pg, self.pg = self.pg, None
        if pg is None:
            return
        if uses_cuda(self.backend):
            with contextlib.suppress(Exception):
                from torch.distributed.distributed_c10d import _abort_process_group

                _abort_process_group(pg)
        with contextlib.suppress(Exception):
            dist.destroy_process_group(pg)

    def _join(self) -> None:
        from torch.distributed import distributed_c10d as c10d

        try:
            store = c10d.PrefixStore(self.name, self._store)
            options = {"backend_options" if _takes_backend_options() else "pg_options": None}
            name: Any = c10d.GroupName(self.name) if hasattr(c10d, "GroupName") else self.name
            with _nccl_errors(uses_cuda(self.backend)):
                pg, _ = c10d._new_process_group_helper(
                    self.world_size,
                    0,
                    [],
                    c10d.Backend(self.backend),
                    store,
                    group_name=name,
                    timeout=self._timeout,
                    device_id=None,
                    **options,
                )
            c10d._world.pg_group_ranks[pg] = {i: i for i in range(self.world_size)}
            self.pg = pg
        except BaseException as exc:  # handed to the caller by joined()
            self._failure = exc


def _takes_backend_options() -> bool:
    """torch >= 2.6 names the helper's options `backend_options` (before: `pg_options`)."""
    from torch.distributed import distributed_c10d as c10d

    return "backend_options" in inspect.signature(c10d._new_process_group_helper).parameters


@contextlib.contextmanager
def _nccl_errors(cuda: bool) -> Any:
    """_NCCL_ERRORS set while an NCCL group is made, as it was after."""
    if not cuda:
        yield
        return
    name, value = _NCCL_ERRORS
    with _ENV_LOCK:
        before = os.environ.get(name)
        os.environ[name] = value
        try:
            yield
        finally:
            if before is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = before

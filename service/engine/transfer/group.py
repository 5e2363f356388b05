"""Join a trainer's weight-update group exactly as SGLang's servers do, so that the trainer's own
`init_custom_process_group` (SGLang's, slime's, AReaL's) meets this process:

1. `rendezvous("tcp://host:port", rank, world_size, timeout)`: the trainer, rank 0, hosts the
   TCPStore; this process connects to it as a client;
2. `PrefixStore(group_name, store)`;
3. `_new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
   backend_options=None, timeout=timeout, device_id=None)`: no default (WORLD) group is made or
   needed, and the scoring process's own groups (tensor parallel) are untouched;
4. `_world.pg_group_ranks[pg] = {i: i}`, so `broadcast(src=0, group=pg)` takes the trainer's rank.

NCCL makes the communicator at the group's first collective. Its watchdog ends the whole process
when a collective times out unless TORCH_NCCL_ASYNC_ERROR_HANDLING says otherwise (torch's default,
3, tears the process down): the group is made with 2, which aborts the group's communicator only,
so a trainer that stalls fails its push and not the server. Receivers also abort a group themselves
past their own deadline (`abort`).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from service.engine.contract import WeightGroup

# torch's NCCL process groups read these when made: abort the communicator on a timeout or an error,
# never the process
_NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
_ENV_LOCK = threading.Lock()


@dataclass(frozen=True, slots=True)
class Joined:
    """A group this process joined: its process group, rank, and the device its broadcasts land on."""

    spec: WeightGroup
    rank: int
    pg: Any  # torch.distributed.ProcessGroup
    device: torch.device


def receive_device(backend: str, model: torch.device) -> torch.device:
    """Where a group's broadcasts land: a GPU for NCCL (the model's), host memory for gloo; a device
    map ("cpu:gloo,cuda:nccl") takes the model's device where it names one. ValueError: none fits."""
    kinds = dict(part.split(":", 1) for part in backend.split(",")) if ":" in backend else {}
    if not kinds:
        kinds = {"cuda": backend} if backend == "nccl" else {"cpu": backend}
    if model.type in kinds:
        return model
    if "cpu" in kinds:
        return torch.device("cpu")
    raise ValueError(f"backend {backend!r} broadcasts between GPUs; this server's model is on {model.type}")


def tcp_url(host: str, port: int) -> str:
    """SGLang's NetworkAddress(host, port).to_tcp(): an IPv6 address in brackets."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


def join(spec: WeightGroup, rank: int, model_device: torch.device) -> Joined:
    """Join `spec` as `rank`; returns once every rank has (gloo) or the store agreed (NCCL). Raises
    what torch raises: a trainer that never comes times out after spec.timeout_s."""
    from torch.distributed.distributed_c10d import (
        Backend,
        GroupName,
        PrefixStore,
        _new_process_group_helper,
        _world,
    )
    from torch.distributed.rendezvous import rendezvous

    device = receive_device(spec.backend, model_device)
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    store, rank, world = next(
        rendezvous(tcp_url(spec.master_address, spec.master_port), rank, spec.world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    store = PrefixStore(spec.name, store)
    with _nccl_env():
        pg, _ = _new_process_group_helper(
            world,
            rank,
            [],
            Backend(spec.backend),
            store,
            group_name=GroupName(spec.name),
            backend_options=None,
            timeout=timeout,
            device_id=None,
        )
    _world.pg_group_ranks[pg] = {i: i for i in range(world)}
    return Joined(spec, rank, pg, device)


def leave(joined: Joined) -> None:
    """Destroy the group (SGLang's destroy_weights_update_group)."""
    dist.destroy_process_group(joined.pg)


def abort(joined: Joined) -> None:
    """Tear down a group whose collective failed or stalls: NCCL's communicator aborted (its kernels
    end), then the group destroyed; never raises."""
    from torch.distributed.distributed_c10d import _abort_process_group

    if joined.device.type == "cuda":
        with contextlib.suppress(Exception):
            _abort_process_group(joined.pg)
    with contextlib.suppress(Exception):
        dist.destroy_process_group(joined.pg)


@contextlib.contextmanager
def _nccl_env() -> Iterator[None]:
    """_NCCL_ENV set while a group is made (its NCCL backend reads them then), as it was after."""
    with _ENV_LOCK:
        before = {name: os.environ.get(name) for name in _NCCL_ENV}
        os.environ.update(_NCCL_ENV)
        try:
            yield
        finally:
            for name, value in before.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value

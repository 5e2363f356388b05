"""The trainer groups of weight pushes (SGLang's /init_weights_update_group and
/destroy_weights_update_group): up to weight_push_max_groups open at once (a trainer's pipeline
stages each push their layers over a group of their own), each with its lock (its calls run one at
a time, in the order they arrive: asyncio's lock is FIFO) and its thread (its rendezvous and
broadcasts block), so that the groups' buckets arrive side by side.

The server dials a trainer's master_address only for an admin caller (http/weight_sync.py) and, with
weight_push_addresses set, only where every address the name resolves to lies in those networks.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field

from service.core.errors import WeightPushConflict, WeightPushFailed
from service.engine.contract import WeightGroup, WeightReceiver
from service.settings import Settings
from service.wire.weight_sync import InitGroup

log = logging.getLogger(__name__)
INIT_FAILED = "Failed to initialize custom process group"


@dataclass(slots=True)
class Group:
    spec: WeightGroup
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # FIFO: one call of the group at a time
    executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="logprobd-push")
    )
    joined: bool = False
    gone: bool = False


class Groups:
    """The groups this server joined, by name; `counted(n)` hears how many are joined whenever that
    changes."""

    def __init__(
        self, settings: Settings, tensor_parallel_size: int, counted: Callable[[int], None] = lambda _: None
    ) -> None:
        self._timeout_s = settings.weight_push_timeout_s
        self._most = settings.weight_push_max_groups
        self._networks = settings.push_networks()
        self._tp = tensor_parallel_size
        self._counted = counted
        self._open: dict[str, Group] = {}

    def joined(self, name: str) -> Group | None:
        group = self._open.get(name)
        return group if group is not None and group.joined else None

    def names(self) -> list[str]:
        return [name for name, group in self._open.items() if group.joined]

    async def join(self, order: InitGroup, receiver: WeightReceiver) -> Group:
        """Join the trainer's group; returns once the rendezvous is done."""
        if order.group_name in self._open:
            raise WeightPushFailed(f"{INIT_FAILED}: The specified group name has already been used.")
        if len(self._open) >= self._most:
            names = ", ".join(repr(name) for name in self._open)
            raise WeightPushConflict(
                f"{INIT_FAILED}: {len(self._open)} group(s) are open ({names}); this server takes "
                f"{self._most} at a time (weight_push_max_groups; destroy one first)"
            )
        if order.rank_offset < 1 or order.rank_offset + self._tp > order.world_size:
            last = order.rank_offset + self._tp - 1
            raise WeightPushFailed(
                f"{INIT_FAILED}: ranks {order.rank_offset}..{last} (rank_offset + this replica's "
                f"{self._tp} tensor-parallel ranks) do not fit a world of {order.world_size} whose rank 0 "
                "is the trainer."
            )
        spec = WeightGroup(
            order.group_name,
            order.master_address,
            order.master_port,
            order.rank_offset,
            order.world_size,
            order.backend,
            self._timeout_s,
        )
        group = self._open[spec.name] = Group(spec)
        try:
            await self._allowed(order.master_address, order.master_port)
            await asyncio.get_running_loop().run_in_executor(group.executor, receiver.join_group, spec)
        except Exception as exc:
            self.forget(group)
            log.warning("joining weight-update group %r failed: %s", spec.name, exc)
            raise WeightPushFailed(f"{INIT_FAILED}: {exc}.") from exc
        group.joined = True
        self._counted(len(self.names()))
        return group

    @asynccontextmanager
    async def quiet(self) -> AsyncIterator[None]:
        """Hold every open group's lock (in name order), so that the calls each group received before
        are answered first and none runs meanwhile."""
        async with AsyncExitStack() as held:
            for name in sorted(self._open):
                await held.enter_async_context(self._open[name].lock)
            yield

    async def leave(self, group: Group, receiver: WeightReceiver) -> None:
        """Destroy the group (the caller holds its lock and has dropped what it left pending)."""
        try:
            await asyncio.get_running_loop().run_in_executor(
                group.executor, receiver.leave_group, group.spec.name
            )
        except Exception as exc:
            raise WeightPushFailed(f"Failed to destroy custom process group: {exc}.") from exc
        finally:
            self.forget(group)

    async def stop(self, receiver: WeightReceiver | None) -> None:
        """Leave every group (the server stops). A group in the middle of a call is left as it is:
        the call ends by itself (at most weight_push_timeout_s) before the process exits."""
        for group in list(self._open.values()):
            busy = group.lock.locked()
            self.forget(group)
            if busy:
                log.warning("group %r stops in the middle of a push call", group.spec.name)
            elif group.joined and receiver is not None:
                try:
                    await asyncio.wait_for(asyncio.to_thread(receiver.leave_group, group.spec.name), 10)
                except Exception:  # the trainer may be gone: nothing more to do
                    log.debug("leaving group %r at stop", group.spec.name, exc_info=True)

    def forget(self, group: Group) -> None:
        group.gone = True
        if self._open.get(group.spec.name) is group:
            del self._open[group.spec.name]
            self._counted(len(self.names()))
        group.executor.shutdown(wait=False)

    async def _allowed(self, host: str, port: int) -> None:
        """ValueError unless every address `host` resolves to lies in weight_push_addresses (unset: any)."""
        if not self._networks:
            return
        infos = await asyncio.to_thread(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM)
        addresses = {ipaddress.ip_address(info[4][0]) for info in infos}
        outside = sorted(str(a) for a in addresses if not any(a in net for net in self._networks))
        if outside:
            raise ValueError(
                f"master_address {host} ({', '.join(outside)}) is not in this server's weight_push_addresses"
            )

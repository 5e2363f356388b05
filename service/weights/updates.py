"""Weight reloads: one at a time, staged off the engine thread, applied by the batcher at a barrier.

A reload reads and checks the checkpoint in a loader thread while scoring goes on (engine.stage),
then the batcher applies it between micro-batches (engine.apply). A refused checkpoint changes
nothing; its reason is kept in the reload's status.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine, Mapping
from pathlib import Path
from typing import Any

from service.batcher import Batcher
from service.core.errors import InvalidRequest, ReloadConflict
from service.engine.contract import ReloadOrder, ScoringEngine, WeightsRejected, WeightsState
from service.metrics import Metrics
from service.settings import Settings
from service.weights.gate import UpdateGate
from service.wire.schemas import ReloadStatus, WeightsInfo, WeightsUpdate

log = logging.getLogger(__name__)
OUTCOMES = ("applied", "rejected", "failed")


class Reloader:
    def __init__(
        self,
        engine: ScoringEngine,
        batcher: Batcher,
        metrics: Metrics,
        settings: Settings,
        gate: UpdateGate | None = None,
    ) -> None:
        self._engine = engine
        self._gate = gate or UpdateGate()  # shared with weight pushes (push.py)
        self._batcher = batcher
        self._metrics = metrics
        self._default_mode = settings.reload_mode
        roots = settings.reload_roots.split(":") if settings.reload_roots else []
        self._roots = [Path(root).resolve() for root in roots if root]
        self._task: asyncio.Task[ReloadStatus] | None = None
        self.reloads: dict[str, ReloadStatus] = {}  # the latest reload of each model
        for target, state in engine.weights.items():
            metrics.weights_version.labels(target, state.version).set(1)
            for outcome in OUTCOMES:  # exported at 0 from the start, so rate() and alerts see them
                metrics.weights_reloads.labels(target, outcome)

    @property
    def weights(self) -> Mapping[str, WeightsState]:
        """What every model serves now."""
        return self._engine.weights

    def serving(self) -> dict[str, WeightsInfo]:
        """What every model serves now, for /info and /admin/weights."""
        return {
            target: WeightsInfo(
                version=w.version, source=w.source, mode=w.mode, loaded_at=w.loaded_at, reloads=w.reloads
            )
            for target, w in self._engine.weights.items()
        }

    def begin(self, update: WeightsUpdate) -> asyncio.Future[ReloadStatus]:
        """Start a reload; the future ends with its final status (it never raises). Raises ReloadConflict
        while another runs or a push is pending, InvalidRequest for a target this server lacks or a
        path outside the roots."""
        current = self._engine.weights.get(update.target)
        if current is None:
            raise InvalidRequest(f"target: this server has no {update.target} model", field="target")
        path = self._allowed(update.path)
        busy = self._gate.begin_reload(f"a reload of the {update.target} to {update.version!r}")
        if busy is not None:
            raise ReloadConflict(busy)
        status = ReloadStatus(
            target=update.target,
            version=update.version,
            path=str(path),
            state="loading",
            started_at=time.time(),
        )
        if current.version == update.version and Path(current.source).resolve() == path:
            self._gate.end_reload()
            status = status.model_copy(update={"state": "unchanged"})
            self.reloads[update.target] = status
            unchanged: asyncio.Future[ReloadStatus] = asyncio.get_running_loop().create_future()
            unchanged.set_result(status)
            return unchanged
        self.reloads[update.target] = status
        order = ReloadOrder(update.target, path, update.version, update.mode or self._default_mode)
        self._task = asyncio.create_task(self._released(self._run(order, status)), name="logprobd-reload")
        return self._task

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def _allowed(self, raw: str) -> Path:
        path = Path(raw).expanduser().resolve()
        if self._roots and not any(path.is_relative_to(root) for root in self._roots):
            allowed = ", ".join(str(root) for root in self._roots)
            raise InvalidRequest(f"path: {path} is outside the reload roots ({allowed})", field="path")
        return path

    async def _run(self, order: ReloadOrder, status: ReloadStatus) -> ReloadStatus:
        target = order.target
        started = time.perf_counter()
        old = self._engine.weights[target].version
        log.info("reloading %s weights %r -> %r from %s", target, old, order.version, order.path)
        try:
            staged = await asyncio.to_thread(self._engine.stage, order)
            staged_at = time.perf_counter()
            applied = await self._batcher.apply(staged)
        except WeightsRejected as exc:
            log.warning("reload of %s to %r refused: %s", target, order.version, exc)
            return self._finish(
                status.model_copy(update={"state": "rejected", "error": str(exc)}), "rejected"
            )
        except Exception as exc:  # reported in the status; the server goes on serving
            log.exception("reload of %s to %r failed", target, order.version)
            error = f"{type(exc).__name__}: {exc}"
            return self._finish(status.model_copy(update={"state": "failed", "error": error}), "failed")
        self._metrics.weights_version.remove(target, old)
        self._metrics.weights_version.labels(target, order.version).set(1)
        self._metrics.weights_pause_seconds.observe(applied.pause_seconds)
        self._metrics.weights_reload_seconds.observe(time.perf_counter() - started)
        done = status.model_copy(
            update={
                "state": "done",
                "mode": staged.mode,
                "bytes": staged.nbytes,
                "stage_seconds": staged_at - started,
                "wait_seconds": applied.wait_seconds,
                "pause_seconds": applied.pause_seconds,
            }
        )
        log.info(
            "%s weights %r serving (%s, %.2f GiB; staged in %.2f s, paused scoring %.1f ms)",
            target,
            order.version,
            staged.mode,
            staged.nbytes / 2**30,
            staged_at - started,
            applied.pause_seconds * 1e3,
        )
        return self._finish(done, "applied")

    async def _released(self, run: Coroutine[Any, Any, ReloadStatus]) -> ReloadStatus:
        try:
            return await run
        finally:
            self._gate.end_reload()

    def _finish(self, status: ReloadStatus, outcome: str) -> ReloadStatus:
        self._metrics.weights_reloads.labels(status.target, outcome).inc()
        if self.reloads.get(status.target, status).started_at == status.started_at:
            self.reloads[status.target] = status
        return status

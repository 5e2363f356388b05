"""Replicas that follow a version file on shared storage, for trainers that cannot reach every pod.

The trainer writes, after each checkpoint, a small JSON file every replica can read: one reload
order as `POST /admin/weights` takes it (`path`, `version`, optional `target` and `mode`), or a list
of them (the policy and the critic together). Write it atomically (a temporary file, then rename).
Each replica checks the file every `weights_follow_interval_s` and reloads what it does not serve
yet; `Client.wait_for_version` tells when all of them do. A file that cannot be read or refused
weights are logged, and tried again once the file changes.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from pydantic import TypeAdapter, ValidationError

from service.core.errors import ReloadConflict, ServiceError
from service.weights.updates import Reloader
from service.wire.schemas import WeightsUpdate

log = logging.getLogger(__name__)

_ORDERS = TypeAdapter(WeightsUpdate | list[WeightsUpdate])


async def follow_version_file(reloader: Reloader, path: Path, interval: float) -> None:
    """Forever: when `path` changes, reload every model whose version it names and that differs."""
    acted_on: tuple[int, int] | None = None  # (mtime, size) of the content last acted on
    while True:
        await asyncio.sleep(interval)
        try:
            stat = path.stat()
        except OSError:
            continue
        seen = (stat.st_mtime_ns, stat.st_size)
        if seen == acted_on:
            continue
        try:
            parsed = _ORDERS.validate_json(path.read_bytes())
        except (OSError, ValidationError) as exc:
            log.warning("version file %s: unreadable, waiting for it to change: %s", path, exc)
            acted_on = seen
            continue
        acted_on = seen if await _reload_all(reloader, path, parsed) else None


async def _reload_all(reloader: Reloader, path: Path, parsed: WeightsUpdate | list[WeightsUpdate]) -> bool:
    """Reload what differs; False when another reload was under way (try again next time)."""
    for update in parsed if isinstance(parsed, list) else [parsed]:
        current = reloader.weights.get(update.target)
        if current is not None and current.version == update.version:
            continue
        try:
            status = await reloader.begin(update)
        except ReloadConflict:
            return False
        except ServiceError as exc:
            log.warning("version file %s: %s", path, exc.message)
            continue
        if status.state in ("rejected", "failed"):
            log.warning(
                "version file %s: %s %r not loaded: %s", path, update.target, update.version, status.error
            )
    return True

"""One kind of weight update at a time: a checkpoint reload excludes pushes, and a pending push
excludes reloads (a push is pending from its first bucket until its version serves or is dropped).
Pushes to different models (the policy, the critic) may be pending together. Event loop only."""

from __future__ import annotations


class UpdateGate:
    def __init__(self) -> None:
        self._reload: str | None = None  # what runs, e.g. "a reload of the policy to 'v3'"
        self._pushes: dict[str, str] = {}  # target -> what is pending

    def begin_reload(self, what: str) -> str | None:
        """Hold the gate for a reload; else why not (nothing held)."""
        if self._reload is not None:
            return f"{self._reload} is under way; one runs at a time"
        if self._pushes:
            pending = next(iter(self._pushes.values()))
            return f"{pending} is pending; a reload waits for it to serve or be dropped"
        self._reload = what
        return None

    def end_reload(self) -> None:
        self._reload = None

    def begin_push(self, target: str, what: str) -> str | None:
        """Hold the gate for a push to `target`; else why not (nothing held)."""
        if self._reload is not None:
            return f"{self._reload} is under way; a push waits for it to finish"
        self._pushes[target] = what
        return None

    def end_push(self, target: str) -> None:
        self._pushes.pop(target, None)

"""A stand-in for CUDA graph capture on CPU that counts its captures (graphs.EagerRecorder's replay
runs the recorded body again over the static buffers)."""

from __future__ import annotations

from collections.abc import Callable

from service.engine.decoder.graphs import EagerRecorder


class Counting(EagerRecorder):
    """EagerRecorder that counts the graphs captured (`captures`)."""

    def __init__(self) -> None:
        self.captures = 0

    def capture(self, body: Callable[[], None]) -> Callable[[], None]:
        self.captures += 1
        return body

"""The static MoE routes that CUDA graphs of a routed micro-batch read and write (batch/device_routes.py).

A graph that records (R2) or replays (R3) routes holds the routing kernel's pointers to these buffers,
sized for the largest micro-batch: a replay copies the batch's given ids and coverage in, and after
the last layer (run eagerly, into the same buffers) copies the records out into the batch's own
BatchRoutes, which the scorer reads as from an eager forward.

    given   [capacity, layers, k]  the batch's narrow id dtype (uint8 up to 256 experts)
    covered [capacity]             bool
    used    [capacity, layers, k]  int32
    live    [capacity, layers, k]  int32
    matches [capacity, layers]     int8

Allocated the first time a routed micro-batch meets the graphs (never for live-only traffic), outside
every capture.
"""

from __future__ import annotations

from typing import Literal

import torch

from service.engine.batch.device_routes import BatchRoutes

RouteMode = Literal["live", "record", "replay"]


def mode_of(routes: BatchRoutes | None) -> RouteMode:
    """What a graph of a forward over these routes holds: none, records, or replays and records."""
    if routes is None:
        return "live"
    return "replay" if routes.given is not None else "record"


class RouteBuffers:
    """See the module."""

    def __init__(self, capacity: int, like: BatchRoutes, given_dtype: torch.dtype) -> None:
        _, layers, k = like.used.shape
        device = like.used.device
        self.given_dtype = given_dtype
        self.given = torch.zeros((capacity, layers, k), dtype=given_dtype, device=device)
        self.covered = torch.zeros(capacity, dtype=torch.bool, device=device)
        self.used = torch.zeros((capacity, layers, k), dtype=torch.int32, device=device)
        self.live = torch.zeros_like(self.used)
        self.matches = torch.zeros((capacity, layers), dtype=torch.int8, device=device)

    def fits(self, routes: BatchRoutes, tokens: int) -> bool:
        """Whether a batch's routes over `tokens` rows go through these buffers (else: eagerly)."""
        if routes.used.shape[0] != tokens or routes.used.shape[1:] != self.used.shape[1:]:
            return False
        if routes.used.dtype != torch.int32 or tokens > self.used.shape[0]:
            return False
        given, live, matches = routes.given, routes.live, routes.matches
        if given is None:
            return True
        return (
            given.dtype == self.given_dtype
            and routes.covered is not None
            and live is not None
            and live.dtype == torch.int32
            and matches is not None
            and matches.dtype == torch.int8
        )

    def view(self, mode: RouteMode, tokens: int) -> BatchRoutes | None:
        """The routes a graph of `mode` over `tokens` rows reads and writes."""
        if mode == "live":
            return None
        used = self.used[:tokens]
        if mode == "record":
            return BatchRoutes(used)
        n = tokens
        return BatchRoutes(used, self.given[:n], self.covered[:n], self.live[:n], self.matches[:n])

    def outputs(self, mode: RouteMode, tokens: int) -> list[torch.Tensor]:
        """The buffers a forward of `mode` writes, over `tokens` rows."""
        if mode == "live":
            return []
        if mode == "record":
            return [self.used[:tokens]]
        return [self.used[:tokens], self.live[:tokens], self.matches[:tokens]]

    def load(self, routes: BatchRoutes, tokens: int) -> None:
        """The batch's given ids and coverage in (fits(routes, tokens) holds)."""
        if routes.given is not None and routes.covered is not None:
            self.given[:tokens].copy_(routes.given)
            self.covered[:tokens].copy_(routes.covered)

    def unload(self, routes: BatchRoutes, tokens: int) -> None:
        """What the forward recorded, out into the batch's own buffers."""
        routes.used.copy_(self.used[:tokens])
        if routes.live is not None:
            routes.live.copy_(self.live[:tokens])
        if routes.matches is not None:
            routes.matches.copy_(self.matches[:tokens])

"""A micro-batch's MoE routes on the device (BatchRoutes) and one sparse layer's view of them
(LayerRoutes): what a forward replays (R3) and what it writes down (R2). route_buffers.py lays them
out from the jobs; the sparse layers read and write them (moe/replay.py says how a route is taken).

Over the packed row of N tokens, for the policy's sparse layers in order:

    given   [N, layers, k]  expert ids (a narrow int dtype), read where covered [N] bool
    used    [N, layers, k]  int32, written by the forward: the experts each token's layers used
    live    [N, layers, k]  int32, written where something is given: the layer's own router's top-k
    matches [N, layers]     int8, written where something is given: |given ∩ live| at covered tokens,
                            0 elsewhere (the route agreement, without an [N, layers, k, k] temporary)

A layer's calls take consecutive rows of the packed row (`first` on): LayerRoutes is one layer's
strided view, [N, k] and [N] each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class LayerRoutes:
    """One sparse layer's part of BatchRoutes: given [n, k] and covered [n] (None: nothing given in
    this micro-batch), used and live [n, k] and matches [n] to write (None: not recorded here)."""

    given: torch.Tensor | None = None
    covered: torch.Tensor | None = None
    used: torch.Tensor | None = None
    live: torch.Tensor | None = None
    matches: torch.Tensor | None = None

    def gathered(self, rows: torch.Tensor) -> LayerRoutes:
        """The inputs at rows [R] (the last layer's MLP runs on the rows the heads read); no outputs."""
        if self.given is None or self.covered is None:
            return LayerRoutes()
        return LayerRoutes(self.given.index_select(0, rows), self.covered.index_select(0, rows))

    def record(self, first: int, experts: torch.Tensor) -> None:
        """Write the expert ids [n, k] that rows first .. first + n - 1 took into `used`, if recorded."""
        if self.used is not None:
            self.used[first : first + experts.shape[0]].copy_(experts)


@dataclass(frozen=True, slots=True)
class BatchRoutes:
    """A micro-batch's routes on the device (see the module); `given` and `covered` None when no
    sequence gave any (the forward records only), `live` None likewise."""

    used: torch.Tensor
    given: torch.Tensor | None = None
    covered: torch.Tensor | None = None
    live: torch.Tensor | None = None
    matches: torch.Tensor | None = None

    @property
    def replays(self) -> bool:
        return self.given is not None

    def layer(self, index: int) -> LayerRoutes:
        """The routes of sparse layer `index` (of the policy's sparse layers, in order)."""
        return LayerRoutes(
            None if self.given is None else self.given[:, index],
            self.covered,
            self.used[:, index],
            None if self.live is None else self.live[:, index],
            None if self.matches is None else self.matches[:, index],
        )

    def agreement(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Per token [N] int32: the layers whose live top-k set equals the given set, and the sum over
        layers of |given ∩ live| (divide by k for the overlap); None where nothing was given. Read at
        covered tokens only (ids are distinct within a token's top-k, so |∩| = k is set equality)."""
        if self.given is None or self.matches is None:
            return None
        k = self.used.shape[-1]
        exact = (self.matches == k).sum(-1, dtype=torch.int32)
        return exact, self.matches.sum(-1, dtype=torch.int32)

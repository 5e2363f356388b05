"""Pushing from a sharded trainer, where every rank must take part in gathering each full tensor and
rank 0 alone pushes (docs/client.md, "Pushing weights"):

- verl (FSDP workers): `per_tensor, _ = engine.get_per_tensor_param()` on every rank yields each full
  tensor under its Hugging Face name (each one a gather over the FSDP ranks);
- OpenRLHF (DeepSpeed): `gathered_parameters(model, gather)` yields `model.named_parameters()` one at
  a time, each gathered by `gather([param])` (ZeRO-3: `deepspeed.zero.GatheredParameters`) and copied
  while gathered, since ZeRO-3 frees the full tensor when its context ends;

then `push_from_ranks(pusher or None, per_tensor, version=...)` on every rank: the rank given a
pusher (rank 0) pushes as the tensors come; the others read them through, joining each gather. A push
that fails on rank 0 still reads the source to its end before raising, so that the other ranks'
gathers complete rather than wait for ever.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from service.client.push import PushResult, WeightPusher

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

Gather = Callable[[list[Any]], AbstractContextManager[Any]]


def push_from_ranks(
    pusher: WeightPusher | None, source: Iterable[tuple[str, torch.Tensor]], **push: Any
) -> PushResult | None:
    """Every rank calls this with the same source: with a pusher (rank 0), `pusher.push(source,
    **push)`; without one, the source read through. None on the ranks without a pusher."""
    pairs = iter(source)
    if pusher is None:
        for _ in pairs:
            pass
        return None
    try:
        return pusher.push(pairs, **push)
    except BaseException:
        with contextlib.suppress(Exception):  # the other ranks wait in the source's gathers
            drained = sum(1 for _ in pairs)
            log.info("push failed; read the source's %d remaining tensors for the other ranks", drained)
        raise


def gathered_parameters(
    model: torch.nn.Module, gather: Gather | None = None, *, copy: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """`model.named_parameters()`, each whole while `gather([param])` holds it (None: as they are),
    copied then (copy=False on ranks that only take part in the gathers)."""
    for name, param in model.named_parameters():
        with gather([param]) if gather is not None else contextlib.nullcontext():
            yield name, param.data.clone() if copy else param.data

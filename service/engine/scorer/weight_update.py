"""Hot reload of one served model: read, check and stage a checkpoint beside the served weights
(any thread), then apply it between micro-batches (the engine thread), the forwards taking it up.

Boundary: a ReloadOrder in; Staged weights, then the new WeightsState, out; WeightsRejected where the
checkpoint cannot replace the served weights (which are then untouched).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from service.engine.contract import (
    ReloadOrder,
    StagedWeights,
    Target,
    WeightsRejected,
    WeightsState,
)
from service.engine.loading import staging as weights
from service.engine.loading.checkpoint import Read, read_all, sliced
from service.engine.loading.critic import Critic, read_value_head
from service.engine.loading.names import Names
from service.engine.loading.names import of as names_of
from service.engine.loading.pretrained import text_part
from service.engine.parallel.sharding import Sharded
from service.engine.scorer.models import Served


def stage(served: Served, order: ReloadOrder, device: torch.device, sharded: Sharded | None) -> StagedWeights:
    """Read, check and place new weights for `order.target`; the served ones are untouched."""
    module, prefix, head = served.module(order.target), "", None
    if module is None:
        raise WeightsRejected(f"this server has no {order.target} model to reload")
    if order.target == "critic":
        prefix = f"{module.base_model_prefix}."
        if not order.path.is_dir():
            raise WeightsRejected(f"{order.path}: a critic reload needs the checkpoint directory")
        try:
            head = read_value_head(order.path, int(module.config.hidden_size), device)
        except (OSError, ValueError) as exc:
            raise WeightsRejected(str(exc)) from exc
    config: Any = text_part(module.config)
    read: Read = read_all
    if sharded is not None:  # this rank's slices, checked against the whole model's config
        config, read = sharded.configs[order.target], sliced(sharded.layouts[order.target].part)
    weights.check_config(order.path, config)
    mode = weights.choose_mode(order.mode, weights.module_bytes(module), device)
    return weights.stage(
        dataclasses.replace(order, mode=mode),
        module,
        prefix=prefix,
        allow_extra=lambda name: bool(prefix) and not name.startswith(prefix),  # the critic's heads
        extra=head,
        read=read,
    )


def apply(served: Served, staged: StagedWeights, previous: WeightsState) -> WeightsState:
    """Serve the staged weights from the next micro-batch on; the new state of their target. Engine
    thread only."""
    assert isinstance(staged, weights.Staged)
    target = staged.target
    weights.apply(staged)
    forward = served.forward(target)
    assert forward is not None  # a staged target is served
    forward.refresh()
    if target == "critic" and staged.extra is not None:  # a reload's value head (a push's is in place)
        assert served.critic is not None
        served.critic = Critic(served.critic.decoder, staged.extra)
    return WeightsState(target, staged.version, staged.source, staged.mode, time.time(), previous.reloads + 1)


def push_names(served: Served, target: Target, sharded: Sharded | None) -> Names:
    """The checkpoint names `target`'s pushed tensors take (loading/names.py): a critic's with its
    value head's; under tensor parallel, each with this rank's slice of it."""
    module = served.module(target)
    layout = sharded.layouts[target] if sharded is not None else None
    slicing: dict[str, Any] = {"slicer": layout.part, "whole": layout.whole} if layout is not None else {}
    if target != "critic":
        return names_of(module, **slicing)
    assert served.critic is not None
    prefix = f"{module.base_model_prefix}."
    return names_of(module, prefix=prefix, extra=served.critic.head.tensors(), **slicing)

"""Load one tensor-parallel rank's part of each model: built at its shard's sizes, never whole.

Each model is built from `Layout.config` (its heads, MLP columns and vocabulary rows) without
initialising its weights, its embedding and head swapped for the vocabulary-parallel ones
(parallel/vocab_layers.py), and its tensors read from the checkpoint one slice at a time (weights.load
with checkpoint.sliced). Which checkpoints can be sharded is checked before any rank loads
(tensor_parallel/replica.py); here only what the ranks cannot divide is refused.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from service.engine.loading import staging as weights
from service.engine.loading.checkpoint import sliced
from service.engine.loading.critic import Critic, read_value_head
from service.engine.loading.pretrained import LoadedModel, prepare, require_model_dir, text_config
from service.engine.parallel import vocab_layers
from service.engine.parallel.sharding import Layout, Shard

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Placement:
    """Where and how a rank's models run."""

    dtype: torch.dtype
    device: torch.device
    attn: str  # the attention implementation registered with transformers
    shard: Shard


def _build(auto_class: Any, config: Any, layout: Layout, place: Placement) -> Any:
    """The model of this rank's shard, its weights allocated on the device and not initialised."""
    from transformers.initialization import no_init_weights

    with no_init_weights(), torch.device(place.device):
        model = auto_class.from_config(
            layout.config(config), dtype=place.dtype, attn_implementation=place.attn
        )
    model.tie_weights()  # no_init_weights leaves a tied head untied
    vocab_layers.install(model, layout.vocab[0], layout.vocab_size, place.shard)
    return prepare(model, place.device)


def _layout(path: Path, role: str, shard: Shard) -> tuple[Layout, Any]:
    require_model_dir(path, role)
    config = text_config(path)
    try:
        return Layout.of(config, shard), config
    except ValueError as exc:
        raise ValueError(f"{role} {path}: cannot run tensor parallel: {exc}") from exc


def load_causal_lm(
    path: Path, name: str | None, place: Placement, role: str
) -> tuple[LoadedModel, Layout, Any]:
    """This rank's shard of the causal LM at `path`, its layout and the whole text config."""
    from transformers import AutoModelForCausalLM

    layout, config = _layout(path, role, place.shard)
    model = _build(AutoModelForCausalLM, config, layout, place)
    weights.load(path, model, read=sliced(layout.part))
    log.info(
        "rank %d of %d: loaded its shard of the %s from %s", place.shard.rank, place.shard.world, role, path
    )
    return LoadedModel(model, name or path.resolve().name, demo=False), layout, config


def load_critic(path: Path, place: Placement) -> tuple[Critic, Layout, Any]:
    """This rank's shard of the critic's decoder, and its (tiny, replicated) value head."""
    from transformers import AutoModel

    layout, config = _layout(path, "critic", place.shard)
    head = read_value_head(path, int(config.hidden_size), place.device)
    decoder = _build(AutoModel, config, layout, place)
    prefix = f"{decoder.base_model_prefix}."
    weights.load(
        path, decoder, prefix=prefix, allow_extra=lambda n: not n.startswith(prefix), read=sliced(layout.part)
    )
    return Critic(decoder, head), layout, config

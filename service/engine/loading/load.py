"""The one loading path: the configured models (policy, reference, critic), whole on one device or
this rank's shards of them (tensor parallel), read by a Loader of either kind.

Boundary: the EngineConfig's paths in (none: the demo policy); loaded transformers modules out, with,
for shards, each model's layout and whole config (a reload is checked against them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from service.engine.config import EngineConfig
from service.engine.contract import Target
from service.engine.loading import shards
from service.engine.loading.critic import Critic, load_critic
from service.engine.loading.pretrained import LoadedModel, load_model
from service.engine.parallel.sharding import Layout, Sharded


class Loader(Protocol):
    def causal_lm(self, path: Path | None, name: str | None, role: Target) -> LoadedModel:
        """The causal LM at `path` (None: the demo model, for the policy only)."""

    def critic(self, path: Path) -> Critic:
        """The critic at `path`: its decoder and value head."""

    def sharded(self) -> Sharded | None:
        """What the loaded shards need to be served (None: the models are whole)."""


@dataclass(frozen=True, slots=True)
class Whole:
    """Every model whole, on one device."""

    dtype: torch.dtype
    device: torch.device
    attn: str  # transformers' attention implementation name (ops/attention.py registers it)

    def causal_lm(self, path: Path | None, name: str | None, role: Target) -> LoadedModel:
        return load_model(path, name, self.dtype, self.device, self.attn, role=role)

    def critic(self, path: Path) -> Critic:
        return load_critic(path, self.dtype, self.device, self.attn)

    def sharded(self) -> Sharded | None:
        return None


@dataclass(slots=True)
class Shards:
    """This rank's shard of every model, built at its shard's sizes (loading/shards.py)."""

    place: shards.Placement
    layouts: dict[str, Layout] = field(default_factory=dict)
    configs: dict[str, Any] = field(default_factory=dict)

    def causal_lm(self, path: Path | None, name: str | None, role: Target) -> LoadedModel:
        if path is None:
            raise ValueError("tensor parallel serves a checkpoint, not the demo model")
        loaded, self.layouts[role], self.configs[role] = shards.load_causal_lm(path, name, self.place, role)
        return loaded

    def critic(self, path: Path) -> Critic:
        critic, self.layouts["critic"], self.configs["critic"] = shards.load_critic(path, self.place)
        return critic

    def sharded(self) -> Sharded | None:
        return Sharded(self.place.shard, self.layouts, self.configs)


@dataclass(frozen=True, slots=True)
class Models:
    """The configured models, loaded."""

    policy: LoadedModel
    reference: LoadedModel | None
    critic: Critic | None
    sharded: Sharded | None  # tensor parallel: what the shards need to be served


def load_models(config: EngineConfig, loader: Loader) -> Models:
    """Every model `config` names, by `loader`: the policy, then the reference and the critic."""
    policy = loader.causal_lm(config.model, config.model_name, "policy")
    reference = (
        loader.causal_lm(config.ref_model, None, "reference") if config.ref_model is not None else None
    )
    critic = loader.critic(config.critic) if config.critic is not None else None
    return Models(policy, reference, critic, loader.sharded())

"""What the routes share: settings, metrics and, once started, the engine and its batcher."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from service.batcher import Batcher
from service.core.errors import NotReady
from service.engine.contract import EngineInfo, Supervised, TokenText
from service.metrics import Metrics
from service.normalise import ModelLimits
from service.settings import Settings
from service.weights.push import Pusher
from service.weights.updates import Reloader


@dataclass(frozen=True, slots=True)
class Serving:
    """Everything a scoring request needs; exists only once the engine is warmed up."""

    info: EngineInfo
    limits: ModelLimits
    batcher: Batcher
    reloader: Reloader
    follower: asyncio.Task[None] | None = None  # follows settings.weights_follow
    supervised: Supervised | None = None  # an engine of several processes (tensor parallel)
    token_text: TokenText | None = None  # the checkpoint's tokenizer, for /v1/completions' token text
    pusher: Pusher | None = None  # weight pushes in SGLang's protocol (weight_sync.py)


@dataclass(slots=True)
class ServiceState:
    settings: Settings
    metrics: Metrics
    serving: Serving | None = None
    failure: str | None = None
    draining: bool = False
    url: str | None = None  # where the server listens (the ready line names it); None under tests

    @property
    def phase(self) -> str:
        if self.failure is not None:
            return "failed"
        if self.draining:
            return "draining"
        return "ready" if self.serving is not None else "loading"

    def require_serving(self) -> Serving:
        if self.serving is None or self.draining or self.failure is not None:
            raise NotReady(f"the model is not ready to score (state: {self.phase})")
        return self.serving

"""The engine contract, free of torch so that the HTTP side can depend on it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from service.jobs import SequenceJob, SequenceScores


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """One model of the engine: its role (policy, reference, critic) and what it costs."""

    role: str
    name: str
    architecture: str
    parameters: int
    memory_bytes: int


@dataclass(frozen=True, slots=True)
class EngineInfo:
    model: str
    demo: bool
    architecture: str
    dtype: str
    device: str
    attention_backend: str
    kernels: str
    vocab_size: int
    max_positions: int
    versions: dict[str, str]
    models: tuple[ModelInfo, ...] = ()

    @property
    def roles(self) -> frozenset[str]:
        return frozenset(m.role for m in self.models)


class OutOfMemory(RuntimeError):
    """The accelerator ran out of memory on a micro-batch; the engine has released what it could.

    The batcher answers by splitting the micro-batch and retrying the halves.
    """


class ScoringEngine(Protocol):
    """What the batcher needs: score one packed micro-batch. Called from one worker thread only."""

    @property
    def info(self) -> EngineInfo: ...

    def score(self, jobs: Sequence[SequenceJob]) -> list[SequenceScores]: ...

    def warm_up(self) -> None: ...

"""The real app over a real engine whose launches are recorded: for tests of what went into each
micro-batch (chunks of long sequences, shared prefixes)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

from fastapi.testclient import TestClient

from service.core.cache_plan import CachePlan
from service.core.jobs import Chunk
from service.core.prefixes import Forest
from service.engine import ScoringEngine, load_engine
from service.engine.config import EngineConfig
from service.engine.scorer.engine import PackedScorer
from service.http.app import create_app
from service.settings import Settings
from tests.support.servers import wait_ready


@dataclass(frozen=True, slots=True)
class Launch:
    """One micro-batch the engine launched: how many whole sequences, its chunk, its forest, its plan of
    the prefix cache."""

    jobs: int
    chunk: Chunk | None
    forest: Forest | None
    cache: CachePlan | None = None


@dataclass
class Served:
    """A running app, its engine, and every micro-batch the engine launched since it was ready."""

    client: TestClient
    engine: PackedScorer
    launches: list[Launch] = field(default_factory=list)

    def chunks(self, since: int = 0) -> list[Chunk]:
        return [launch.chunk for launch in self.launches[since:] if launch.chunk is not None]

    def forests(self, since: int = 0) -> list[Forest]:
        return [launch.forest for launch in self.launches[since:] if launch.forest is not None]


@contextmanager
def serve(settings: Settings, delay_s: float = 0.0) -> Iterator[Served]:
    """The app on `settings`, recording the engine's launches (each delayed by `delay_s`)."""
    box: list[Served] = []

    def factory(s: EngineConfig) -> ScoringEngine:
        engine = load_engine(s)
        assert isinstance(engine, PackedScorer)
        launch = engine.launch

        def recording(
            jobs: Any,
            chunk: Chunk | None = None,
            forest: Forest | None = None,
            cache: CachePlan | None = None,
        ) -> Any:
            box[0].launches.append(Launch(len(jobs), chunk, forest, cache))
            if delay_s:
                time.sleep(delay_s)
            return launch(jobs, chunk, forest, cache)

        engine.launch = recording  # type: ignore[method-assign]
        box[0].engine = engine
        return engine

    # the holder exists before the app starts: the factory may finish before the client is entered
    box.append(Served(cast(TestClient, None), cast(PackedScorer, None)))
    with TestClient(create_app(settings, engine_factory=factory)) as client:
        box[0].client = client
        wait_ready(client)
        box[0].launches.clear()  # the warm-up's
        yield box[0]

"""The model side: an EngineConfig in, a ScoringEngine out (contract.py), whose micro-batches go
loading/ -> batch/ -> decoder/ (ops/, moe/, strategies/) -> heads/, run by scorer/ (parallel/ over
several ranks). docs/performance.md maps it folder by folder.

The only package that imports torch and transformers, and it never reads the service's settings or
the HTTP side (make lint checks it). Importing it is cheap: heavy imports happen in `load_engine`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from service.engine.contract import EngineInfo, ModelInfo, OutOfMemory, ScoringEngine, Supervised

if TYPE_CHECKING:
    from service.engine.config import EngineConfig

__all__ = ["EngineInfo", "ModelInfo", "OutOfMemory", "ScoringEngine", "Supervised", "load_engine"]


def load_engine(config: EngineConfig) -> ScoringEngine:
    """Load the configured model (or the demo model) and return a ready-to-warm engine."""
    if config.tensor_parallel_size > 1:
        from service.engine.parallel import ranks as parallel

        return parallel.load(config)
    from service.engine.scorer.engine import PackedScorer

    return PackedScorer.from_config(config)

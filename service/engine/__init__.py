"""The model side: loading, packing, attention backends and the log-prob kernels.

The only package that imports torch and transformers. Importing it is cheap: heavy imports happen
in `load_engine`.
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

"""The model side: an EngineConfig in, a ScoringEngine out (contract.py). Its rooms, from the top;
each imports only rooms below it (the engine's layers contract in pyproject.toml; `lint-imports`):

    tensor_parallel/               one ScoringEngine over several ranks, each running a scorer
    scorer/                        the ScoringEngine: loads the models, packs, runs and scores each
                                   micro-batch
    transfer/                      weights a trainer pushes over a process group (SGLang's protocol)
    heads/                         the action rows' scores from the decoder's last hidden state
    decoder/                       a forward over one packed row, built on the three rooms below:
    moe/                             the mixture-of-experts layers
    ops/                             the kernels: attention, norms, RoPE, the gate|up projection
    strategies/                      how GEMMs over tokens run and row-parallel sums add
    batch/                         a micro-batch on the device: jobs packed into one row, its keys and
                                   values, what its rows ask, its MoE routes
    cache/                         the prefix cache's pools and a micro-batch's reads and writes of them
    loading/                       the models from local checkpoints, whole or as a rank's shards
    parallel/                      tensor parallel's plan: a rank's slices, the collectives joining them
    runtime/ | tokenizer | config  what this host can run; the tokenizer; the EngineConfig (`|`: one
                                   level, none of the three importing another)
    contract.py                    the interface to the batcher, free of torch

A micro-batch goes loading/ -> batch/ -> decoder/ -> heads/, run by scorer/ (tensor_parallel/ over
several ranks); docs/architecture.md maps it folder by folder. The only package that imports torch
and transformers, and it never reads the service's settings or the HTTP side (make lint checks it).
Importing it is cheap: heavy imports happen in `load_engine`.
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
        from service.engine.tensor_parallel import ranks

        return ranks.load(config)
    from service.engine.scorer.engine import PackedScorer

    return PackedScorer.from_config(config)

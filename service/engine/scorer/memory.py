"""Warm-up and memory: every GEMM shape a micro-batch can take met before serving, how many tokens the
prefix cache holds (the setting's, or a share of the memory left beside the weights and a
micro-batch's measured working set), and how long a sequence the engine scores (what the model's
positions cover, what the memory left after the cache holds of one key/value store per model beside
the working set, and what the setting asks).

Boundary: the served models, the device and measured bytes in; pool slots, max_sequence_tokens and
what sets it out.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from service.core.cache_plan import BLOCK
from service.engine.batch.kv_store import cache_bytes_per_token
from service.engine.batch.packing import SHAPE_STEP
from service.engine.cache import pool
from service.engine.config import EngineConfig
from service.engine.loading.pretrained import text_part
from service.engine.parallel.sharding import Shard
from service.engine.scorer.models import Served

log = logging.getLogger(__name__)

# Share of the accelerator's memory the engine plans to use (the rest: fragmentation, the CUDA context)
MEMORY_FRACTION = 0.95


def max_positions(config: Any) -> int:
    """The longest sequence `config`'s positions cover, with its rope scaling (YaRN, linear, dynamic:
    original_max_position_embeddings x factor where that is more)."""
    positions = int(getattr(config, "max_position_embeddings", 0) or 0)
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if isinstance(rope, dict) and isinstance(rope.get("factor"), int | float):
        original = int(rope.get("original_max_position_embeddings") or positions)
        positions = max(positions, int(original * float(rope["factor"])))
    return positions or 1 << 30


def longest(positions: int, memory: int | None, setting: int | None) -> dict[str, Any]:
    """max_sequence_tokens and what sets it: the positions, the memory (None: not measured) or the
    setting (an explicit max_sequence_tokens below both; above the memory it fails the start)."""
    if setting is not None and memory is not None and setting > memory and setting <= positions:
        raise RuntimeError(
            f"max_sequence_tokens={setting}: this accelerator's memory holds the keys and values of "
            f"sequences of at most {memory} tokens beside the models and a micro-batch"
        )
    limits = [(positions, "positions")]
    if memory is not None:
        limits.append((memory, "memory"))
    if setting is not None:
        limits.append((setting, "setting"))
    tokens, limit = min(limits, key=lambda item: item[0])
    return {"max_sequence_tokens": tokens, "max_sequence_limit": limit}


# The prefix cache's tokens where the setting gives none and no accelerator memory is measured (CPU)
CPU_CACHE_TOKENS = 1 << 16


def room(device: torch.device, working: int) -> int:
    """The bytes of the accelerator's planned share not allocated yet, less `working` (a micro-batch's
    work beyond what is allocated, measured) and what other processes and the CUDA context hold."""
    free, total = torch.cuda.mem_get_info(device)
    elsewhere = total - free - torch.cuda.memory_reserved(device)  # other processes, the context
    return int(total * MEMORY_FRACTION) - elsewhere - torch.cuda.memory_allocated(device) - working


def cache_slots(models: Sequence[Any], device: torch.device, config: EngineConfig, working: int) -> int:
    """Slots (of core.prefix_cache.BLOCK tokens) of every model's prefix-cache pool: the setting's
    tokens; else on a GPU, config.prefix_cache_memory_fraction of the `room` left beside `working`,
    over what a token costs every model's pool; else CPU_CACHE_TOKENS."""
    per_token = sum(pool.bytes_per_token(text_part(m.config), next(m.parameters()).dtype) for m in models)
    if config.prefix_cache_tokens is not None:
        tokens = config.prefix_cache_tokens
    elif device.type == "cuda":
        tokens = int(config.prefix_cache_memory_fraction * max(0, room(device, working)) / per_token)
    else:
        tokens = CPU_CACHE_TOKENS
    return tokens // BLOCK


def fewest(slots: int, shard: Shard, device: torch.device) -> int:
    """The fewest slots any rank of a tensor-parallel replica holds (each rank asks its own memory)."""
    count = torch.tensor([-slots], dtype=torch.int64, device=device)
    shard.all_reduce_max_(count)
    return -int(count.item())


def tokens_that_fit(served: Served, device: torch.device, working: int, step: int) -> int:
    """The longest sequence whose stores (one per model, each `step` tokens past the sequence for a
    chunk's filler) fit in the accelerator's memory beside what is allocated and `working` bytes (a
    micro-batch of two full chunks, measured); logs what a store costs a token."""
    left = room(device, working)
    models = served.cached_models()
    per_token = sum(cache_bytes_per_token(text_part(m.config), next(m.parameters()).dtype) for m in models)
    layers = min(int(text_part(m.config).num_hidden_layers) for m in models)
    # one store per model, and a layer's keys and values copied once more while it attends
    fits = max(0, int(left / (per_token * (1 + 2 / layers))) - step)
    log.info("a store costs %.1f KiB a token, %.1f GiB free for them", per_token / 1024, left / (1 << 30))
    return fits


@torch.inference_mode()
def meet_shapes(served: Served, device: torch.device, max_tokens: int) -> None:
    """Run every GEMM shape a micro-batch can take, once (packing pads its token and action counts to
    multiples of SHAPE_STEP): cuBLAS stalls the host, holding the GIL, until the device is idle the
    first time it meets some shapes; on a live server that starves the event loop."""
    started = time.perf_counter()
    most = -(-max_tokens // SHAPE_STEP) * SHAPE_STEP
    for rows in range(SHAPE_STEP, most + 1, SHAPE_STEP):
        for forward in served.forwards():
            forward.warm(rows)
        if served.critic is not None:
            head = served.critic.head
            head(torch.zeros(rows, head.weight.shape[1], dtype=head.weight.dtype, device=device))
    for lm in served.causal_lms():
        lm.warm_head(SHAPE_STEP)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    log.info("met the GEMM shapes of up to %d tokens in %.1f s", most, time.perf_counter() - started)

"""One replica's ranks before they serve: whether the settings and every checkpoint can run tensor
parallel (`check`, before any process starts), each rank's device and collectives backend, joining
the process group, and each rank's PackedScorer over its shards (loading/shards.py).

Boundary: an EngineConfig in; a ValueError naming what cannot be sharded, or per rank its Shard of the
joined group and its PackedScorer.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from service.engine.config import EngineConfig
from service.engine.decoder.fused import SUPPORTED
from service.engine.loading import shards as sharded
from service.engine.loading.load import Shards, load_models
from service.engine.loading.pretrained import (
    require_model_dir,
    resolve_device,
    resolve_dtype,
    text_config,
    text_part,
)
from service.engine.ops.attention import choose_backend, register
from service.engine.parallel.sharding import Layout, Shard
from service.engine.scorer.engine import PackedScorer

# a collective that waits longer than this for a peer fails (a peer busy meeting GEMM shapes or
# staging weights is never that far behind)
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
# NCCL's NVLink multicast (NVLS) and symmetric-memory multicast stay off in every rank, unless the
# operator set them: they need a fabric manager set-up that GPU hosts often lack, and fail late.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def check(config: EngineConfig) -> None:
    """Raise ValueError where the settings (`refusal`) or a configured checkpoint cannot run tensor
    parallel."""
    reason = refusal(config)
    if reason is not None:
        raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size}: {reason}")
    models = (("policy", config.model), ("reference", config.ref_model), ("critic", config.critic))
    for role, path in models:
        if path is not None:
            require_model_dir(path, role)
            why = checkpoint_refusal(text_config(path), config.tensor_parallel_size)
            if why is not None:
                raise ValueError(f"{role} {path}: cannot run tensor parallel: {why}")


def refusal(config: EngineConfig) -> str | None:
    """Why `config` cannot run tensor parallel (checked before any process starts); None: they can."""
    if config.model is None:
        return "the demo model is not sharded; give --model"
    if config.decoder == "transformers" or config.kernels == "liger":
        return "tensor parallel runs logprobd's fused decoder (not decoder=transformers or kernels=liger)"
    if config.cuda_graphs == "on":
        return "cuda_graphs=on: CUDA graphs are not captured under tensor parallel yet"
    if config.batch_invariant:
        return "batch_invariant: the all-reduces' sums are not batch-invariant"
    device = resolve_device(config.device)
    if device.type == "cpu" and config.tensor_parallel_collectives == "nccl":
        return "tensor_parallel_collectives=nccl runs on GPUs; on CPU the ranks use gloo"
    shared = collectives_backend(config, device) == "gloo"  # gloo ranks may share a GPU
    if device.type == "cuda" and not shared and torch.cuda.device_count() < config.tensor_parallel_size:
        seen = torch.cuda.device_count()
        return f"{config.tensor_parallel_size} ranks need as many GPUs; this process sees {seen}"
    return None


def checkpoint_refusal(config: Any, world: int) -> str | None:
    """Why a model of `config` cannot run over `world` ranks; None when it can."""
    if text_part(config) is not config:
        return "a multimodal checkpoint (tensor parallel shards text-only causal LMs)"
    if getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None):
        return "a mixture-of-experts model (tensor parallel shards dense layers; experts are not split yet)"
    model_type = str(getattr(config, "model_type", None))
    if model_type not in SUPPORTED:
        return (
            f"model_type {model_type!r}: tensor parallel runs logprobd's fused decoder, which runs "
            f"{', '.join(SUPPORTED)} only"
        )
    try:
        Layout.of(config, Shard(0, world))
    except ValueError as exc:
        return str(exc)
    return None


def collectives_backend(config: EngineConfig, device: torch.device) -> str:
    """The process group's backend: nccl on GPUs unless gloo is asked for; gloo on CPU."""
    if config.tensor_parallel_collectives == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    return config.tensor_parallel_collectives


def device_of(config: EngineConfig, rank: int) -> torch.device:
    """A rank's device: GPU `rank` (under gloo, ranks past the GPUs share them, round robin)."""
    device = resolve_device(config.device)
    return torch.device("cuda", rank % torch.cuda.device_count()) if device.type == "cuda" else device


def join(config: EngineConfig, rank: int, store: Path, device: torch.device) -> Shard:
    """Join the replica's process group through the file store at `store` (every rank calls it; it
    returns once all have)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = collectives_backend(config, device)
    world = config.tensor_parallel_size
    dist.init_process_group(
        backend,
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=COLLECTIVE_TIMEOUT,
        device_id=device if backend == "nccl" else None,
    )
    return Shard(rank, world)


def load_scorer(config: EngineConfig, shard: Shard) -> PackedScorer:
    """This rank's PackedScorer over its shards of the configured models."""
    assert config.model is not None
    device = device_of(config, shard.rank)
    dtype = resolve_dtype(config.dtype, device)
    attention = choose_backend(config.attention, device)
    attn = register(attention)
    models = load_models(config, Shards(sharded.Placement(dtype, device, attn, shard)))
    return PackedScorer(
        models.policy,
        device,
        attention,
        config,
        reference=models.reference,
        critic=models.critic,
        sharded=models.sharded,
    )

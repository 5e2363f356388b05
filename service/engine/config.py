"""EngineConfig: everything the engine reads of the service's settings, resolved once at the boundary.

`Settings.engine_config()` builds it; the engine never imports `service.settings`. Free of torch, and
picklable: tensor-parallel ranks receive it as their whole configuration. The choice types (Device,
Attention, ...) are defined here and reused by the settings, so the two cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Device = Literal["auto", "cpu", "cuda"]
DType = Literal["auto", "float32", "bfloat16", "float16"]
Attention = Literal["auto", "flash_attn_cute", "flash_attn", "torch_varlen", "sdpa"]
Kernels = Literal["auto", "liger", "none"]
MlpKernel = Literal["auto", "split", "quack"]
MoeKernel = Literal["auto", "quack", "grouped_mm", "loop"]
HeadKernel = Literal["auto", "chunked", "quack"]
CudaGraphs = Literal["auto", "on", "off"]
DecoderSetting = Literal["auto", "fused", "transformers"]
LogLevel = Literal["debug", "info", "warning", "error"]
Collectives = Literal["auto", "nccl", "gloo"]

# max_batch_tokens where it is unset: a micro-batch's token budget, and a mixture of experts' on a GPU,
# whose rounds then take fewer micro-batches (each expert's last GEMM tile of a micro-batch runs part
# filled; a Qwen3-30B-A3B standard round took 2.4 % less time on an H200 than at 16,384, its peak memory
# 0.5 GiB more: benchmarks/results/h200-2026-11-30-s66)
BATCH_TOKENS = 16384
MOE_BATCH_TOKENS = 24576


def batch_budget(setting: int | None, *, moe_on_gpu: bool) -> int:
    """The micro-batch token budget: max_batch_tokens as set, else BATCH_TOKENS (MOE_BATCH_TOKENS for a
    policy with sparse layers on a GPU)."""
    if setting is not None:
        return setting
    return MOE_BATCH_TOKENS if moe_on_gpu else BATCH_TOKENS


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """The models to serve and how to run them; each field is the setting of the same name (its
    default and its meaning are there)."""

    model: Path | None  # None: the built-in demo model
    model_name: str | None
    ref_model: Path | None
    critic: Path | None
    weights_version: str
    ref_weights_version: str
    critic_weights_version: str
    device: Device
    dtype: DType
    attention: Attention
    decoder: DecoderSetting
    kernels: Kernels
    mlp_kernel: MlpKernel
    moe_kernel: MoeKernel
    head_kernel: HeadKernel
    mlp_chunk_tokens: int | None  # None: auto
    logits_chunk_rows: int
    cuda_graphs: CudaGraphs
    cuda_graph_limit: int
    max_batch_tokens: int | None  # None: batch_budget's default for the policy and the device
    max_sequence_tokens: int | None  # None: what the positions and the memory allow
    batch_invariant: bool
    prefix_cache: bool
    prefix_cache_tokens: int | None  # None: a share of the memory left (GPU), memory.CPU_CACHE_TOKENS (CPU)
    prefix_cache_memory_fraction: float
    tensor_parallel_size: int
    tensor_parallel_collectives: Collectives
    log_level: LogLevel  # the tensor-parallel ranks' own logging

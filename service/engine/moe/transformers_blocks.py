"""transformers' own sparse blocks in batch-invariant mode (the transformers decoder's; the fused
decoder runs layer.py's SparseMoe instead): a token gets the same bits however it is batched.

Each block runs over a fixed number of tokens at a time, and its experts module computes transformers'
`grouped_mm` arithmetic with the grouped GEMMs of grouped_gemm.py at fixed shapes:

    hidden_states [T, H], top_k_index / top_k_weights [T, k] -> [T, H]

Boundary: a transformers model in, its sparse blocks' forwards patched in place; a RuntimeError where
an experts module runs its own code (not one of transformers' `use_experts_implementation` modules).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from service.engine.moe import grouped_gemm
from service.engine.moe import kernels as moe_ops
from service.engine.moe.dispatch import by_expert


def block_sparse(model: Any, rows: int) -> int:
    """Make every sparse block of `model` (transformers' modules, for the transformers decoder) give a
    token the same bits however it is batched; returns how many blocks.

    The block runs over `rows` tokens at a time (its router's GEMM then has one shape; a block is
    token-wise, so this is the same function), and its experts module computes transformers'
    `grouped_mm` arithmetic with GEMM calls of fixed shapes (`_experts`): on CUDA one grouped GEMM
    over the block's rows·k rows, elsewhere the loop in EXPERT_ROWS-row calls. Raises where an
    experts module is not one of transformers' `use_experts_implementation` modules (its own code,
    whose GEMMs this cannot reach)."""
    count = 0
    for module in model.modules():
        experts = getattr(module, "experts", None)
        if not isinstance(experts, torch.nn.Module):
            continue
        if not all(hasattr(experts, name) for name in ("has_gate", "has_bias", "is_transposed", "down_proj")):
            raise RuntimeError(
                f"batch_invariant: the experts of {type(module).__name__} run their own code, whose GEMMs "
                "the batch-invariant mode cannot fix (it covers transformers' use_experts_implementation "
                "modules, and the fused decoder's Qwen3-MoE, Qwen2-MoE and Mixtral)"
            )
        device = experts.down_proj.device
        grouped = grouped_gemm.grouped_mm_function() if device.type == "cuda" else None
        kernel = (
            grouped_gemm.MoeKernel("grouped_mm", grouped_gemm.grouped_matmul(grouped))
            if grouped is not None
            else grouped_gemm.blocked(grouped_gemm.LOOP)
        )
        experts.forward = functools.partial(_experts, experts, kernel)
        module.forward = functools.partial(_in_blocks, module.forward, rows)
        count += 1
    return count


def _in_blocks(
    forward: Callable[..., Any], rows: int, hidden_states: torch.Tensor, *args: Any, **kwargs: Any
) -> Any:
    """A sparse block's forward over hidden_states [..., H] as calls of `rows` tokens [1, rows, H] where
    the tokens are a multiple of `rows` (the packed row in batch-invariant mode), else one call. A
    tuple's tensors (router logits [tokens, E]) are joined along their first dimension."""
    flat = hidden_states.reshape(-1, hidden_states.shape[-1])
    n = flat.shape[0]
    if n <= rows or n % rows:
        return forward(hidden_states, *args, **kwargs)
    parts = [forward(flat[start : start + rows].unsqueeze(0), *args, **kwargs) for start in range(0, n, rows)]
    if isinstance(parts[0], torch.Tensor):
        return torch.cat([p.reshape(rows, -1) for p in parts]).reshape(hidden_states.shape)
    first = torch.cat([p[0].reshape(rows, -1) for p in parts]).reshape(hidden_states.shape)
    rest = [
        torch.cat(list(column)) if isinstance(column[0], torch.Tensor) else column[0]
        for column in zip(*(p[1:] for p in parts), strict=True)
    ]
    return (first, *rest)


def _experts(
    module: Any,
    kernel: grouped_gemm.MoeKernel,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """transformers' `grouped_mm` experts forward (hidden_states [T, H], top_k_index and top_k_weights
    [T, k] -> [T, H]) with `kernel`'s grouped GEMMs: the slots grouped by expert (dispatch.by_expert), gate|up
    (or up) GEMM + bias, the module's own gate or activation, down GEMM + bias, each token's k rows
    weighted and summed in slot order (`moe_ops.combine_torch`)."""
    route = by_expert(top_k_weights, top_k_index, module.down_proj.shape[0])
    x = hidden_states.index_select(0, route.rows)
    ids = None  # each grouped row's expert, for the biases
    if module.has_bias:
        grouped = torch.arange(x.shape[0], device=x.device, dtype=route.groups.ends.dtype)
        ids = torch.searchsorted(route.groups.ends, grouped, right=True)

    def linear(x: torch.Tensor, name: str) -> torch.Tensor:
        weight = getattr(module, name)  # [E, out, in], or [E, in, out] where is_transposed
        out = kernel.matmul(
            x.to(weight.dtype), weight.transpose(1, 2) if module.is_transposed else weight, route.groups
        )
        return out + getattr(module, f"{name}_bias")[ids] if ids is not None else out

    if module.has_gate:
        act = module._apply_gate(linear(x, "gate_up_proj"))
    else:
        act = module.act_fn(linear(x, "up_proj"))
    out = torch.zeros_like(hidden_states)
    moe_ops.combine_torch(out, linear(act, "down_proj"), route.slots, top_k_weights, None)
    return out

"""Tiny random-weight models of every supported architecture, saved like real checkpoints.

ARCHITECTURES are the dense ones every suite runs; MOE_ARCHITECTURES the mixtures of experts, which
the parity suite and the MoE tests run (8 or 4 experts, top-2; Qwen3-MoE's first layer is dense).

Weights are drawn wider than the usual init so that log-probs depend strongly on the context: a
packing or masking mistake then moves scores far beyond the 1e-4 tolerance.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

VOCAB = 96
COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "initializer_range": 0.15,
}


def configs(**overrides: Any) -> dict[str, Any]:
    """name -> a config; sliding windows and soft-caps are small so they matter at test lengths.
    `overrides` replace entries of COMMON (e.g. max_position_embeddings for long sequences)."""
    from transformers import (
        Gemma2Config,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    common = {**COMMON, **overrides}
    return {
        "qwen2": Qwen2Config(
            **common, use_sliding_window=True, sliding_window=7, max_window_layers=1, tie_word_embeddings=True
        ),
        "qwen3": Qwen3Config(**common, head_dim=16),
        "llama": LlamaConfig(**common),
        "mistral": MistralConfig(**common, sliding_window=6),
        "gemma2": Gemma2Config(
            **common,
            head_dim=16,
            sliding_window=5,
            query_pre_attn_scalar=16,
            attn_logit_softcapping=3.0,
            final_logit_softcapping=2.0,
        ),
        "phi3": Phi3Config(**common, sliding_window=6),
        "qwen3_moe": Qwen3MoeConfig(  # head_dim: hidden / heads = 16
            **common,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[0],
        ),
        "mixtral": MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2, sliding_window=6),
        "qwen2_moe": Qwen2MoeConfig(
            **common,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            norm_topk_prob=False,
        ),
    }


MOE_ARCHITECTURES = ("qwen3_moe", "mixtral", "qwen2_moe")
ARCHITECTURES = tuple(name for name in configs() if name not in MOE_ARCHITECTURES)
EVERY = ARCHITECTURES + MOE_ARCHITECTURES


def build(name: str, seed: int = 0, **overrides: Any) -> Any:
    """A random-weight model; `overrides` replace entries of COMMON in its config."""
    from transformers import AutoModelForCausalLM

    config = configs(**overrides)[name]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            config, attn_implementation="eager", dtype=torch.float32
        )
    return model.eval()


def save(name: str, directory: Path, seed: int = 0, **overrides: Any) -> Path:
    build(name, seed, **overrides).save_pretrained(directory, safe_serialization=True)
    return directory

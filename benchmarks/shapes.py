"""The model shapes the benchmarks build with random weights (config.json of each checkpoint): weights
are random, shapes are what cost time. No torch here: the CPU tests read them too.

`SHAPES`: dense Qwen2.5 models (transformers' Qwen2Config), `TP_SHAPES` the dense ones too large for
one GPU (benchmarks.tp); `MOE_SHAPES`: mixtures of experts, each with its `family` (qwen3_moe:
Qwen3MoeConfig, mixtral: MixtralConfig). `tiny` and `tiny-moe` are for the CPU smoke tests only.
"""

from __future__ import annotations

from typing import Any

SHAPES: dict[str, dict[str, int | bool]] = {
    "qwen2.5-0.5b": {
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "qwen2.5-1.5b": {
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "qwen2.5-7b": {
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
    },
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 512,
        "tie_word_embeddings": True,
    },
}

TP_SHAPES: dict[str, dict[str, int | bool]] = {  # too large for one GPU: benchmarks.tp
    "qwen2.5-32b": {  # two GPUs
        "hidden_size": 5120,
        "intermediate_size": 27648,
        "num_hidden_layers": 64,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
    },
    "qwen2.5-72b": {  # four GPUs
        "hidden_size": 8192,
        "intermediate_size": 29568,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
    },
}

_QWEN3_30B_A3B: dict[str, Any] = {  # Qwen/Qwen3-30B-A3B config.json
    "family": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "vocab_size": 151936,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
MOE_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b": _QWEN3_30B_A3B,  # 61 GB of weights
    "qwen3-30b-a3b-8l": {**_QWEN3_30B_A3B, "num_hidden_layers": 8},
    "mixtral-8l": {  # Mixtral-8x7B's layer, 8 of them: 11.6B parameters
        "family": "mixtral",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 8,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "vocab_size": 32000,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    },
    "tiny-moe": {
        "family": "qwen3_moe",
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "vocab_size": 512,
        "tie_word_embeddings": True,
    },
}


def shape_of(name: str) -> dict[str, Any]:
    """A copy of `name`'s shape, dense or a mixture of experts."""
    return dict(MOE_SHAPES[name] if name in MOE_SHAPES else SHAPES[name])


def floor_shape(shape: dict[str, Any]) -> dict[str, int | bool]:
    """What workload.floor_flops reads of a shape: its attention width is heads · head_dim where the
    shape gives a head_dim (the MoE shapes), the hidden size otherwise."""
    out: dict[str, int | bool] = {
        "hidden_size": int(shape["hidden_size"]),
        "num_hidden_layers": int(shape["num_hidden_layers"]),
        "vocab_size": int(shape["vocab_size"]),
    }
    if "head_dim" in shape:
        out["attention_width"] = int(shape["num_attention_heads"]) * int(shape["head_dim"])
    return out

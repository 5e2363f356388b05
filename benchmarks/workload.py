"""The benchmark workload and its FLOP floor (no torch: shared by the GPU run and the CPU smoke test)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from service.jobs import SequenceJob

# The real shapes (config.json of each checkpoint): weights are random, shapes are what cost time.
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
    # CPU smoke test only
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


@dataclass(frozen=True, slots=True)
class Sample:
    prompt: list[int]
    response: list[int]

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.response


def workload(
    vocab: int,
    *,
    sequences: int = 64,
    prompt_range: tuple[int, int] = (256, 1024),
    response_mean: float = 250.0,
    response_clip: tuple[int, int] = (16, 1024),
    seed: int = 0,
) -> list[Sample]:
    """Prompt length uniform in prompt_range; response exponential(mean), clipped; fixed seed."""
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(sequences):
        p = int(rng.integers(prompt_range[0], prompt_range[1] + 1))
        r = int(np.clip(round(rng.exponential(response_mean)), *response_clip))
        tokens = rng.integers(0, vocab, size=p + r).tolist()
        samples.append(Sample(prompt=tokens[:p], response=tokens[p:]))
    return samples


def jobs(samples: list[Sample]) -> list[SequenceJob]:
    """The service's jobs: the response is the action window."""
    return [
        SequenceJob(
            tokens=np.asarray(s.tokens, dtype=np.int64),
            actions=np.arange(len(s.prompt), len(s.tokens), dtype=np.int64),
            temperature=1.0,
            return_entropy=False,
        )
        for s in samples
    ]


def floor_flops(shape: dict[str, int | bool], non_embedding_params: int, samples: list[Sample]) -> float:
    """2·params·tokens + 2·vocab·hidden·actions + causal attention (QKᵀ and PV over L²/2 pairs)."""
    hidden, layers, vocab = (
        int(shape["hidden_size"]),
        int(shape["num_hidden_layers"]),
        int(shape["vocab_size"]),
    )
    tokens = sum(len(s.tokens) for s in samples)
    actions = sum(len(s.response) for s in samples)
    attention = sum(2.0 * layers * hidden * len(s.tokens) ** 2 for s in samples)
    return 2.0 * non_embedding_params * tokens + 2.0 * vocab * hidden * actions + attention

"""MLP token chunking: same outputs, bounded intermediates, MoE-style outputs left alone."""

from __future__ import annotations

from typing import Any

import torch

from service.engine.decoder.mlp_chunks import ACTIVATION_BYTES, chunk_mlps, resolve_tokens
from tests.support import models


def test_chunked_model_gives_identical_hidden_states() -> None:
    plain, chunked = models.build("llama"), models.build("llama")
    assert chunk_mlps(chunked, 4) == 2  # one MLP per decoder layer
    assert chunk_mlps(chunked, 4) == 0  # idempotent
    ids = torch.arange(3, 40)[None]
    with torch.inference_mode():
        a = plain(input_ids=ids).logits
        b = chunked(input_ids=ids).logits
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_non_tensor_outputs_fall_back_to_one_call() -> None:
    class RouterMLP(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x * 2, x.sum(-1)

    holder = torch.nn.Module()
    holder.mlp = RouterMLP()
    chunk_mlps(holder, 2)
    out, router = holder.mlp(torch.ones(1, 7, 3))
    assert out.shape == (1, 7, 3)
    assert router.shape == (1, 7)


def test_unset_chunk_keeps_gate_up_activations_within_the_bound() -> None:
    from transformers import Qwen2Config

    from benchmarks.shapes import SHAPES

    def config(name: str) -> Any:
        return Qwen2Config(**dict(SHAPES[name]))  # type: ignore[arg-type]

    def chunk(name: str, dtype: torch.dtype = torch.bfloat16) -> int:
        return resolve_tokens(None, config(name), dtype)

    assert chunk("qwen2.5-0.5b") >= 16384  # a whole default micro-batch: 311 MiB there
    assert chunk("qwen2.5-1.5b") >= 16384  # 560 MiB
    assert chunk("qwen2.5-7b") == 8192  # 16k tokens would hold 1184 MiB
    assert chunk("qwen2.5-7b", torch.float32) == 4096
    for name in SHAPES:
        tokens, intermediate = chunk(name), int(SHAPES[name]["intermediate_size"])
        assert tokens % 1024 == 0
        assert tokens * 2 * intermediate * 2 <= ACTIVATION_BYTES < (tokens + 1024) * 2 * intermediate * 2
    assert resolve_tokens(0, config("qwen2.5-7b"), torch.bfloat16) == 0  # set: as set
    assert resolve_tokens(5, Qwen2Config(), torch.bfloat16) == 5

"""MLP token chunking: same outputs, bounded intermediates, MoE-style outputs left alone."""

from __future__ import annotations

import torch

from service.engine.chunking import chunk_mlps
from tests import models


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

"""Tensor parallel's layout (parallel/sharding.py): every rank's slices of each tensor joined give the
whole tensor; what the ranks cannot divide is refused, naming it."""

from __future__ import annotations

import itertools

import pytest

from service.engine.parallel import sharding


def test_layout_slices_cover_every_tensor_once() -> None:
    """Concatenating every rank's slice of each sharded tensor gives the whole tensor."""
    from transformers import Qwen2Config

    config = Qwen2Config(
        vocab_size=90, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2
    )
    world, d = 2, 16
    shapes = {
        "model.layers.0.self_attn.q_proj.weight": (4 * d, 64),
        "model.layers.0.self_attn.k_proj.bias": (2 * d,),
        "model.layers.0.self_attn.o_proj.weight": (64, 4 * d),
        "model.layers.0.mlp.up_proj.weight": (96, 64),
        "model.layers.0.mlp.down_proj.weight": (64, 96),
        "lm_head.weight": (90, 64),
    }
    layouts = [sharding.Layout.of(config, sharding.Shard(r, world)) for r in range(world)]
    for name, shape in shapes.items():
        parts = [layout.part(name) for layout in layouts]
        dims = {p[0] for p in parts if p is not None}
        assert len(dims) == 1, name
        (dim,) = dims
        spans = [(p[1], p[2]) for p in parts if p is not None]
        assert spans[0][0] == 0
        assert spans[-1][1] == shape[dim]
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans)), name
    assert layouts[0].part("model.layers.0.input_layernorm.weight") is None  # replicated
    with pytest.raises(ValueError, match="does not divide the 2 key/value heads"):
        sharding.Layout.of(config, sharding.Shard(0, 4))

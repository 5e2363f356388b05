"""Checkpoint names onto served tensors (loading/names.py): every tensor a Hugging Face checkpoint of
each architecture holds lands where transformers' own loading puts it (experts per expert into the
fused 3-D tensors, Mixtral's block_sparse_moe, tied and prefixed names); and a mixture-of-experts
checkpoint reloads into a served model, whose scores are then the new checkpoint's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from service.engine.contract import ReloadOrder
from service.engine.loading.names import WHOLE
from service.engine.loading.names import of as names_of
from service.engine.scorer.engine import PackedScorer
from tests.engine.loading.test_reload import _jobs, _reference
from tests.support import models
from tests.support.device import TOLERANCE, eager, settings_for


@pytest.mark.parametrize("arch", models.EVERY)
def test_every_checkpoint_tensor_lands_where_transformers_puts_it(arch: str, tmp_path: Path) -> None:
    path = models.save(arch, tmp_path / arch, seed=4)
    loaded: Any = eager(path)  # transformers' own conversion of the checkpoint
    served: Any = models.build(arch, seed=9)  # other values, the same tensors
    names = names_of(served)
    filled: dict[int, set[int]] = {}
    with torch.no_grad():
        for name, value in load_file(str(path / "model.safetensors")).items():
            piece = names.find(name)
            assert piece is not None, name
            assert piece.shape == tuple(value.shape) == piece.whole, name
            target = names.tensors[piece.key]
            (target[piece.index] if piece.index else target).copy_(value)
            filled.setdefault(piece.key, set()).add(piece.part)
    assert names.missing(filled) == []
    for (name, mine), (_, theirs) in zip(
        served.state_dict().items(), loaded.state_dict().items(), strict=True
    ):
        assert torch.equal(mine, theirs.cpu()), name


def test_moe_names_cover_experts_by_parts_or_whole() -> None:
    names = names_of(models.build("mixtral"))
    gate = names.find("model.layers.1.block_sparse_moe.experts.3.w1.weight")
    up = names.find("model.layers.1.block_sparse_moe.experts.3.w3.weight")
    fused = names.find("model.layers.1.mlp.experts.gate_up_proj")
    assert gate is not None
    assert up is not None
    assert fused is not None
    assert gate.key == up.key == fused.key
    assert (gate.part, up.part, fused.part) == (6, 7, WHOLE)
    assert gate.shape == up.shape == (128, 64)
    assert names.parts[gate.key] == 8  # 4 experts, gate and up each
    assert not names.covered(gate.key, range(7))
    assert names.covered(gate.key, range(8))
    assert names.covered(gate.key, [WHOLE])
    assert names.find("model.layers.1.block_sparse_moe.gate.weight") == names.find(
        "model.layers.1.mlp.gate.weight"
    )


def test_tied_and_prefixed_names_are_one_tensor() -> None:
    model = models.build("qwen2")  # ties its head to the embeddings
    names = names_of(model)
    assert names.find("lm_head.weight") == names.find("model.embed_tokens.weight")
    critic = names_of(model.model, prefix="model.")
    assert critic.find("model.norm.weight") == critic.find("norm.weight")
    assert critic.find("lm_head.weight") is None
    assert sorted(critic.missing({})) == sorted(f"model.{n}" for n, _ in model.model.named_parameters())


@pytest.mark.parametrize("arch", models.MOE_ARCHITECTURES)
def test_a_moe_checkpoint_reloads(arch: str, tmp_path: Path) -> None:
    old, new = models.save(arch, tmp_path / "old", seed=0), models.save(arch, tmp_path / "new", seed=1)
    engine = PackedScorer.from_config(settings_for(old).engine_config())
    jobs = _jobs()
    engine.apply(engine.stage(ReloadOrder("policy", new, "new", "swap")))
    got = [s.logprobs for s in engine.score(jobs)]
    for g, w in zip(got, _reference(eager(new), jobs), strict=True):
        np.testing.assert_allclose(g, w, atol=TOLERANCE)

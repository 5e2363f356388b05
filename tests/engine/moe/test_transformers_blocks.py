"""transformers' own sparse blocks in batch-invariant mode (moe/transformers_blocks.py): transformers'
function, a token's bits fixed whatever else its GEMM block holds, and experts in their own code
refused. CPU, float32.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from service.engine.moe import transformers_blocks
from tests.engine.decoder.test_fused import packed_model
from tests.engine.moe.test_layer import MOE, tokens
from tests.support import models


def _sparse_model(name: str) -> Any:
    """A tiny model of a parity MoE architecture, or of OLMoE or gpt-oss (router bias, expert biases,
    interleaved gate|up in transposed weights, its own gate function, a block that returns a tuple)."""
    if name in MOE:
        return packed_model(name)
    from transformers import AutoModelForCausalLM, GptOssConfig, OlmoeConfig

    config: Any = OlmoeConfig(**models.COMMON, num_experts=8, num_experts_per_tok=2)
    if name == "gpt_oss":
        common = {**models.COMMON, "intermediate_size": 32}
        config = GptOssConfig(**common, num_local_experts=4, num_experts_per_tok=2, head_dim=16)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    return model.eval()


def _output(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out[0]


@pytest.mark.parametrize("name", [*MOE, "olmoe", "gpt_oss"])
def test_blocked_sparse_blocks_compute_transformers_function(name: str) -> None:
    """Batch-invariant mode's sparse blocks in the transformers decoder (block_sparse): the block's
    output as transformers computes it (a tuple's other tensors too), and a token's bits fixed when the
    other tokens of its GEMM block change."""
    model = _sparse_model(name)
    blocks = [m for m in model.modules() if isinstance(getattr(m, "experts", None), torch.nn.Module)]
    h = tokens(96, seed=4)[None]
    other = h.clone()
    other[0, 1:32] = tokens(31, seed=5)
    with torch.inference_mode():
        want = [block(h) for block in blocks]
        assert transformers_blocks.block_sparse(model, 32) == len(blocks)
        for block, before in zip(blocks, want, strict=True):
            got = block(h)
            torch.testing.assert_close(_output(got), _output(before), atol=2e-6, rtol=1e-6)
            if not isinstance(before, torch.Tensor):
                for a, b in zip(got[1:], before[1:], strict=True):
                    torch.testing.assert_close(a, b)
            assert float(_output(got).abs().max()) > 1e-3
            assert torch.equal(_output(block(other))[0, 0], _output(got)[0, 0])


def test_experts_in_their_own_code_refuse_batch_invariance() -> None:
    class OwnExperts(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts = torch.nn.ModuleList([torch.nn.Linear(4, 4)])

    with pytest.raises(RuntimeError, match="batch_invariant: the experts of OwnExperts run their own code"):
        transformers_blocks.block_sparse(OwnExperts(), 32)

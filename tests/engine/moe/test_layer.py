"""The mixture-of-experts layer (moe/layer.py) against transformers' own MoE blocks, and in the fused decoder.

CPU, float32. The grouped path runs torch's grouped GEMM, which this torch also runs on CPU; a
reference grouped GEMM written here checks the grouping (order and group ends) on its own.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from service.core.jobs import SequenceJob
from service.engine import decoder
from service.engine.batch.packing import PackedBatch, pack
from service.engine.decoder import FusedDecoder, TransformersDecoder
from service.engine.decoder.graphs import EagerRecorder, GraphedDecoder
from service.engine.moe import grouped_gemm, routing_rule
from service.engine.moe import kernels as moe_ops
from service.engine.moe import layer as moe
from service.engine.ops import elementwise as decoder_ops
from service.engine.ops.elementwise import TORCH
from service.engine.scorer.engine import PackedScorer
from service.engine.scorer.self_check import DecoderMismatch, check_hidden
from service.engine.strategies.gemm import ONE_CALL, FixedRows
from service.settings import Settings
from tests.engine.decoder.test_fused import CPU, KERNEL, batch_of, every_row, packed_model
from tests.support import models

MOE = models.MOE_ARCHITECTURES
GROUPED = grouped_gemm.choose("grouped_mm", CPU, torch.float32)


def _reference_grouped(x: torch.Tensor, weight: torch.Tensor, groups: grouped_gemm.Groups) -> torch.Tensor:
    """Row r of x belongs to the expert whose group holds it (ends: each group's end): x[r] @ W[e]ᵀ."""
    rows = torch.arange(x.shape[0])
    expert = torch.searchsorted(groups.ends.long(), rows, right=True)  # the first group ending past r
    return torch.einsum("rk,rnk->rn", x, weight[expert])


REFERENCE = grouped_gemm.MoeKernel("grouped_mm", _reference_grouped)


def sparse_block(name: str, seed: int = 0) -> tuple[Any, Any]:
    """A model of `name` and its last layer's MoE block (sparse in every MOE model)."""
    model = packed_model(name, seed)
    return model, model.base_model.layers[-1].mlp


def ours(model: Any, block: Any, kernel: grouped_gemm.MoeKernel) -> moe.SparseMoe:
    """The fused decoder's layer over the block's own modules."""
    fused = FusedDecoder(model.base_model, KERNEL, TORCH, 0, moe_kernel=kernel)
    layer = fused.layers[-1].mlp
    assert isinstance(layer, moe.SparseMoe)
    assert layer.router is block.gate
    return layer


def tokens(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, 64, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", MOE)
@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
@pytest.mark.parametrize(
    "kernel", [grouped_gemm.LOOP, GROUPED, REFERENCE], ids=["loop", "grouped", "reference"]
)
def test_layer_equals_the_transformers_block(
    name: str, implementation: str, kernel: grouped_gemm.MoeKernel
) -> None:
    model, block = sparse_block(name)
    model.set_experts_implementation(implementation)
    h = tokens(200)
    with torch.inference_mode():
        want = block(h[None])[0]
        got = ours(model, block, kernel)(h)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-6)


class _OtherTie(routing_rule.Routing):
    """The same routing with a three-way tie of experts 0, 1, 2 resolved another way."""

    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, experts = super().__call__(logits)
        return weights, 2 - experts


@pytest.mark.parametrize("name", MOE)
def test_tied_router_logits_resolve_as_transformers(name: str) -> None:
    """Three experts with the same router row, far ahead of the others: every token's top 2 come
    out of a three-way tie, and resolving it another way changes the output."""
    model, block = sparse_block(name)
    with torch.no_grad():
        block.gate.weight[1:3] = block.gate.weight[0]
        block.gate.weight[0:3] *= 20
    row = block.gate.weight[0].detach()
    h = tokens(64, seed=1) + 4 * row / row.norm()  # the tied logits positive: ahead
    rule = routing_rule.routing(name, model.config)
    assert rule is not None
    layer = ours(model, block, grouped_gemm.LOOP)
    with torch.inference_mode():
        _, _, want_experts = block.gate(h)
        _, got_experts = rule(F.linear(h, block.gate.weight))
        assert torch.equal(got_experts, want_experts)
        assert set(got_experts.flatten().tolist()) <= {0, 1, 2}
        want = block(h[None])[0]
        got = layer(h)
        layer.routing = _OtherTie(rule.top_k, rule.normalise, rule.round_weights)
        other = layer(h)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-6)
    assert float((other - want).abs().max()) > 1e-2


@pytest.mark.parametrize("name", MOE)
@pytest.mark.parametrize("kernel", [grouped_gemm.LOOP, GROUPED], ids=["loop", "grouped"])
def test_a_token_does_not_depend_on_the_batch(name: str, kernel: grouped_gemm.MoeKernel) -> None:
    """A token alone, in 7s and among 301: the same up to the CPU GEMM's one-row path (which rounds
    apart from the many-row one; a token reading another's rows would be off by O(1))."""
    model, block = sparse_block(name)
    layer = ours(model, block, kernel)
    h = tokens(301, seed=2)
    with torch.inference_mode():
        whole = layer(h)
        alone = torch.cat([layer(h[i : i + 1]) for i in range(0, 301, 37)])
        sevens = torch.cat([layer(h[i : i + 7]) for i in range(0, 301, 7)])
    scale = float(whole.abs().max())
    assert float((alone - whole[::37]).abs().max()) <= 1e-6 * scale
    assert torch.equal(sevens, whole) or float((sevens - whole).abs().max()) <= 1e-6 * scale


@pytest.mark.parametrize("name", MOE)
def test_grouped_gemm_equals_the_loop(name: str) -> None:
    model, block = sparse_block(name)
    h = tokens(150, seed=3)
    with torch.inference_mode():
        loop = ours(model, block, grouped_gemm.LOOP)(h)
        grouped = ours(model, block, GROUPED)(h)
        reference = ours(model, block, REFERENCE)(h)
    torch.testing.assert_close(grouped, loop, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(reference, loop, atol=1e-5, rtol=1e-5)  # einsum sums in its own order


def test_groups_are_stable_and_end_where_each_expert_ends() -> None:
    """Slots grouped by expert, tokens ascending within one, through the layer's own arithmetic: a
    grouped GEMM that records what it is given."""
    model, block = sparse_block("qwen3_moe")
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def spy(x: torch.Tensor, weight: torch.Tensor, groups: grouped_gemm.Groups) -> torch.Tensor:
        seen.append((x.clone(), groups.offsets.clone()))
        return grouped_gemm.LOOP.matmul(x, weight, groups)

    h = tokens(40, seed=4)
    with torch.inference_mode():
        ours(model, block, grouped_gemm.MoeKernel("loop", spy))(h)
        _, _, experts = block.gate(h)
    grouped, offsets = seen[0]
    counts = torch.bincount(experts.flatten(), minlength=8)
    assert offsets.dtype == torch.int32
    assert offsets.tolist() == [0, *torch.cumsum(counts, 0).tolist()]
    start = 0
    for expert, end in enumerate(offsets[1:].tolist()):
        rows = torch.nonzero((experts == expert).any(-1)).flatten()  # ascending token ids
        assert torch.equal(grouped[start:end], h[rows])
        start = end


# ---- the device kernels (GPU) -------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("name", MOE)
@pytest.mark.parametrize("setting", ["quack", "grouped_mm"])
def test_device_kernels_are_within_bf16_noise_of_transformers(name: str, setting: str) -> None:
    """The sparse block in bf16 through each device kernel and the Triton combine, against the
    float32 block: no further off than transformers' own bf16 block (its grouped_mm experts) is."""
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    model, block = sparse_block(name)
    model.set_experts_implementation("grouped_mm")
    h = tokens(3000, seed=5).to(cuda)
    with torch.inference_mode():
        want = block.to(cuda)(h[None])[0]
        model = model.to(cuda, bf16)
        noise = float((block(h.to(bf16)[None])[0].float() - want).abs().max())
        fused = FusedDecoder(
            model.base_model,
            KERNEL,
            decoder_ops.TRITON,
            0,
            moe_kernel=grouped_gemm.choose(setting, cuda, bf16),
        )
        layer = fused.layers[-1].mlp
        assert isinstance(layer, moe.SparseMoe)
        assert layer.kernel.name == setting
        assert layer.combine is moe_ops.combine_kernel
        got = layer(h.to(bf16)).float()
    assert float((got - want).abs().max()) <= 1.5 * noise + 1e-3 * float(want.abs().max())


# ---- in the fused decoder ------------------------------------------------------------------------


@pytest.mark.parametrize("name", MOE)
def test_the_fused_decoder_runs_mixtures_of_experts(name: str) -> None:
    model = packed_model(name)
    assert decoder.unsupported(model.base_model) is None
    built = decoder.build(model.base_model, "auto", KERNEL, TORCH, 0, moe_kernel=lambda: GROUPED)
    assert isinstance(built, FusedDecoder)
    assert built.sparse
    assert built.moe_kernel is GROUPED
    kinds = [type(layer.mlp).__name__ for layer in built.layers]
    assert kinds == (["_Dense", "SparseMoe"] if name == "qwen3_moe" else ["SparseMoe", "SparseMoe"])
    batch = batch_of()
    rows = torch.tensor([0, 5, 19, 20, 52, 53, 60, batch.num_tokens - 1])
    with torch.inference_mode():
        want = TransformersDecoder(model.base_model)(batch, rows)
        got = built(batch, rows)
        chunked = FusedDecoder(model.base_model, KERNEL, TORCH, 5)(batch, rows)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunked, want, atol=1e-5, rtol=1e-5)


def three_layers(name: str) -> Any:
    """A model of `name` with three layers: one sparse layer (qwen3_moe) or two counted before the last."""
    return packed_model(name, num_hidden_layers=3, layer_types=["full_attention"] * 3)


def transformers_counts(base: Any, batch: PackedBatch, real: int) -> list[list[int]]:
    """Per sparse layer but the last: how many of the first `real` rows transformers' router sent to
    each expert (the ids its TopKRouter returns third)."""
    blocks = [layer.mlp for layer in base.layers[:-1] if hasattr(layer.mlp, "experts")]
    seen: list[torch.Tensor] = []
    hooks = [block.gate.register_forward_hook(lambda _m, _i, out: seen.append(out[2])) for block in blocks]
    try:
        TransformersDecoder(base)(batch, every_row(batch))
    finally:
        for hook in hooks:
            hook.remove()
    experts = blocks[0].experts.gate_up_proj.shape[0]
    return [torch.bincount(ids[:real].flatten(), minlength=experts).tolist() for ids in seen]


COUNTING = ["plain", "mlp-chunks", "gemm-rows", "graph-replay"]


@pytest.mark.parametrize("name", MOE)
@pytest.mark.parametrize("how", COUNTING)
def test_the_decoder_counts_each_experts_real_tokens(name: str, how: str) -> None:
    """The fused decoder's counts after a forward equal transformers' routing of the real tokens (the
    filler that pads the row left out), whether the MLP runs in chunks of 5 tokens, in GEMM blocks of 16
    rows, or as a graph replayed over a second batch of the row's length."""
    model = three_layers(name)
    lengths, other = (20, 33, 7, 12), (40, 10, 9)
    batch, second = batch_of(lengths), batch_of(other, seed=1)
    assert batch.num_tokens == second.num_tokens == 128
    fused = FusedDecoder(
        model.base_model,
        KERNEL,
        TORCH,
        5 if how == "mlp-chunks" else 0,
        gemm=FixedRows(16) if how == "gemm-rows" else ONE_CALL,
    )
    forward: Any = fused
    if how == "graph-replay":
        forward = GraphedDecoder(fused, EagerRecorder(), 128, total_bounded=True, limit=4)
    with torch.inference_mode():
        forward(batch, batch.hidden_index)
        want = transformers_counts(model.base_model, batch, sum(lengths))
        if how == "graph-replay":
            assert forward.graphs == 1
            forward(second, second.hidden_index)
            assert forward.graphs == 1
            want = transformers_counts(model.base_model, second, sum(other))
    counts = forward.expert_counts()
    assert counts is not None
    assert counts.tolist() == want
    assert len(want) == (1 if name == "qwen3_moe" else 2)


def test_only_sparse_layers_before_the_last_are_counted() -> None:
    """The last layer's experts run on the rows the heads read only; a dense model and the transformers
    decoder count nothing."""
    two = packed_model("qwen3_moe")  # a dense layer, then the last, sparse
    assert FusedDecoder(two.base_model, KERNEL, TORCH, 0).expert_counts() is None
    assert FusedDecoder(packed_model("qwen2").base_model, KERNEL, TORCH, 0).expert_counts() is None
    assert TransformersDecoder(three_layers("mixtral").base_model).expert_counts() is None


def test_experts_stay_where_they_are_and_follow_a_rebinding_reload() -> None:
    model, other = packed_model("mixtral"), packed_model("mixtral", seed=1)
    experts = model.base_model.layers[0].mlp.experts
    before = experts.gate_up_proj.data_ptr()
    fused = FusedDecoder(model.base_model, KERNEL, TORCH, 0)
    assert experts.gate_up_proj.data_ptr() == before
    with torch.no_grad():
        for param, new in zip(model.parameters(), other.parameters(), strict=True):
            param.data = new.detach().clone()  # a swap reload
    fused.refresh()
    batch = batch_of()
    with torch.inference_mode():
        want = TransformersDecoder(other.base_model)(batch, every_row(batch))
        got = fused(batch, every_row(batch))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_other_mixtures_keep_the_transformers_decoder() -> None:
    from transformers import AutoModelForCausalLM, OlmoeConfig

    config = OlmoeConfig(**models.COMMON, num_experts=4, num_experts_per_tok=2)
    model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    assert "model_type 'olmoe'" in str(decoder.unsupported(model.base_model))
    assert decoder.build(model.base_model, "auto", KERNEL, TORCH, 0).kind == "transformers"
    mixtral = packed_model("mixtral")
    mixtral.base_model.layers[1].mlp.experts.is_transposed = True
    assert "layer 1: experts.is_transposed" in str(decoder.unsupported(mixtral.base_model))


def test_self_check_catches_a_misread_router() -> None:
    model = packed_model("qwen3_moe")
    fused = FusedDecoder(model.base_model, KERNEL, TORCH, 0)
    job = SequenceJob(np.arange(3, 40), np.arange(1, 37), 1.0, False)
    assert check_hidden(model.base_model, fused, job, CPU, "policy") < 1e-5
    layer = fused.layers[1].mlp
    assert isinstance(layer, moe.SparseMoe)
    layer.routing = routing_rule.Routing(layer.routing.top_k, normalise=False, round_weights=True)
    with pytest.raises(RuntimeError, match="fused decoder"):
        check_hidden(model.base_model, fused, job, CPU, "policy")


class _Flipped(routing_rule.Routing):
    """The same routing but every 20th token's first expert swapped for the next expert id that it did
    not choose: the near-tie flips rounding makes in half precision, on 5 % of the tokens."""

    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, experts = super().__call__(logits)
        experts = experts.clone()
        count = logits.shape[1]
        for t in range(0, experts.shape[0], 20):
            other = (int(experts[t, 0]) + 1) % count
            while other in experts[t].tolist():
                other = (other + 1) % count
            experts[t, 0] = other
        return weights, experts


class _Elsewhere(routing_rule.Routing):
    """Every token to other experts: a misread router."""

    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, experts = super().__call__(logits)
        return weights, (experts + 1) % logits.shape[1]


def _fused_with(name: str, rule: type[routing_rule.Routing]) -> tuple[Any, FusedDecoder]:
    model = packed_model(name)
    fused = FusedDecoder(model.base_model, KERNEL, TORCH, 0)
    for layer in fused.sparse_layers:
        layer.routing = rule(layer.routing.top_k, layer.routing.normalise, layer.routing.round_weights)
    return model, fused


@pytest.mark.parametrize("name", MOE)
def test_self_check_pins_transformers_routing(name: str, caplog: pytest.LogCaptureFixture) -> None:
    """5 % of tokens routed elsewhere: the hidden states move far past the bound unpinned, and pinned to
    transformers' experts the check passes, reporting that 95 % of the pairs agree."""
    model, fused = _fused_with(name, _Flipped)
    job = SequenceJob(np.arange(3, 83), np.arange(1, 80), 1.0, False)
    packed = pack([job], CPU, step=1)  # as the check packs it
    every = torch.arange(packed.num_tokens)
    with torch.inference_mode():
        unpinned = decoder.relative_error(
            fused(packed, every), TransformersDecoder(model.base_model)(packed, every)
        )
    with caplog.at_level(logging.INFO):
        error = check_hidden(model.base_model, fused, job, CPU, "policy")
    assert error < 1e-5
    assert unpinned > 1e-2
    share = float(re.search(r"experts for >= ([0-9.]+)% of pairs", caplog.text).group(1))  # type: ignore[union-attr]
    assert 93 <= share < 100  # every 20th token's first expert: 1/20 of its k pairs off
    assert all(layer.pinned is None for layer in fused.sparse_layers)
    assert all(
        not block.mlp.gate._forward_hooks for block in model.base_model.layers if hasattr(block.mlp, "gate")
    )


@pytest.mark.parametrize("name", MOE)
def test_self_check_catches_a_router_that_chooses_other_experts(name: str) -> None:
    model, fused = _fused_with(name, _Elsewhere)
    job = SequenceJob(np.arange(3, 40), np.arange(1, 37), 1.0, False)
    with pytest.raises(
        DecoderMismatch,
        match=r"sparse layer 0: the fused decoder's router chose transformers' experts for [0-9.]+% of",
    ):
        check_hidden(model.base_model, fused, job, CPU, "policy")
    assert all(layer.pinned is None for layer in fused.sparse_layers)
    assert all(
        not block.mlp.gate._forward_hooks for block in model.base_model.layers if hasattr(block.mlp, "gate")
    )


@pytest.mark.parametrize(
    ("name", "settings", "kind", "kernel"),
    [
        ("qwen3_moe", {}, "fused", "loop"),
        ("mixtral", {"moe_kernel": "grouped_mm"}, "fused", "grouped_mm"),
        ("qwen2_moe", {"decoder": "transformers"}, "transformers", "none"),
        ("qwen2", {"moe_kernel": "grouped_mm"}, "fused", "none"),
    ],
)
def test_the_engine_reports_its_moe_kernel(
    name: str, settings: dict[str, Any], kind: str, kernel: str, model_dirs: dict[str, Path]
) -> None:
    engine = PackedScorer.from_config(
        Settings(model=model_dirs[name], device="cpu", **settings).engine_config()
    )
    assert (engine.info.decoder, engine.info.moe_kernel) == (kind, kernel)
    engine.warm_up()  # the self-check against transformers' forward


def test_grouped_mm_without_the_fused_decoder_fails(model_dirs: dict[str, Path]) -> None:
    settings = Settings(
        model=model_dirs["mixtral"], device="cpu", decoder="transformers", moe_kernel="grouped_mm"
    )
    with pytest.raises(RuntimeError, match="moe_kernel=grouped_mm runs in the fused decoder"):
        PackedScorer.from_config(settings.engine_config())

"""The fused decoder against transformers' own forward, which the parity suite checks independently.

On CPU the fused decoder runs its torch ops (and, in the interpreter process of
test_decoder_ops.py's pattern, its Triton kernels); `make test-gpu` runs the whole service path
with it on CUDA against the per-sequence float32 reference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from service.core.jobs import SequenceJob
from service.engine import decoder
from service.engine.batch.packing import PackedBatch, pack
from service.engine.decoder import FusedDecoder, TransformersDecoder
from service.engine.ops.attention import choose_backend, register
from service.engine.ops.elementwise import TORCH, TRITON
from service.engine.scorer.engine import PackedScorer
from service.engine.scorer.self_check import check_hidden, logits_check
from service.settings import Settings
from tests.engine.interpreter import only_interpreted, run_interpreter_cases
from tests.support import models

FUSED = ("qwen2", "qwen3", "llama", "mistral")
CPU = torch.device("cpu")
KERNEL = choose_backend("sdpa", CPU).kernel


def packed_model(name: str, seed: int = 0, **config: Any) -> Any:
    """A tiny model of `name` whose attention is logprobd's packed kernel (as the engine loads it)."""
    from transformers import AutoModelForCausalLM

    impl = register(choose_backend("sdpa", CPU))
    cfg = models.configs()[name]
    for key, value in config.items():
        setattr(cfg, key, value)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            cfg, attn_implementation=impl, dtype=torch.float32
        )
    return model.eval()


def batch_of(lengths: tuple[int, ...] = (20, 33, 7, 12), seed: int = 0) -> PackedBatch:
    rng = np.random.default_rng(seed)
    jobs = [SequenceJob(rng.integers(3, models.VOCAB, n), np.arange(1, n), 1.0, False) for n in lengths]
    return pack(jobs, CPU)


def every_row(batch: PackedBatch) -> torch.Tensor:
    return torch.arange(batch.num_tokens)


@pytest.mark.parametrize("name", FUSED)
@pytest.mark.parametrize("chunk", [0, 5])
def test_fused_equals_transformers(name: str, chunk: int) -> None:
    """Several sequences in one row (qwen2 and mistral with sliding windows shorter than them)."""
    model = packed_model(name)
    batch = batch_of()
    rows = torch.tensor([0, 5, 19, 20, 52, 53, 60, batch.num_tokens - 1])
    with torch.inference_mode():
        want = TransformersDecoder(model.base_model)(batch, rows)
        got = FusedDecoder(model.base_model, KERNEL, TORCH, chunk)(batch, rows)
    assert got.shape == want.shape == (8, 64)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_biases_everywhere() -> None:
    """Llama with attention_bias and mlp_bias: o_proj's and down_proj's biases are added too."""
    model = packed_model("llama", attention_bias=True, mlp_bias=True)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1 and not torch.equal(param, torch.ones_like(param)):
                param.normal_(0, 0.5)  # biases are zero at init: make them matter
    batch = batch_of()
    with torch.inference_mode():
        want = TransformersDecoder(model.base_model)(batch, every_row(batch))
        got = FusedDecoder(model.base_model, KERNEL, TORCH, 4)(batch, every_row(batch))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_fusion_keeps_one_copy_of_the_weights() -> None:
    model = packed_model("qwen2")
    before = _storage_bytes(model)
    fused = FusedDecoder(model.base_model, KERNEL, TORCH, 0)
    assert _storage_bytes(model) == before
    layer, attn = fused.layers[1], model.base_model.layers[1].self_attn
    assert attn.k_proj.weight.data_ptr() == layer.qkv.weight[attn.q_proj.out_features :].data_ptr()
    assert layer.qkv.bias is not None
    assert attn.v_proj.bias.data_ptr() == layer.qkv.bias[-attn.v_proj.out_features :].data_ptr()


def _storage_bytes(model: Any) -> int:
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    return sum(storages.values())


def test_refresh_takes_up_rebound_parameters() -> None:
    """A swap reload rebinds `param.data`: refresh copies the new values into the concatenations."""
    model, other = packed_model("qwen3"), packed_model("qwen3", seed=1)
    fused = FusedDecoder(model.base_model, KERNEL, TORCH, 0)
    batch = batch_of()
    with torch.no_grad():
        for param, new in zip(model.parameters(), other.parameters(), strict=True):
            param.data = new.detach().clone()
    fused.refresh()
    with torch.inference_mode():
        want = TransformersDecoder(other.base_model)(batch, every_row(batch))
        got = fused(batch, every_row(batch))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (
        model.base_model.layers[0].mlp.up_proj.weight.data_ptr()
        != other.base_model.layers[0].mlp.up_proj.weight.data_ptr()
    )


@pytest.mark.parametrize(
    ("name", "reason"), [("gemma2", "model_type 'gemma2'"), ("phi3", "model_type 'phi3'")]
)
def test_other_architectures_keep_the_transformers_decoder(name: str, reason: str) -> None:
    model = packed_model(name)
    assert reason in str(decoder.unsupported(model.base_model))
    assert decoder.build(model.base_model, "auto", KERNEL, TORCH, 0).kind == "transformers"
    with pytest.raises(RuntimeError, match="decoder=fused"):
        decoder.build(model.base_model, "fused", KERNEL, TORCH, 0)


def test_a_misfit_layer_is_named() -> None:
    model = packed_model("llama")
    model.base_model.layers[1].mlp.act_fn = torch.nn.GELU()
    model.config.hidden_act = "gelu"
    assert decoder.unsupported(model.base_model) == "hidden_act 'gelu' is not silu"
    model = packed_model("llama")
    model.base_model.layers[1].mlp.up_proj = torch.nn.Identity()
    assert "layer 1" in str(decoder.unsupported(model.base_model))


def test_self_check_catches_a_misread_layer() -> None:
    """A fused decoder that forgot qwen2's sliding window: the warm-up self-checks refuse it."""
    model = packed_model("qwen2")
    fused = FusedDecoder(model.base_model, KERNEL, TORCH, 0)
    job = SequenceJob(np.arange(3, 40), np.arange(1, 37), 1.0, False)
    assert check_hidden(model.base_model, fused, job, CPU, "policy") < 1e-5
    for layer in fused.layers:
        layer.window = None
    with pytest.raises(RuntimeError, match="fused decoder"):
        check_hidden(model.base_model, fused, job, CPU, "policy")
    from service.engine.scorer.models import CausalLM

    with pytest.raises(RuntimeError, match="fused decoder"):
        logits_check(CausalLM(model, fused, chunk_rows=8), job, CPU)
    assert check_hidden(model.base_model, TransformersDecoder(model.base_model), job, CPU, "policy") == 0.0


@pytest.mark.parametrize(
    ("name", "settings", "decoder_kind"),
    [
        ("qwen2", {}, "fused"),
        ("qwen2", {"decoder": "transformers"}, "transformers"),
        ("gemma2", {}, "transformers"),
    ],
)
def test_the_engine_reports_its_decoder(
    name: str, settings: dict[str, Any], decoder_kind: str, model_dirs: dict[str, Path]
) -> None:
    engine = PackedScorer.from_config(
        Settings(model=model_dirs[name], device="cpu", **settings).engine_config()
    )
    assert engine.info.decoder == decoder_kind
    assert engine.info.kernels == "none"


@pytest.mark.parametrize("setting", ["auto", "fused"])
def test_a_fused_decoder_off_transformers_gives_way_under_auto_only(
    setting: str, model_dirs: dict[str, Path]
) -> None:
    """The warm-up's self-check finds the fused decoder off (its sliding windows lost): under auto
    the engine serves the transformers decoder, exact, and says so; decoder=fused fails the start."""
    engine = PackedScorer.from_config(
        Settings(model=model_dirs["qwen2"], device="cpu", decoder=setting).engine_config()
    )
    fused = engine.served.policy.forward
    assert isinstance(fused, FusedDecoder)
    for layer in fused.layers:
        layer.window = None
    if setting == "fused":
        with pytest.raises(RuntimeError, match="fused decoder"):
            engine.warm_up()
        return
    engine.warm_up()
    assert engine.info.decoder == "transformers"
    assert isinstance(engine.served.policy.forward, TransformersDecoder)
    job = SequenceJob(np.arange(3, 40), np.arange(1, 37), 1.0, False)
    assert logits_check(engine.served.policy, job, CPU) < 1e-4


def test_liger_and_fused_do_not_go_together(model_dirs: dict[str, Path]) -> None:
    with pytest.raises(RuntimeError, match="kernels=liger"):
        PackedScorer.from_config(
            Settings(
                model=model_dirs["qwen2"], device="cpu", decoder="fused", kernels="liger"
            ).engine_config()
        )


# ---- the Triton kernels inside the decoder (interpreter) -----------------------------------------


def test_triton_decoder_in_a_fresh_process() -> None:
    run_interpreter_cases(__file__)


@only_interpreted
@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_interpreter_triton_ops_equal_torch_ops(name: str) -> None:
    model = packed_model(name)
    batch = batch_of((9, 14, 5))
    rows = every_row(batch)
    with torch.inference_mode():
        want = FusedDecoder(model.base_model, KERNEL, TORCH, 4)(batch, rows)
        got = FusedDecoder(model.base_model, KERNEL, TRITON, 4)(batch, rows)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)

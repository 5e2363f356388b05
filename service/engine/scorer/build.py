"""Building the engine's models: each decoder's forward per the configuration (decoder, kernels,
strategies, CUDA graphs) and the EngineInfo that describes what was built.

Boundary: loaded transformers modules and the EngineConfig in; Served models and EngineInfo out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import time
from collections.abc import Sequence
from typing import Any

import torch

import service
from service.engine import decoder
from service.engine.config import EngineConfig
from service.engine.contract import (
    EngineInfo,
    ModelInfo,
    MoeShape,
    Target,
    WeightsState,
)
from service.engine.decoder import graphs
from service.engine.decoder.base import Decoder
from service.engine.decoder.mlp_chunks import chunk_mlps, resolve_tokens
from service.engine.heads import quack_head
from service.engine.loading.critic import Critic
from service.engine.loading.pretrained import LoadedModel, text_part
from service.engine.moe import grouped_gemm, routing_rule, transformers_blocks
from service.engine.ops import fixed_tile
from service.engine.ops import gate_up as gated
from service.engine.ops.attention import AttentionBackend
from service.engine.ops.elementwise import Ops
from service.engine.ops.liger import apply_fused_kernels
from service.engine.parallel import vocab_layers
from service.engine.parallel.sharding import Sharded
from service.engine.scorer.memory import longest, max_positions
from service.engine.scorer.models import CausalLM, Served
from service.engine.strategies import gemm as gemms
from service.engine.strategies.gemm import FixedRows, FixedTiles, TokenGemms
from service.engine.strategies.sums import LOCAL, AllReduce, PartialSums


def prepare(  # noqa: PLR0917
    model: Any,
    base: Any,
    config: EngineConfig,
    backend: AttentionBackend,
    ops: Ops,
    device: torch.device,
    gemm: TokenGemms = gemms.ONE_CALL,
    sums: PartialSums = LOCAL,
) -> tuple[Decoder, str]:
    """The forward of `base` (the decoder of `model`) and the fused kernels it runs: triton|liger|none.

    kernels=liger patches transformers' modules, so it keeps the transformers decoder. `gemm`: how
    every GEMM over tokens runs (fixed-row calls in batch-invariant mode, transformers' own modules
    patched alike); `sums`: how the fused decoder's projections add into the residual.
    """
    setting = config.decoder
    if config.kernels == "liger":
        if setting == "fused":
            raise RuntimeError("kernels=liger patches the transformers decoder, not decoder=fused")
        setting = "transformers"
    dtype = next(model.parameters()).dtype
    chunk = resolve_tokens(config.mlp_chunk_tokens, text_part(model.config), dtype)
    mlp_kernel = "split" if config.mlp_kernel == "auto" and config.kernels == "none" else config.mlp_kernel

    def projection() -> gated.GatedProjection:  # chosen (and probed) only for a fused decoder
        return gated.choose(mlp_kernel, device, dtype, ops.swiglu)

    def moe_kernel() -> grouped_gemm.MoeKernel:  # chosen (and probed) only for a fused decoder with experts
        return grouped_gemm.choose(config.moe_kernel, device, dtype)

    chunk = gemm.whole_calls(chunk)
    forward = decoder.build(
        base, setting, backend.kernel, ops, chunk, projection, gemm=gemm, sums=sums, moe_kernel=moe_kernel
    )
    if isinstance(forward, decoder.FusedDecoder):
        kernels = "triton" if ops.name == "triton" else "none"
        return forward, f"{kernels}+quack" if forward.gated.name == "quack" else kernels
    if config.mlp_kernel == "quack":
        raise RuntimeError("mlp_kernel=quack runs in the fused decoder, which this model does not run")
    if config.moe_kernel in {"quack", "grouped_mm"} and decoder.sparse(base):
        raise RuntimeError(
            f"moe_kernel={config.moe_kernel} runs in the fused decoder, which this model does not run"
        )
    if config.batch_invariant and isinstance(forward, decoder.TransformersDecoder):
        forward.attention = backend.kernel  # the mode's attention (ops/attention.py invariant), per call
    kernels = apply_fused_kernels(model, config.kernels, device, batch_invariant=gemm.rows is not None)
    chunk_mlps(model, chunk)  # after the kernels: wraps their MLP
    gemm.patch(base)
    if isinstance(gemm, FixedRows):
        transformers_blocks.block_sparse(base, gemm.rows)
    return forward, kernels


def token_gemms(config: EngineConfig, device: torch.device, bases: Sequence[Any]) -> TokenGemms:
    """How every GEMM over tokens runs (strategies/gemm.py): one call; in batch-invariant mode FixedTiles
    where quack's fixed-tile GEMMs pass their probe and every model (`bases`: the decoders) runs the
    fused decoder, whose every GEMM over tokens goes through the strategy, and the experts do not run
    grouped_mm (not row-invariant); else FixedRows."""
    if not config.batch_invariant:
        return gemms.ONE_CALL
    fused = (
        config.decoder != "transformers"
        and config.kernels != "liger"
        and config.moe_kernel != "grouped_mm"
        and all(decoder.unsupported(base) is None for base in bases)
    )
    dtype = next(bases[0].parameters()).dtype
    return gemms.choose(True, fixed_tile.choose(device, dtype) if fused else None)


def fused_of(forward: Decoder) -> decoder.FusedDecoder | None:
    """The FusedDecoder `forward` runs (itself, or the one its CUDA graphs replay); None for another."""
    inner = forward.inner if isinstance(forward, graphs.GraphedDecoder) else forward
    return inner if isinstance(inner, decoder.FusedDecoder) else None


def moe_kernel_name(forward: Decoder) -> str:
    """What runs the experts of `forward`'s sparse layers: quack | grouped_mm | loop; none: no sparse
    layer runs fused."""
    fused = fused_of(forward)
    return fused.moe_kernel.name if fused is not None and fused.sparse else "none"


def moe_shape(base: Any) -> MoeShape | None:
    """The sparse layers of a decoder (transformers' modules) as routes address them; None where it has
    none, or routes them by a rule logprobd does not know (routing_rule.routing)."""
    config = base.config
    rule = routing_rule.routing(str(getattr(config, "model_type", "")), config)
    blocks = [layer.mlp for layer in getattr(base, "layers", []) if hasattr(layer.mlp, "experts")]
    if rule is None or not blocks:
        return None
    return MoeShape(layers=len(blocks), experts=int(blocks[0].gate.weight.shape[0]), top_k=rule.top_k)


def model_info(role: Target, name: str, model: Any) -> ModelInfo:
    params = list(model.parameters())
    return ModelInfo(
        role=role,
        name=name,
        architecture=type(model).__name__,
        parameters=sum(p.numel() for p in params),
        memory_bytes=sum(p.numel() * p.element_size() for p in params)
        + sum(b.numel() * b.element_size() for b in model.buffers()),
    )


def versions() -> dict[str, str]:
    import transformers

    versions = {
        "service": service.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    # the distributions' versions: flash-attn 4 alone leaves `flash_attn` a namespace, with no __version__
    for distribution in ("flash-attn", "flash-attn-4", "quack-kernels", "nvidia-cutlass-dsl"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[distribution.replace("-", "_")] = importlib.metadata.version(distribution)
    return versions


def serve(  # noqa: PLR0917
    loaded: LoadedModel,
    device: torch.device,
    backend: AttentionBackend,
    config: EngineConfig,
    budget: int,
    gemm: TokenGemms,
    reference: LoadedModel | None,
    critic: Critic | None,
    sharded: Sharded | None,
) -> tuple[Served, str]:
    """Each model's forward, built per the configuration (its CUDA graphs sized for micro-batches of
    `budget` tokens), and the kernels the policy's runs."""
    ops = Ops.for_device(device, allow_triton=config.kernels != "none")
    chunk_rows = config.logits_chunk_rows
    if isinstance(gemm, FixedRows) and gemm.rows % chunk_rows:  # whole chunks of padded actions
        chunk_rows = gemm.rows
    cuda_graphs = config.cuda_graphs if sharded is None else "off"  # a graph of collectives: not yet
    recorder = None
    if device.type == "cuda" and cuda_graphs != "off":
        recorder = graphs.CudaRecorder(device)  # one memory pool for every model's graphs
    # tensor parallel: the row-parallel projections' partial sums all-reduced (strategies/sums.py)
    sums = AllReduce(sharded.shard.all_reduce_) if sharded is not None else LOCAL

    def forward(model: Any, base: Any) -> tuple[Decoder, str]:
        built, kernels = prepare(model, base, config, backend, ops, device, gemm, sums)
        if sharded is not None and not isinstance(built, decoder.FusedDecoder):
            raise RuntimeError("tensor parallel runs the fused decoder; this model runs another")
        wrapped = graphs.wrap(
            built,
            cuda_graphs,
            backend.name,
            device,
            recorder,
            budget,
            config.cuda_graph_limit,
            batch_invariant=config.batch_invariant,
        )
        return wrapped, f"{kernels}+graphs" if wrapped is not built else kernels

    policy_forward, kernels = forward(loaded.model, loaded.model.base_model)
    if isinstance(gemm, FixedTiles):  # the heads' GEMMs too: one call per chunk of any rows
        for model in (loaded.model, reference.model if reference is not None else None):
            if model is not None:
                gemm.patch(model.get_output_embeddings())
    head_kernel = (
        "chunked" if config.head_kernel == "auto" and config.kernels == "none" else config.head_kernel
    )

    def fused_head(model: Any) -> quack_head.QuackHead | None:
        return quack_head.choose(
            head_kernel, model.get_output_embeddings(), device, batch_invariant=config.batch_invariant
        )

    served = Served(CausalLM(loaded.model, policy_forward, chunk_rows, fused_head(loaded.model)))
    if reference is not None:
        served.reference = CausalLM(
            reference.model,
            forward(reference.model, reference.model.base_model)[0],
            chunk_rows,
            fused_head(reference.model),
        )
        if served.reference.vocab_size != served.policy.vocab_size:
            raise ValueError(
                f"reference model vocabulary {served.reference.vocab_size} differs from the policy's "
                f"{served.policy.vocab_size}"
            )
    if critic is not None:
        served.critic, served.critic_forward = critic, forward(critic.decoder, critic.decoder)[0]
    return served, kernels


def describe(  # noqa: PLR0917
    loaded: LoadedModel,
    device: torch.device,
    backend: AttentionBackend,
    config: EngineConfig,
    budget: int,
    served: Served,
    kernels: str,
    reference: LoadedModel | None,
    sharded: Sharded | None,
    moe: MoeShape | None,
) -> EngineInfo:
    """What /info reports of the built engine (the longest sequence before memory is measured);
    `moe`: the policy's `moe_shape`."""
    vocab = served.policy.vocab_size
    if served.critic is not None:
        vocab = min(vocab, vocab_layers.full_rows(served.critic.decoder.get_input_embeddings()))
    models = [model_info("policy", loaded.name, loaded.model)]
    if reference is not None:
        models.append(model_info("reference", reference.name, reference.model))
    if served.critic is not None:
        critic = served.critic
        models.append(model_info("critic", f"critic ({critic.head.format} value head)", critic.decoder))
    model_config = loaded.model.config
    info = EngineInfo(
        model=loaded.name,
        demo=loaded.demo,
        architecture=(model_config.architectures or [type(loaded.model).__name__])[0],
        dtype=str(loaded.model.dtype).removeprefix("torch."),
        device=str(device),
        attention_backend=backend.name,
        decoder=served.policy.forward.kind,
        kernels=kernels,
        moe_kernel=moe_kernel_name(served.policy.forward),
        head_kernel="chunked" if served.policy.fused_head is None else served.policy.fused_head.name,
        vocab_size=vocab,
        max_positions=max_positions(text_part(model_config)),
        batch_invariant=config.batch_invariant,
        versions=versions(),
        max_batch_tokens=budget,
        models=tuple(models),
        tensor_parallel_size=sharded.shard.world if sharded is not None else 1,
        moe=moe,
    )
    return dataclasses.replace(info, **longest(info.max_positions, None, config.max_sequence_tokens))


def initial_weights(config: EngineConfig, name: str, info: EngineInfo) -> dict[str, WeightsState]:
    """The weights each model serves at start: its configured version, from its configured path."""
    initial = {
        "policy": (config.weights_version, config.model or name),
        "reference": (config.ref_weights_version, config.ref_model),
        "critic": (config.critic_weights_version, config.critic),
    }
    now = time.time()
    return {
        m.role: WeightsState(m.role, initial[m.role][0], str(initial[m.role][1]), "initial", now)
        for m in info.models
    }

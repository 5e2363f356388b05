"""A decoder's forward over one packed row (base.py): transformers' own (transformers_forward.py) or
the fused one for Llama-family models and their mixture-of-experts kin (fused.py), chosen by `build`;
its CUDA graphs (graphs.py), and the transformers forward's MLP row chunks (mlp_chunks.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from service.engine.decoder.base import Decoder, DecoderKind, relative_error
from service.engine.decoder.fused import SUPPORTED, FusedDecoder, Stream, sparse, unsupported
from service.engine.decoder.transformers_forward import TransformersDecoder
from service.engine.moe import grouped_gemm
from service.engine.ops.attention import Kernel
from service.engine.ops.elementwise import Ops
from service.engine.ops.gate_up import GatedProjection
from service.engine.strategies.gemm import ONE_CALL, TokenGemms
from service.engine.strategies.sums import LOCAL, PartialSums

__all__ = [
    "SUPPORTED",
    "Decoder",
    "DecoderKind",
    "FusedDecoder",
    "Stream",
    "TransformersDecoder",
    "build",
    "relative_error",
    "sparse",
    "unsupported",
]


def build(  # noqa: PLR0917
    decoder: Any,
    setting: str,
    attention: Kernel,
    ops: Ops,
    mlp_chunk_tokens: int,
    projection: Callable[[], GatedProjection] | None = None,
    *,
    gemm: TokenGemms = ONE_CALL,
    sums: PartialSums = LOCAL,
    moe_kernel: Callable[[], grouped_gemm.MoeKernel] | None = None,
) -> Decoder:
    """The forward the `decoder` setting asks for: auto takes the fused one wherever it fits.
    `projection` makes the fused decoder's gate|up projection and `moe_kernel` its sparse layers'
    grouped GEMM (each called only when a fused decoder is built); `gemm` and `sums`: the strategies
    the fused decoder runs with (FusedDecoder; the transformers decoder's modules are patched by the
    caller, and it cannot take an all-reduce)."""
    if setting == "transformers":
        return TransformersDecoder(decoder)
    reason = unsupported(decoder)
    if reason is None:
        kernel = moe_kernel() if moe_kernel is not None and sparse(decoder) else grouped_gemm.LOOP
        return FusedDecoder(
            decoder, attention, ops, mlp_chunk_tokens, projection, gemm=gemm, sums=sums, moe_kernel=kernel
        )
    if setting == "fused":
        raise RuntimeError(f"decoder=fused: {reason}")
    return TransformersDecoder(decoder)

"""The start-up self-check: the engine's scores against the model's own transformers forward, on one
sequence, per model; a fused decoder that drifts past rounding gives way to transformers' (under
decoder=auto) or fails the start.

Boundary: a served CausalLM (or critic decoder) and one SequenceJob in; the largest |Δ| out, or
DecoderMismatch / RuntimeError naming the cause.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from service.core.jobs import SequenceJob
from service.engine import decoder
from service.engine.batch.packing import PackedBatch, pack
from service.engine.decoder.base import Decoder
from service.engine.moe import dispatch
from service.engine.moe import layer as moe
from service.engine.scorer.build import fused_of
from service.engine.scorer.models import CausalLM

log = logging.getLogger(__name__)

# |own forward - ours| <= RTOL * max|logit| + ATOL, per dtype, in the start-up self-check
_SELF_CHECK_TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2), torch.float16: (4e-3, 4e-3)}
# ‖fused - transformers‖ / ‖transformers‖ over final hidden states, per dtype, in the same self-check
_DECODER_TOL = {torch.float32: 1e-4, torch.bfloat16: 0.1, torch.float16: 0.02}
# Share of token-expert pairs a fused MoE router must choose as transformers' does at start: rounding
# flips a few near-tied pairs in half precision; a misread router (rule, top-k, weight) most of them
_ROUTING_AGREEMENT = 0.8


@torch.inference_mode()
def logits_check(lm: CausalLM, job: SequenceJob, device: torch.device) -> float:
    """Largest |Δ| between the model's own logits and ours on one sequence; raise if too large.

    Two checks, one cause each: the head on transformers' own decoder must give the model's own
    logits (catches a final-logit transform LogitTransform misses: the same decoder on both
    sides, so a tight bound), and a fused decoder must give transformers' hidden states up to
    rounding (check_hidden: catches a layer it misreads).
    """
    batch = pack([job], device, step=1)  # the model's own forward reads the row as one sequence
    every = torch.arange(batch.num_tokens, device=device)
    own = lm.model(input_ids=batch.input_ids, use_cache=False).logits[0].float()  # [L, V]
    hidden = decoder.TransformersDecoder(lm.model.base_model)(batch, every)
    ours = lm.transform(lm.lm_head(hidden).float())  # [L, V]
    rtol, atol = _SELF_CHECK_TOL[hidden.dtype]
    delta = float((own - ours).abs().max())
    bound = rtol * float(own.abs().max()) + atol
    if not delta <= bound:
        raise RuntimeError(
            f"{type(lm.model).__name__}: its own forward gives logits that differ from "
            f"lm_head(hidden) + {lm.transform} by {delta:.3g} (allowed {bound:.3g}); it applies a "
            "final-logit transform logprobd does not reproduce, so its scores would be wrong"
        )
    if lm.forward.kind == "fused":
        check_hidden(lm.model.base_model, lm.forward, job, device, type(lm.model).__name__)
    return delta


@dataclass(frozen=True, slots=True)
class Checked:
    delta: float  # the largest |Δ logits| against the model's own forward
    fell_back: bool  # the fused decoder gave way to the transformers decoder


def check_or_fall_back(
    lm: CausalLM, job: SequenceJob, device: torch.device, role: str, setting: str
) -> Checked:
    """logits_check(lm); under decoder=auto a fused decoder that fails it gives way to the transformers
    decoder, with a warning, instead of failing the start (a model whose hidden states drift further in
    half precision than the bound expects is served, if slower)."""
    try:
        return Checked(logits_check(lm, job, device), fell_back=False)
    except DecoderMismatch as exc:
        if setting != "auto":
            raise
        log.warning("%s: %s; serving it with the transformers decoder instead", role, exc)
    fused = fused_of(lm.forward)
    lm.forward = decoder.TransformersDecoder(lm.model.base_model, fused.attention if fused else None)
    return Checked(logits_check(lm, job, device), fell_back=True)


class DecoderMismatch(RuntimeError):
    """A fused decoder's hidden states are further from transformers' than rounding explains."""


@torch.inference_mode()
def check_hidden(base: Any, forward: Decoder, job: SequenceJob, device: torch.device, role: str) -> float:
    """‖ours - transformers'‖ / ‖transformers'‖ over the final hidden states [T, H] of one sequence;
    raise past _DECODER_TOL. Two half-precision forwards that round in another order drift apart over
    the layers (a few % at 28 bf16 layers), so the norm ratio, not the largest element, is bounded;
    a misread layer (a lost window, norm or rotation) moves it by tens of %.

    A fused decoder with mixture-of-experts layers runs pinned to the experts transformers' forward
    chose (its own router weights them): rounding flips near-tied router logits for a few tokens,
    and one token sent to another expert would count as a misread layer. What the routing itself
    gets right is bounded apart: in every sparse layer the experts it would have chosen must match
    transformers' for _ROUTING_AGREEMENT of the token-expert pairs."""
    batch = pack([job], device, step=1)
    every = torch.arange(batch.num_tokens, device=device)
    fused = fused_of(forward)
    layers = fused.sparse_layers if fused is not None else []
    routes, own = _recorded_routes(base, batch, every, len(layers))
    if routes is None:
        ours = forward(batch, every)
    else:
        assert fused is not None
        ours = _pinned_forward(fused, layers, routes, batch, every, role)
    error = decoder.relative_error(ours, own)
    bound = _DECODER_TOL[next(base.parameters()).dtype]
    if not error <= bound:
        raise DecoderMismatch(
            f"{role}: the {forward.kind} decoder's hidden states differ from transformers' by {error:.3g} "
            f"of their norm (allowed {bound:.3g}); try decoder=transformers"
        )
    log.info("%s: the %s decoder is within %.3g of transformers' hidden states", role, forward.kind, error)
    return error


def _recorded_routes(
    base: Any, batch: PackedBatch, every: torch.Tensor, sparse_layers: int
) -> tuple[list[torch.Tensor] | None, torch.Tensor]:
    """transformers' final hidden states [T, H] of `batch`, and the expert ids [T, k] its sparse
    layers' routers chose (None where the fused decoder has no sparse layer, or the routers do not
    return (logits, weights, ids) as transformers 5's do)."""
    blocks = [layer.mlp for layer in base.layers if hasattr(layer.mlp, "experts")]
    if not sparse_layers or len(blocks) != sparse_layers:
        return None, decoder.TransformersDecoder(base)(batch, every)
    seen: list[Any] = []
    hooks = [block.gate.register_forward_hook(lambda _m, _i, out: seen.append(out)) for block in blocks]
    try:
        own = decoder.TransformersDecoder(base)(batch, every)
    finally:
        for hook in hooks:
            hook.remove()
    if len(seen) != len(blocks) or not all(isinstance(out, tuple) and len(out) == 3 for out in seen):
        return None, own
    return [out[2] for out in seen], own


def _pinned_forward(  # noqa: PLR0917
    fused: decoder.FusedDecoder,
    layers: list[moe.SparseMoe],
    routes: list[torch.Tensor],
    batch: PackedBatch,
    every: torch.Tensor,
    role: str,
) -> torch.Tensor:
    """The fused decoder's hidden states, run eagerly (no graph keeps the pins) with each sparse layer
    pinned to `routes`; raise where a layer's own routing agrees with them too little."""
    for i, (layer, route) in enumerate(zip(layers, routes, strict=True)):
        if route.shape != (batch.num_tokens, layer.routing.top_k):
            raise DecoderMismatch(
                f"{role}: sparse layer {i}: transformers' router chose {tuple(route.shape)} expert ids "
                f"where the fused decoder routes {batch.num_tokens} tokens to {layer.routing.top_k} each"
            )
        layer.pinned = dispatch.Pin(route)
    try:
        ours = fused(batch, every)
    finally:
        pins = [layer.pinned for layer in layers]
        for layer in layers:
            layer.pinned = None
    shares = [_agreement(torch.cat(pin.own), route) for pin, route in zip(pins, routes, strict=True) if pin]
    worst = min(range(len(shares)), key=shares.__getitem__)
    if not shares[worst] >= _ROUTING_AGREEMENT:
        raise DecoderMismatch(
            f"{role}: sparse layer {worst}: the fused decoder's router chose transformers' experts for "
            f"{shares[worst]:.1%} of the token-expert pairs (at least {_ROUTING_AGREEMENT:.0%} expected); "
            "try decoder=transformers"
        )
    log.info(
        "%s: the fused routers chose transformers' experts for >= %.1f%% of pairs", role, 100 * shares[worst]
    )
    return ours


def _agreement(got: torch.Tensor, want: torch.Tensor) -> float:
    """The share of token-expert pairs of want [T, k] that got [T, k] also has (each token's set)."""
    return float((got[:, :, None] == want[:, None, :]).any(dim=-1).float().mean())

"""A decoder's forward over one packed row: transformers' own, or a lean one for Llama-family models.

Both give the final hidden states, normalised, of the rows the heads read (the position before
each action), and nothing for the other rows.

TransformersDecoder calls the model's forward with the packed-attention kwargs: every architecture.

FusedDecoder computes the same function for Llama, Mistral, Qwen2 and Qwen3 decoders (SiLU MLP, RoPE
over the whole head, RMSNorm), from the same parameters, in fewer kernels and no per-module Python.
A layer is:

    h = rms_norm(x)                      x: the residual stream [N, H], in the model's dtype
    qkv = h @ Wqkv + b                   one GEMM for the three projections
    rope_(qkv)                           q, k rotated in place (Qwen3: head norms first)
    o = attention(q, k, v)               the backend's packed kernel on views of qkv
    x += o @ Wo                          the GEMM accumulates into the residual (no add kernel)
    h = rms_norm(x)
    x += swiglu(h @ Wgate|up) @ Wdown    per MLP chunk of rows (gated.py: a GEMM then the SwiGLU op,
                                         or one GEMM whose epilogue applies SwiGLU)

The last layer's attention reads every row's keys and values; from its output projection on, it runs
on the rows the heads read only (a quarter of the tokens in a typical RL batch).

The q|k|v and gate|up weights are concatenated once at start, and the model's own parameters become
views of the concatenations: no second copy, and the transformers forward (the self-check), hot
reloads in copy mode and state dicts see them as before. A reload in swap mode rebinds parameters;
`refresh` then copies them into the concatenations and makes them views again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
import torch.nn.functional as F

from service.engine import invariant
from service.engine.attention import Kernel, Segments
from service.engine.context import KVContext
from service.engine.decoder_ops import HeadNorms, Ops
from service.engine.gated import GatedProjection, split
from service.engine.packing import PackedBatch

DecoderKind = Literal["fused", "transformers"]

# model_type -> the sliding window a layer's attention applies (transformers' own rule per model)
_WINDOW: dict[str, Callable[[Any], int | None]] = {
    "llama": lambda attn: None,
    "mistral": lambda attn: getattr(attn.config, "sliding_window", None),
    "qwen2": lambda attn: attn.sliding_window,
    "qwen3": lambda attn: attn.sliding_window,
}
SUPPORTED = tuple(_WINDOW)


class Decoder(Protocol):
    kind: DecoderKind

    def __call__(self, batch: PackedBatch, rows: torch.Tensor) -> torch.Tensor:
        """[len(rows), H]: the final (normalised) hidden state at each index of `rows` in the row."""

    def refresh(self) -> None:
        """Take up parameters that a reload rebound."""

    def warm(self, rows: int) -> None:
        """Run once, on zeros, the GEMMs a forward over `rows` rows runs (the same calls and shapes):
        cuBLAS stalls the host the first time it meets some shapes, so a server meets them first."""

    def capture(self, probe: PackedBatch) -> None:
        """Capture the CUDA graphs that serve micro-batches, checked on `probe` (graphs.py); none here."""


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """‖got - want‖ / ‖want‖ over every element, in float32: how two forwards' hidden states differ."""
    got, want = got.float(), want.float()
    return float(torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want).clamp_min(1e-30))


def _zeros(like: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    return torch.zeros(rows, width, dtype=like.dtype, device=like.device)


def _warm_rotary(decoder: Any, x: torch.Tensor) -> None:
    """The rotary embedding's outer product of frequencies and positions (a batched GEMM) over x's rows."""
    rotary = getattr(decoder, "rotary_emb", None)
    if rotary is not None:
        rotary(x[None], torch.zeros(1, x.shape[0], dtype=torch.long, device=x.device))


class TransformersDecoder:
    kind: DecoderKind = "transformers"

    def __init__(self, decoder: Any) -> None:
        self.decoder = decoder

    def __call__(self, batch: PackedBatch, rows: torch.Tensor) -> torch.Tensor:
        hidden: torch.Tensor = self.decoder(**batch.forward_kwargs()).last_hidden_state[0]  # [N, H]
        return hidden.index_select(0, rows)

    def capture(self, probe: PackedBatch) -> None:
        pass

    def refresh(self) -> None:
        pass

    def warm(self, rows: int) -> None:
        """Every distinct Linear of the layers, once; an MLP chunked by chunk_mlps meets its chunk
        sizes as `rows` of their own (multiples of the packing step, as the unset chunk is)."""
        embed = self.decoder.get_input_embeddings().weight
        _warm_rotary(self.decoder, _zeros(embed, rows, embed.shape[1]))
        seen = set()
        for module in self.decoder.layers.modules():
            if isinstance(module, torch.nn.Linear):
                key = (module.in_features, module.out_features, module.bias is None, module.weight.dtype)
                if key not in seen:
                    seen.add(key)
                    module(_zeros(module.weight, rows, module.in_features)[None])


@dataclass(slots=True)
class _Concat:
    """One linear map made of several Linear modules stacked by output rows; their parameters view it."""

    weight: torch.Tensor  # [sum of out_features, in_features]
    bias: torch.Tensor | None
    linears: tuple[torch.nn.Linear, ...]

    @classmethod
    def of(cls, *linears: torch.nn.Linear) -> _Concat:
        with torch.no_grad():
            weight = torch.cat([lin.weight for lin in linears])
            bias = torch.cat([lin.bias for lin in linears]) if linears[0].bias is not None else None
        concat = cls(weight, bias, linears)
        concat.refresh()
        return concat

    def refresh(self) -> None:
        """Make every part's parameters views of the concatenation, copying in any that were rebound."""
        start = 0
        with torch.no_grad():
            for lin in self.linears:
                end = start + lin.out_features
                for param, whole in ((lin.weight, self.weight), (lin.bias, self.bias)):
                    if param is None or whole is None:
                        continue
                    part = whole[start:end]
                    if param.data_ptr() != part.data_ptr():
                        part.copy_(param)
                        param.data = part
                start = end

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


@dataclass(frozen=True, slots=True)
class Stream:
    """A packed row between layers: the residual stream, which each layer updates in place, and what
    every layer reads besides it."""

    x: torch.Tensor  # [N, H]
    cos: torch.Tensor  # [N, D] the rotary tables of each row's position
    sin: torch.Tensor
    cu: torch.Tensor  # [S+1] int32 sequence boundaries (empty sequences may end them)
    max_len: int  # at least the longest sequence
    context: KVContext | None = None  # keys beyond the segments' own, and their boundaries (context.py)


@dataclass(slots=True)
class _Layer:
    input_norm: Any  # RMSNorm modules: .weight, .variance_epsilon (read per call: a reload may rebind)
    qkv: _Concat
    o_proj: torch.nn.Linear
    q_norm: Any
    k_norm: Any
    post_norm: Any
    gate_up: _Concat
    down_proj: torch.nn.Linear
    window: int | None
    scale: float
    index: int  # of the layer in the model (its keys' and values' place in a context)


class FusedDecoder:
    kind: DecoderKind = "fused"
    # Tensor parallel (sharding.py): sums a row-parallel GEMM's partial [rows, H] outputs over the
    # ranks, in place; None (one process): the GEMMs add into the residual stream themselves.
    reduce: Callable[[torch.Tensor], None] | None = None

    def __init__(
        self,
        decoder: Any,
        attention: Kernel,
        ops: Ops,
        mlp_chunk_tokens: int,
        projection: Callable[[], GatedProjection] | None = None,
        *,
        gemm_rows: int | None = None,
    ) -> None:
        """gemm_rows: run every GEMM over tokens in calls of that many rows (batch invariance,
        invariant.py); None: one call each."""
        reason = unsupported(decoder)
        if reason is not None:
            raise ValueError(f"the fused decoder cannot run this model: {reason}")
        config = decoder.config
        self.decoder = decoder
        self.attention = attention
        self.ops = ops
        self.gated = projection() if projection is not None else split(ops.swiglu)
        self.chunk = mlp_chunk_tokens if mlp_chunk_tokens > 0 else 1 << 62
        self.rows = gemm_rows
        if gemm_rows is not None:  # every MLP chunk a whole number of GEMM calls
            self.chunk = max(gemm_rows, self.chunk // gemm_rows * gemm_rows)
        first = decoder.layers[0].self_attn
        self.head_dim = int(first.head_dim)
        self.q_heads = int(config.num_attention_heads)
        self.k_heads = int(config.num_key_value_heads)
        window = _WINDOW[str(config.model_type)]
        self.layers = [
            _Layer(
                input_norm=layer.input_layernorm,
                qkv=_Concat.of(layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
                o_proj=layer.self_attn.o_proj,
                q_norm=getattr(layer.self_attn, "q_norm", None),
                k_norm=getattr(layer.self_attn, "k_norm", None),
                post_norm=layer.post_attention_layernorm,
                gate_up=_Concat.of(layer.mlp.gate_proj, layer.mlp.up_proj),
                down_proj=layer.mlp.down_proj,
                window=window(layer.self_attn),
                scale=float(layer.self_attn.scaling),
                index=index,
            )
            for index, layer in enumerate(decoder.layers[: config.num_hidden_layers])
        ]

    def capture(self, probe: PackedBatch) -> None:
        pass

    def refresh(self) -> None:
        for layer in self.layers:
            layer.qkv.refresh()
            layer.gate_up.refresh()

    def warm(self, rows: int) -> None:
        """A layer's four GEMMs as the forward calls them, per distinct layer shape; the last layer's
        output projection and MLP run on the read rows, whose count is padded like the tokens'."""
        embed = self.decoder.embed_tokens.weight
        _warm_rotary(self.decoder, _zeros(embed, rows, embed.shape[1]))
        seen = set()
        for layer in self.layers:
            key = (layer.qkv.weight.shape, layer.o_proj.weight.shape, layer.gate_up.weight.shape)
            if key in seen:
                continue
            seen.add(key)
            x = _zeros(layer.o_proj.weight, rows, layer.o_proj.out_features)
            layer.qkv(x)
            _accumulate(x, _zeros(x, rows, layer.o_proj.in_features), layer.o_proj)
            for start in range(0, rows, self.chunk):
                end = min(start + self.chunk, rows)
                _accumulate(x[start:end], self._mlp_in(layer, x[start:end]), layer.down_proj)

    def __call__(self, batch: PackedBatch, rows: torch.Tensor) -> torch.Tensor:
        stream = self.start(batch.input_ids[0], batch.position_ids, batch.cu_seqlens, batch.max_len)
        if batch.context is not None:
            stream = dataclasses.replace(stream, context=batch.context)
        for layer in self.layers[:-1]:
            self.run_layer(layer, stream)
        return self.finish(stream, rows)

    def start(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, cu: torch.Tensor, max_len: int
    ) -> Stream:
        """The embeddings of input_ids [N] and the rotary tables of position_ids [1, N]."""
        x = self.decoder.embed_tokens(input_ids)  # [N, H] the residual stream
        cos, sin = self.decoder.rotary_emb(x[None], position_ids)  # [1, N, D] each, x's dtype
        return Stream(x, cos[0].contiguous(), sin[0].contiguous(), cu, max_len)

    def finish(self, stream: Stream, rows: torch.Tensor) -> torch.Tensor:
        """The last layer and the final norm, from the stream after every other layer: [len(rows), H]."""
        x = self.run_layer(self.layers[-1], stream, rows)
        norm = self.decoder.norm
        return self.ops.rms_norm(x, norm.weight, norm.variance_epsilon)

    def run_layer(self, layer: _Layer, stream: Stream, rows: torch.Tensor | None = None) -> torch.Tensor:
        """One layer over the stream, in place; with `rows`, attention reads every row and the rest runs
        on `rows` only (no row reads another past attention), into a new tensor. Returns the residual."""
        ops, x, cos, sin = self.ops, stream.x, stream.cos, stream.sin
        hq, hk, d, n = self.q_heads, self.k_heads, self.head_dim, x.shape[0]
        h = ops.rms_norm(x, layer.input_norm.weight, layer.input_norm.variance_epsilon)
        qkv = invariant.linear(h, layer.qkv.weight, layer.qkv.bias, self.rows)  # [N, (hq + 2·hk)·d]
        del h
        norms = None
        if layer.q_norm is not None:
            norms = HeadNorms(layer.q_norm.weight, layer.k_norm.weight, layer.q_norm.variance_epsilon)
        ops.rope_(qkv, cos, sin, hq, hk, d, norms)
        q = qkv[:, : hq * d].view(n, hq, d)
        k = qkv[:, hq * d : (hq + hk) * d].view(n, hk, d)
        v = qkv[:, (hq + hk) * d :].view(n, hk, d)
        seg = Segments(stream.cu, stream.max_len, layer.scale, layer.window, None)
        if stream.context is not None:
            k, v = stream.context.extend(layer.index, k, v)
            seg = dataclasses.replace(seg, cu_k=stream.context.cu_k, max_len_k=stream.context.max_len_k)
        attended = self.attention(q, k, v, seg).reshape(n, hq * d)
        del qkv, q, k, v
        if rows is not None:
            x, attended = x.index_select(0, rows), attended.index_select(0, rows)
        if self.reduce is not None:
            return self._run_sharded_out(layer, x, attended, self.reduce)
        _accumulate(x, attended, layer.o_proj, self.rows)
        del attended
        h = ops.rms_norm(x, layer.post_norm.weight, layer.post_norm.variance_epsilon)
        for start in range(0, x.shape[0], self.chunk):
            end = min(start + self.chunk, x.shape[0])
            _accumulate(x[start:end], self._mlp_in(layer, h[start:end]), layer.down_proj, self.rows)
        return x

    def _run_sharded_out(
        self, layer: _Layer, x: torch.Tensor, attended: torch.Tensor, reduce: Callable[[torch.Tensor], None]
    ) -> torch.Tensor:
        """run_layer from the output projection on, tensor parallel: o_proj and down_proj hold this
        rank's input columns, so each gives a partial [rows, H] that one all-reduce sums (the MLP's
        chunks into one buffer: one all-reduce per layer each); their biases are added once, after."""
        partial = F.linear(attended, layer.o_proj.weight)  # [rows, H]
        reduce(partial)
        x.add_(partial)
        if layer.o_proj.bias is not None:
            x.add_(layer.o_proj.bias)
        h = self.ops.rms_norm(x, layer.post_norm.weight, layer.post_norm.variance_epsilon)
        for start in range(0, x.shape[0], self.chunk):
            end = min(start + self.chunk, x.shape[0])
            partial[start:end] = F.linear(self._mlp_in(layer, h[start:end]), layer.down_proj.weight)
        reduce(partial)
        x.add_(partial)
        if layer.down_proj.bias is not None:
            x.add_(layer.down_proj.bias)
        return x

    def _mlp_in(self, layer: _Layer, h: torch.Tensor) -> torch.Tensor:
        """silu(h·Wgateᵀ) · (h·Wupᵀ): [rows, I]."""
        weight, bias = layer.gate_up.weight, layer.gate_up.bias
        return invariant.by_rows(lambda part: self.gated.project(part, weight, bias), h, self.rows)


def _accumulate(x: torch.Tensor, a: torch.Tensor, linear: torch.nn.Linear, rows: int | None = None) -> None:
    """x += linear(a), in place, the GEMM adding into x (one rounding, where transformers has two);
    in calls of `rows` rows where given (invariant.py)."""
    invariant.accumulate(x, a, linear.weight, rows)
    if linear.bias is not None:
        x.add_(linear.bias)


def unsupported(decoder: Any) -> str | None:
    """Why the fused decoder cannot compute `decoder`'s forward; None when it can."""
    config: Any = getattr(decoder, "config", None)
    model_type = str(getattr(config, "model_type", None))
    if model_type not in _WINDOW:
        return f"model_type {model_type!r} is not one of {', '.join(SUPPORTED)}"
    if getattr(config, "hidden_act", None) != "silu":
        return f"hidden_act {getattr(config, 'hidden_act', None)!r} is not silu"
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(decoder, name):
            return f"{type(decoder).__name__} has no {name}"
    linear = torch.nn.Linear
    for i, layer in enumerate(decoder.layers[: config.num_hidden_layers]):
        attn: Any = getattr(layer, "self_attn", None)
        mlp: Any = getattr(layer, "mlp", None)
        parts: list[Any] = [getattr(attn, name, None) for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
        parts += [getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
        if not all(type(p) is linear for p in parts):
            return f"layer {i}: the projections are not the seven plain Linear modules of a Llama layer"
        for group in (parts[:3], parts[4:6]):
            if len({p.bias is None for p in group}) != 1:
                return f"layer {i}: some projections of a fused group have a bias and some not"
        norms = [getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None)]
        if (getattr(attn, "q_norm", None) is None) != (model_type != "qwen3"):
            return f"layer {i}: per-head q/k norms do not match {model_type}"
        if model_type == "qwen3":
            norms += [attn.q_norm, attn.k_norm]
        if not all(_is_rms_norm(m) for m in [*norms, decoder.norm]):
            return f"layer {i}: a norm is not a plain RMSNorm (weight · x / rms)"
        if int(attn.head_dim) * int(config.num_attention_heads) != attn.q_proj.out_features:
            return f"layer {i}: q_proj's width is not heads * head_dim"
    head_dim = int(decoder.layers[0].self_attn.head_dim)
    probe = torch.zeros(1, 1, 1, device=decoder.norm.weight.device, dtype=decoder.norm.weight.dtype)
    cos, _ = decoder.rotary_emb(probe, torch.zeros(1, 1, dtype=torch.long, device=probe.device))
    if cos.shape[-1] != head_dim:
        return f"RoPE covers {cos.shape[-1]} of {head_dim} head dimensions"
    return None


def _is_rms_norm(module: Any) -> bool:
    """A Llama/Mistral/Qwen RMSNorm: weight · (x / rms(x)), no bias (not, e.g., a patched LayerNorm)."""
    return (
        type(module).__name__.endswith("RMSNorm")
        and hasattr(module, "variance_epsilon")
        and isinstance(getattr(module, "weight", None), torch.Tensor)
        and getattr(module, "bias", None) is None
    )


def build(  # noqa: PLR0917
    decoder: Any,
    setting: str,
    attention: Kernel,
    ops: Ops,
    mlp_chunk_tokens: int,
    projection: Callable[[], GatedProjection] | None = None,
    gemm_rows: int | None = None,
) -> Decoder:
    """The forward the `decoder` setting asks for: auto takes the fused one wherever it fits.
    `projection` makes the fused decoder's gate|up projection (called only when it is built);
    gemm_rows: batch invariance (invariant.py; the transformers decoder's Linear modules are blocked
    by the caller)."""
    if setting == "transformers":
        return TransformersDecoder(decoder)
    reason = unsupported(decoder)
    if reason is None:
        return FusedDecoder(decoder, attention, ops, mlp_chunk_tokens, projection, gemm_rows=gemm_rows)
    if setting == "fused":
        raise RuntimeError(f"decoder=fused: {reason}")
    return TransformersDecoder(decoder)

"""The fused decoder: a lean forward over one packed row for Llama-family models and their
mixture-of-experts kin, giving what transformers' own forward (transformers_forward.py) gives: the
final hidden states, normalised, of the rows the heads read, and nothing for the other rows.

FusedDecoder computes that function for Llama, Mistral, Qwen2 and Qwen3 decoders (SiLU MLP, RoPE
over the whole head, RMSNorm) and for Qwen3-MoE, Qwen2-MoE and Mixtral, whose sparse layers' MLP is
moe/layer.py's (router, grouped expert GEMMs); from the same parameters, in fewer kernels and no
per-module Python. A layer is:

    h = rms_norm(x)                      x: the residual stream [N, H], in the model's dtype
    qkv = h @ Wqkv + b                   one GEMM for the three projections
    rope_(qkv)                           q, k rotated in place (Qwen3: head norms first)
    o = attention(q, k, v)               the backend's packed kernel on views of qkv
    x += o @ Wo                          the GEMM accumulates into the residual (no add kernel)
    h = rms_norm(x)
    x += swiglu(h @ Wgate|up) @ Wdown    per MLP chunk of rows (ops/gate_up.py: a GEMM then the SwiGLU op,
                                         or one GEMM whose epilogue applies SwiGLU); a sparse layer:
                                         x += moe(h) (moe/layer.py)

The last layer's attention reads every row's keys and values; from its output projection on, it runs
on the rows the heads read only (a quarter of the tokens in a typical RL batch). A batch with MoE
routes (moe/replay.py) sets them on the sparse layers for the forward; its last sparse layer then
runs the output projection and the router on every row (routes are recorded for all), its experts on
the read rows.

The q|k|v and gate|up weights are concatenated once at start, and the model's own parameters become
views of the concatenations: no second copy, and the transformers forward (the self-check), hot
reloads in copy mode and state dicts see them as before. A reload in swap mode rebinds parameters;
`refresh` then copies them into the concatenations and makes them views again. Experts' weights are
the model's own 3-D parameters, read at each call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from service.engine.batch.device_routes import BatchRoutes, LayerRoutes
from service.engine.batch.kv_store import KVContext
from service.engine.batch.packing import PackedBatch
from service.engine.contract import SHAPE_STEP
from service.engine.decoder.base import DecoderKind, warm_rotary, zeros
from service.engine.moe import dispatch, grouped_gemm, routing_rule
from service.engine.moe import kernels as moe_ops
from service.engine.moe import layer as moe
from service.engine.ops.attention import Kernel, Segments
from service.engine.ops.elementwise import HeadNorms, Ops
from service.engine.ops.gate_up import GatedProjection, split
from service.engine.strategies.gemm import ONE_CALL, FixedTiles, TokenGemms
from service.engine.strategies.sums import LOCAL, AllReduce, PartialSums

log = logging.getLogger(__name__)

# model_type -> the sliding window a layer's attention applies (transformers' own rule per model)
_WINDOW: dict[str, Callable[[Any], int | None]] = {
    "llama": lambda attn: None,
    "mistral": lambda attn: getattr(attn.config, "sliding_window", None),
    "qwen2": lambda attn: attn.sliding_window,
    "qwen3": lambda attn: attn.sliding_window,
    "qwen3_moe": lambda attn: attn.sliding_window,
    "qwen2_moe": lambda attn: getattr(attn, "sliding_window", None),
    "mixtral": lambda attn: getattr(attn.config, "sliding_window", None),
}
HEAD_NORMS = frozenset({"qwen3", "qwen3_moe"})  # per-head q/k RMSNorm before RoPE
SUPPORTED = tuple(_WINDOW)


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
    context: KVContext | None = None  # keys beyond its segments' own (batch/kv_store.py)


@dataclass(slots=True)
class _Dense:
    """A SwiGLU MLP: [gate; up] concatenated, and the down projection."""

    gate_up: _Concat
    down_proj: torch.nn.Linear


@dataclass(slots=True)
class _Layer:
    input_norm: Any  # RMSNorm modules: .weight, .variance_epsilon (read per call: a reload may rebind)
    qkv: _Concat
    o_proj: torch.nn.Linear
    q_norm: Any
    k_norm: Any
    post_norm: Any
    mlp: _Dense | moe.SparseMoe
    window: int | None
    scale: float
    index: int  # of the layer in the model (its keys' and values' place in a context)


class FusedDecoder:
    kind: DecoderKind = "fused"

    def __init__(
        self,
        decoder: Any,
        attention: Kernel,
        ops: Ops,
        mlp_chunk_tokens: int,
        projection: Callable[[], GatedProjection] | None = None,
        *,
        gemm: TokenGemms = ONE_CALL,
        sums: PartialSums = LOCAL,
        moe_kernel: grouped_gemm.MoeKernel = grouped_gemm.LOOP,
    ) -> None:
        """gemm: how every GEMM over tokens runs (strategies/gemm.py: fixed-row calls in batch-invariant
        mode); sums: how the output and down projections add into the residual (strategies/sums.py: an
        all-reduce under tensor parallel); moe_kernel: the sparse layers' grouped GEMM
        (moe/grouped_gemm.py)."""
        reason = unsupported(decoder)
        if reason is not None:
            raise ValueError(f"the fused decoder cannot run this model: {reason}")
        config = decoder.config
        self.decoder = decoder
        self.attention = attention
        self.ops = ops
        self.gemm, self.sums = gemm, sums
        self.chunk = gemm.whole_calls(mlp_chunk_tokens if mlp_chunk_tokens > 0 else 1 << 62)
        first = decoder.layers[0].self_attn
        self.head_dim = int(first.head_dim)
        self.q_heads = int(config.num_attention_heads)
        self.k_heads = int(config.num_key_value_heads)
        model_type = str(config.model_type)
        window = _WINDOW[model_type]
        self.moe_kernel = grouped_gemm.blocked(moe_kernel) if gemm.rows is not None else moe_kernel
        if isinstance(gemm, FixedTiles) and not self.moe_kernel.row_invariant and sparse(decoder):
            # one call over a micro-batch's tokens, of any count: only a row-invariant kernel keeps bits
            log.warning(
                "batch_invariant: the experts' %s GEMMs are not row-invariant; they run one expert at a "
                "time in calls of %d rows",
                self.moe_kernel.name,
                grouped_gemm.EXPERT_ROWS,
            )
            self.moe_kernel = grouped_gemm.blocked(grouped_gemm.LOOP)
        self._concats: list[_Concat] = []  # every concatenation, for refresh
        self.layers = [
            _Layer(
                input_norm=layer.input_layernorm,
                qkv=self._concat(layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
                o_proj=layer.self_attn.o_proj,
                q_norm=getattr(layer.self_attn, "q_norm", None),
                k_norm=getattr(layer.self_attn, "k_norm", None),
                post_norm=layer.post_attention_layernorm,
                mlp=self._mlp(layer.mlp, model_type),
                window=window(layer.self_attn),
                scale=float(layer.self_attn.scaling),
                index=index,
            )
            for index, layer in enumerate(decoder.layers[: config.num_hidden_layers])
        ]
        if isinstance(sums, AllReduce) and self.sparse:
            raise ValueError("tensor parallel runs dense models only; this one has mixture-of-experts layers")
        # the gate|up kernel is chosen (and probed: a compile on a cold cache) only if a layer runs one
        gated = any(isinstance(x.mlp, _Dense) or x.mlp.shared is not None for x in self.layers)
        self.gated = projection() if projection is not None and gated else split(ops.swiglu)
        self.load = self._count_experts(decoder.embed_tokens.weight.device)

    def _concat(self, *linears: torch.nn.Linear) -> _Concat:
        concat = _Concat.of(*linears)
        self._concats.append(concat)
        return concat

    def _mlp(self, mlp: Any, model_type: str) -> _Dense | moe.SparseMoe:
        if not hasattr(mlp, "experts"):
            return _Dense(self._concat(mlp.gate_proj, mlp.up_proj), mlp.down_proj)
        rule = routing_rule.routing(model_type, self.decoder.config)
        assert rule is not None
        shared = None
        if getattr(mlp, "shared_expert", None) is not None:
            shared = self._shared_expert(
                _Dense(
                    self._concat(mlp.shared_expert.gate_proj, mlp.shared_expert.up_proj),
                    mlp.shared_expert.down_proj,
                ),
                mlp.shared_expert_gate,
            )
        kernels = self.ops.name == "triton"
        return moe.SparseMoe(
            mlp.gate,
            mlp.experts,
            rule,
            self.moe_kernel,
            self.ops.swiglu,
            shared,
            moe_ops.combine_kernel if kernels else moe_ops.combine_torch,
            dispatch.plan_kernel if kernels else dispatch.plan,
            gemm=self.gemm,
        )

    def _count_experts(self, device: torch.device) -> moe.Load | None:
        """A Load over the sparse layers but the last, each layer given its Tally; None if there are none."""
        counted = [layer.mlp for layer in self.layers[:-1] if isinstance(layer.mlp, moe.SparseMoe)]
        if not counted:
            return None
        filler = max(SHAPE_STEP, self.gemm.step)  # a packed row's filler is less than its step
        experts = counted[0].experts.gate_up_proj.shape[0]
        load = moe.Load(len(counted), experts, 1 << (filler - 1).bit_length(), device)
        for index, mlp in enumerate(counted):
            mlp.tally = load.tally(index)
            mlp.count = moe_ops.count_kernel if self.ops.name == "triton" else moe_ops.count_torch
        return load

    def _shared_expert(self, dense: _Dense, gate: torch.nn.Linear) -> moe.SharedExpert:
        """Qwen2-MoE's shared expert: sigmoid(h·wgᵀ) · mlp(h), rounded as transformers does."""

        def shared(h: torch.Tensor) -> torch.Tensor:
            out = self.gemm.linear(self._mlp_in(dense, h), dense.down_proj.weight, None)
            return torch.sigmoid(self.gemm.linear(h, gate.weight, None)) * out

        return shared

    @property
    def sparse(self) -> bool:
        """Whether a layer is a mixture of experts."""
        return bool(self.sparse_layers)

    @property
    def sparse_layers(self) -> list[moe.SparseMoe]:
        """The mixture-of-experts layers, in order."""
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, moe.SparseMoe)]

    def capture(self, probe: PackedBatch) -> None:
        pass

    def expert_counts(self) -> torch.Tensor | None:
        return self.load.counts if self.load is not None else None

    def begin(self, batch: PackedBatch) -> None:
        """Before a forward over `batch` (outside any graph): the expert counts start from zero."""
        if self.load is not None:
            self.load.begin(batch.num_tokens, batch.filler)

    def refresh(self) -> None:
        for concat in self._concats:
            concat.refresh()

    def warm(self, rows: int) -> None:
        """A layer's four GEMMs as the forward calls them, per distinct layer shape; the last layer's
        output projection and MLP run on the read rows, whose count is padded like the tokens'. A
        sparse layer runs its router and grouped expert GEMMs on zeros (every token routed alike):
        the grouped GEMM takes the per-expert row counts on the device, and the host, which picks
        its kernel, sees only the total rows (rows · k) and the weights' shape (moe/grouped_gemm.py), so
        one call per row count meets every routing a micro-batch of that size can have."""
        embed = self.decoder.embed_tokens.weight
        warm_rotary(self.decoder, zeros(embed, rows, embed.shape[1]))
        seen = set()
        for layer in self.layers:
            mlp = layer.mlp
            width = mlp.gate_up.weight.shape if isinstance(mlp, _Dense) else mlp.experts.gate_up_proj.shape
            key = (layer.qkv.weight.shape, layer.o_proj.weight.shape, type(mlp), width)
            if key in seen:
                continue
            seen.add(key)
            x = zeros(layer.o_proj.weight, rows, layer.o_proj.out_features)
            layer.qkv(x)
            LOCAL.add(x, [(slice(None), zeros(x, rows, layer.o_proj.in_features))], layer.o_proj, ONE_CALL)
            self._run_mlp(mlp, x, x, LOCAL)  # no collective: a warm-up runs on this rank alone

    def __call__(self, batch: PackedBatch, rows: torch.Tensor) -> torch.Tensor:
        self.begin(batch)
        stream = self.start(batch.input_ids[0], batch.position_ids, batch.cu_seqlens, batch.max_len)
        if batch.context is not None:
            stream = dataclasses.replace(stream, context=batch.context)
        with self.routed(batch.routes):
            for layer in self.layers[:-1]:
                self.run_layer(layer, stream)
            return self.finish(stream, rows)

    @contextlib.contextmanager
    def routed(self, routes: BatchRoutes | None) -> Iterator[None]:
        """Within it, the sparse layers replay and record `routes` (moe/replay.py); None: nothing to do."""
        if routes is None:
            yield
            return
        sparse = self.sparse_layers
        if not sparse:
            raise ValueError("routes given or asked for, but this decoder has no mixture-of-experts layer")
        for index, mlp in enumerate(sparse):
            mlp.routes = routes.layer(index)
        try:
            yield
        finally:
            for mlp in sparse:
                mlp.routes = None

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
        qkv = self.gemm.linear(h, layer.qkv.weight, layer.qkv.bias)  # [N, (hq + 2·hk)·d]
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
        mlp = layer.mlp
        if rows is not None and isinstance(mlp, moe.SparseMoe) and mlp.routes is not None:
            return self._routed_rows(layer, mlp, mlp.routes, x, attended, rows)
        if rows is not None:
            x, attended = x.index_select(0, rows), attended.index_select(0, rows)
        self.sums.add(x, [(slice(None), attended)], layer.o_proj, self.gemm)
        del attended
        h = ops.rms_norm(x, layer.post_norm.weight, layer.post_norm.variance_epsilon)
        self._run_mlp(mlp, x, h, self.sums)
        return x

    def _routed_rows(  # noqa: PLR0917
        self,
        layer: _Layer,
        mlp: moe.SparseMoe,
        routes: LayerRoutes,
        x: torch.Tensor,
        attended: torch.Tensor,
        rows: torch.Tensor,
    ) -> torch.Tensor:
        """run_layer's tail over `rows` for a sparse layer that replays or records: its routes are
        recorded at every row (the output projection and the router run on all of them, in place on
        x), its experts run on `rows`, taking the routes given there."""
        self.sums.add(x, [(slice(None), attended)], layer.o_proj, self.gemm)
        h = self.ops.rms_norm(x, layer.post_norm.weight, layer.post_norm.variance_epsilon)
        mlp.observe(h)
        x, h = x.index_select(0, rows), h.index_select(0, rows)
        mlp.routes = routes.gathered(rows)
        try:
            self._run_mlp(mlp, x, h, self.sums)
        finally:
            mlp.routes = routes
        return x

    def _chunks(self, n: int) -> list[slice]:
        """The MLP's row chunks of n rows: its [rows, I] intermediate is never whole."""
        return [slice(start, min(start + self.chunk, n)) for start in range(0, n, self.chunk)]

    def _run_mlp(
        self, mlp: _Dense | moe.SparseMoe, x: torch.Tensor, h: torch.Tensor, sums: PartialSums
    ) -> None:
        """x += mlp(h) in place, for x and h [rows, H], chunk by chunk of rows."""
        if isinstance(mlp, moe.SparseMoe):
            for rows in self._chunks(x.shape[0]):
                mlp.add_to(x[rows], h[rows], rows.start)
            return
        parts = ((rows, self._mlp_in(mlp, h[rows])) for rows in self._chunks(x.shape[0]))
        sums.add(x, parts, mlp.down_proj, self.gemm)

    def _mlp_in(self, mlp: _Dense, h: torch.Tensor) -> torch.Tensor:
        """silu(h·Wgateᵀ) · (h·Wupᵀ): [rows, I]."""
        weight, bias = mlp.gate_up.weight, mlp.gate_up.bias
        project, fixed_tile = self.gated.project, self.gated.name == "quack"
        return self.gemm.by_rows(lambda part: project(part, weight, bias), h, fixed_tile=fixed_tile)


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
    for i, layer in enumerate(decoder.layers[: config.num_hidden_layers]):
        attn: Any = getattr(layer, "self_attn", None)
        parts: list[Any] = [getattr(attn, name, None) for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
        if not all(type(p) is torch.nn.Linear for p in parts):
            return f"layer {i}: q, k, v and o are not the four plain Linear modules of a Llama layer"
        if len({p.bias is None for p in parts[:3]}) != 1:
            return f"layer {i}: some of q, k and v have a bias and some not"
        reason = _mlp_unsupported(getattr(layer, "mlp", None), model_type, config)
        if reason is not None:
            return f"layer {i}: {reason}"
        norms = [getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None)]
        if (getattr(attn, "q_norm", None) is None) != (model_type not in HEAD_NORMS):
            return f"layer {i}: per-head q/k norms do not match {model_type}"
        if model_type in HEAD_NORMS:
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


def _mlp_unsupported(mlp: Any, model_type: str, config: Any) -> str | None:
    """Why a layer's MLP is neither a plain SwiGLU MLP nor a sparse block moe/layer.py computes."""
    if hasattr(mlp, "experts"):
        if model_type not in routing_rule.MOE_TYPES:
            return f"a mixture-of-experts block in a {model_type} model"
        return moe.unsupported(mlp, model_type, config)
    dense: list[Any] = [getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    if not all(type(p) is torch.nn.Linear for p in dense):
        return "the MLP is not three plain Linear modules (gate, up, down)"
    if len({p.bias is None for p in dense[:2]}) != 1:
        return "one of gate and up has a bias and the other not"
    return None


def sparse(decoder: Any) -> bool:
    """Whether a layer of `decoder` (transformers' modules) is a mixture of experts."""
    return any(hasattr(layer.mlp, "experts") for layer in decoder.layers)


def _is_rms_norm(module: Any) -> bool:
    """A Llama/Mistral/Qwen RMSNorm: weight · (x / rms(x)), no bias (not, e.g., a patched LayerNorm)."""
    return (
        type(module).__name__.endswith("RMSNorm")
        and hasattr(module, "variance_epsilon")
        and isinstance(getattr(module, "weight", None), torch.Tensor)
        and getattr(module, "bias", None) is None
    )

"""transformers' own forward over one packed row: every architecture, its modules as they are (liger's
patches, batch invariance's fixed-row GEMMs and the MLP row chunks applied to them by the builder).

Boundary: a PackedBatch (its packed-attention kwargs) and rows [R] in; [R, H] hidden states out.
A batch with MoE routes replays and records them through hooks on the routers (moe/replay.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from service.engine.batch.device_routes import BatchRoutes
from service.engine.batch.packing import PackedBatch
from service.engine.decoder.base import DecoderKind, warm_rotary, zeros
from service.engine.moe import routing_rule
from service.engine.moe.replay import RouterHook
from service.engine.ops.attention import KERNEL_KWARG, Kernel


class TransformersDecoder:
    kind: DecoderKind = "transformers"

    def __init__(self, decoder: Any, attention: Kernel | None = None) -> None:
        """attention: the packed attention kernel its layers run, where it is not the registered
        backend's (batch-invariant mode's, ops/attention.py `invariant`); None: the registered one."""
        self.decoder = decoder
        self.attention = attention

    def __call__(self, batch: PackedBatch, rows: torch.Tensor) -> torch.Tensor:
        kwargs = batch.forward_kwargs()
        if self.attention is not None:
            kwargs[KERNEL_KWARG] = self.attention
        with self.routed(batch.routes):
            hidden: torch.Tensor = self.decoder(**kwargs).last_hidden_state[0]  # [N, H]
        return hidden.index_select(0, rows)

    @contextlib.contextmanager
    def routed(self, routes: BatchRoutes | None) -> Iterator[None]:
        """Within it, every sparse block's router (transformers 5's TopKRouter, which returns (logits,
        weights, ids)) replays and records `routes` through a forward hook (moe/replay.py)."""
        if routes is None:
            yield
            return
        blocks = [layer.mlp for layer in self.decoder.layers if hasattr(layer.mlp, "experts")]
        rule = routing_rule.routing(str(self.decoder.config.model_type), self.decoder.config)
        if not blocks or rule is None:
            raise ValueError(
                f"routes given or asked for, but {type(self.decoder).__name__} has no mixture-of-experts "
                "layer whose routing logprobd knows (Qwen3-MoE, Qwen2-MoE, Mixtral)"
            )
        routers = [RouterHook(routes.layer(index), rule) for index in range(len(blocks))]
        hooks = [
            block.gate.register_forward_hook(router) for block, router in zip(blocks, routers, strict=True)
        ]
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()
        tokens = routes.used.shape[0]
        missed = [i for i, router in enumerate(routers) if router.next != tokens]
        if missed:  # a patched block (kernels=liger) that routes without calling its router module
            raise RuntimeError(
                f"routes: the routers of sparse layers {missed} did not route the batch's {tokens} tokens "
                "(a patched MoE block); replay needs transformers' own sparse blocks"
            )

    def capture(self, probe: PackedBatch) -> None:
        pass

    def expert_counts(self) -> torch.Tensor | None:
        return None

    def refresh(self) -> None:
        pass

    def warm(self, rows: int) -> None:
        """Every distinct Linear of the layers, once; an MLP chunked by chunk_mlps meets its chunk
        sizes as `rows` of their own (multiples of the packing step, as the unset chunk is)."""
        embed = self.decoder.get_input_embeddings().weight
        warm_rotary(self.decoder, zeros(embed, rows, embed.shape[1]))
        seen = set()
        for module in self.decoder.layers.modules():
            if isinstance(module, torch.nn.Linear):
                key = (module.in_features, module.out_features, module.bias is None, module.weight.dtype)
                if key not in seen:
                    seen.add(key)
                    module(zeros(module.weight, rows, module.in_features)[None])

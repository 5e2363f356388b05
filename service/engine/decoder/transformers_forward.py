"""transformers' own forward over one packed row: every architecture, its modules as they are (liger's
patches, batch invariance's fixed-row GEMMs and the MLP row chunks applied to them by the builder).

Boundary: a PackedBatch (its packed-attention kwargs) and rows [R] in; [R, H] hidden states out.
"""

from __future__ import annotations

from typing import Any

import torch

from service.engine.batch.packing import PackedBatch
from service.engine.decoder.contract import DecoderKind, warm_rotary, zeros
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
        hidden: torch.Tensor = self.decoder(**kwargs).last_hidden_state[0]  # [N, H]
        return hidden.index_select(0, rows)

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

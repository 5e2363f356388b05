"""Keys and values a packed row's last segment attends to beyond its own tokens.

A micro-batch's queries are its N packed tokens; a segment's keys are normally its own tokens. A
segment may instead attend to a *context* first: the keys and values, per layer, of tokens that an
earlier micro-batch computed (the chunks before it of a sequence too long for one micro-batch).
Varlen attention then takes key boundaries `cu_k` that differ from the query boundaries: the
segment's keys are its context followed by its own tokens, and causal masking is bottom-right
aligned (query i of a segment of q queries and k keys sees keys j <= i + k - q).

The context is the last segment of the row. Each layer writes that segment's fresh keys and values
into the store behind what is cached, and attends over

    keys = [fresh keys of the other segments | cached keys 0 .. start + q)      [N - q + start + q, Hk, D]

which is a view of the store when the context segment is alone in the row, and one copy otherwise.
Store: per layer, [capacity, Hk, D] keys and values in the model's dtype, allocated at the first
layer call; a model's store costs layers x 2 x Hk x D x capacity x dtype bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

# The keyword argument of a transformers decoder forward that carries a KVContext to the attention
CONTEXT_KWARG = "logprobd_context"


def cache_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """Bytes of keys and values one token costs in a store, over every layer of `config`."""
    heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    return int(config.num_hidden_layers) * 2 * heads * head_dim * torch.finfo(dtype).bits // 8


@dataclass(slots=True, eq=False)
class KVStore:
    """One model's cached keys and values of one long sequence, every layer."""

    capacity: int  # tokens
    keys: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [capacity, Hk, D]
    values: dict[int, torch.Tensor] = field(default_factory=dict)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [*self.keys.values(), *self.values.values()])


@dataclass(frozen=True, slots=True)
class KVContext:
    """The context of one micro-batch's last segment: its tokens are [start, start + own) of the
    sequence whose store this is; the row's first `others` tokens belong to other segments."""

    store: KVStore
    start: int
    others: int

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: [N, Hk, D] this layer's fresh keys and values of the row. Stores the last segment's,
        and returns the keys and values attention reads: [others + start + own, Hk, D] each."""
        own = k.shape[0] - self.others
        end = self.start + own
        if end > self.store.capacity:
            raise ValueError(f"context of {end} tokens past its store's {self.store.capacity}")
        keys, values = self.store.keys.get(layer), self.store.values.get(layer)
        if keys is None or values is None:
            keys = k.new_empty((self.store.capacity, *k.shape[1:]))
            values = v.new_empty((self.store.capacity, *v.shape[1:]))
            self.store.keys[layer], self.store.values[layer] = keys, values
        keys[self.start : end].copy_(k[self.others :])
        values[self.start : end].copy_(v[self.others :])
        if self.others == 0:
            return keys[:end], values[:end]
        return (
            torch.cat([k[: self.others], keys[:end]]),
            torch.cat([v[: self.others], values[:end]]),
        )

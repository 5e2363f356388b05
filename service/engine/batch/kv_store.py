"""Keys and values a packed row's segments attend to beyond their own tokens.

A micro-batch's queries are its N packed tokens; a segment's keys are normally its own tokens. A
segment may also attend to keys before its own, so that varlen attention takes key boundaries `cu_k`
that differ from the query boundaries (causal masking bottom-right aligned: query i of a segment of
q queries and k keys sees keys j <= i + k - q). Two sources, alone or together:

- a shared prefix (prefixes.py): a segment holding positions [start, end) of some sequences whose
  positions [0, start) other segments of the row compute; its keys are those rows' keys, then its
  own: one gather of the row's keys and values per layer, `gather` [K] row indices, every segment's
  keys in turn;
- a cached context (the chunks before it of a sequence too long for one micro-batch), for the row's
  last segment only: each layer writes that segment's fresh keys and values into the store behind
  what is cached, and the segment attends over the cached keys 0 .. start + q. The keys read are

      [keys of the other segments (gathered, or as they are) | cached keys 0 .. start + q]

  which is a view of the store when the context segment is alone in the row, and one copy otherwise;
- the prefix cache's pool (cache/pool.py, `io`): each layer keeps the row's fresh keys of the blocks it
  writes, the gather reads [the row's N keys | the cached rows read], and a chunk's store takes its
  cached context from the pool when allocated and gives the pool its whole blocks.

Store: per layer, [capacity, Hk, D] keys and values in the model's dtype, allocated at the first
layer call; a model's store costs layers x 2 x Hk x D x capacity x dtype bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from service.engine.batch import key_gather
from service.engine.cache import pool as cache_pool
from service.engine.cache.pool import PoolIO

# The keyword argument of a transformers decoder forward that carries a KVContext to the attention
CONTEXT_KWARG = "logprobd_context"


def cache_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """Bytes of keys and values one token costs in a store, over every layer of `config`."""
    layers, heads, head_dim = cache_pool.kv_shape(config)
    return layers * 2 * heads * head_dim * torch.finfo(dtype).bits // 8


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
    """The keys a packed row attends to, where they are not each segment's own tokens.

    cu_k: [S+1] int32 key boundaries; max_len_k the longest key segment. gather: [K] indices of the
    row's keys, segment after segment (None: the row's keys as they are). With a store, the row's
    last segment holds tokens [start, start + own) of the sequence whose store it is, and its keys
    are the store's; `gather` then covers the first `others` rows' segments only.

    count: [1] int32 on the device, K, where `gather` is a CUDA graph's static index of more rows
    (no store then): the keys and values read have as many rows as `gather`, the first K gathered
    (batch/key_gather.py), and cu_k ends at K.

    io: the attached model's reads and writes of its prefix-cache pool (None: none). With neither a
    gather nor a store, each segment's keys are its own and the context only keeps them.
    """

    cu_k: torch.Tensor
    max_len_k: int
    gather: torch.Tensor | None = None
    store: KVStore | None = None
    start: int = 0
    others: int = 0
    count: torch.Tensor | None = None
    io: PoolIO | None = None

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: [N, Hk, D] this layer's fresh keys and values of the row. Stores the last segment's
        in the store, if any, and returns the keys and values attention reads: [cu_k[-1], Hk, D] each."""
        io = self.io
        if io is not None:
            io.save_rows(layer, k, v)
        if self.store is None:
            if self.gather is None:
                return k, v
            source_k, source_v = (k, v) if io is None else io.source(layer, k, v)
            if self.count is not None:
                return key_gather.rows(source_k, source_v, self.gather, self.count)
            return source_k.index_select(0, self.gather), source_v.index_select(0, self.gather)
        own = k.shape[0] - self.others
        end = self.start + own
        if end > self.store.capacity:
            raise ValueError(f"context of {end} tokens past its store's {self.store.capacity}")
        keys, values = self.store.keys.get(layer), self.store.values.get(layer)
        if keys is None or values is None:
            keys = k.new_empty((self.store.capacity, *k.shape[1:]))
            values = v.new_empty((self.store.capacity, *v.shape[1:]))
            self.store.keys[layer], self.store.values[layer] = keys, values
            if io is not None:
                io.fill_store(layer, keys, values)
        keys[self.start : end].copy_(k[self.others :])
        values[self.start : end].copy_(v[self.others :])
        if io is not None:
            io.save_store(layer, keys, values)
        if self.gather is not None:
            source_k, source_v = (k, v) if io is None else io.source(layer, k, v)
            return (
                torch.cat([source_k.index_select(0, self.gather), keys[:end]]),
                torch.cat([source_v.index_select(0, self.gather), values[:end]]),
            )
        if self.others == 0:
            return keys[:end], values[:end]
        return (
            torch.cat([k[: self.others], keys[:end]]),
            torch.cat([v[: self.others], values[:end]]),
        )

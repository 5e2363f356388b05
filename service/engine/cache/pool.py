"""One model's pool of cached blocks, and a micro-batch's reads and writes of it.

A pool of R = slots x BLOCK rows (core/prefix_cache.py: slot s holds rows s * BLOCK .. s * BLOCK +
BLOCK - 1 of every model's pool), allocated once at start-up and zeroed (a row read under another
model's entry or never written holds finite values, never NaN):

    keys[layer], values[layer]:  [R + 1, Hk, D] in the model's dtype (under tensor parallel, this
                                 rank's key/value heads); row R is the trash row, where a CUDA graph
                                 writes the keys of the rows it does not keep
    hidden:                      [R + 1, H] the decoder's final normalised hidden state

A token costs layers x 2 x Hk x D + H elements of the model's dtype (`bytes_per_token`).

PoolIO is one model's part in one micro-batch, called by each attention layer (batch/kv_store.py
KVContext.extend): `save` the row's fresh keys into the pool, `source` the rows attention gathers
from ([the row's N keys | the cached rows read]), and for a long sequence's chunk `fill` its store's
cached context and `save_store` its whole blocks from the store.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from service.core.cache_plan import BLOCK


def kv_shape(config: Any) -> tuple[int, int, int]:
    """(layers, key/value heads, head dim) of a decoder's `config` (a shard's, under tensor parallel)."""
    heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    return int(config.num_hidden_layers), heads, head_dim


def bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """What one token of a pool costs: every layer's key and value, and the final hidden state."""
    layers, heads, head_dim = kv_shape(config)
    return (layers * 2 * heads * head_dim + int(config.hidden_size)) * torch.finfo(dtype).bits // 8


@dataclass(frozen=True, slots=True, eq=False)
class ModelPool:
    keys: list[torch.Tensor]  # per layer [R + 1, Hk, D]
    values: list[torch.Tensor]
    hidden: torch.Tensor  # [R + 1, H]

    @property
    def trash(self) -> int:
        """The row that takes writes nothing keeps."""
        return int(self.hidden.shape[0]) - 1

    @classmethod
    def allocate(cls, config: Any, slots: int, dtype: torch.dtype, device: torch.device) -> ModelPool:
        layers, heads, head_dim = kv_shape(config)
        rows = slots * BLOCK + 1

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        return cls(
            keys=[zeros(rows, heads, head_dim) for _ in range(layers)],
            values=[zeros(rows, heads, head_dim) for _ in range(layers)],
            hidden=zeros(rows, int(config.hidden_size)),
        )

    def nbytes(self) -> int:
        tensors = [*self.keys, *self.values, self.hidden]
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True, slots=True)
class Saves:
    """Rows `src` of a source written to pool rows `dst` ([W] int64 each; src None: every row of the
    source in order, as a CUDA graph's static dst over its N rows, the unkept ones to the trash)."""

    src: torch.Tensor | None
    dst: torch.Tensor

    def write(self, pool: torch.Tensor, source: torch.Tensor) -> None:
        pool.index_copy_(0, self.dst, source if self.src is None else source.index_select(0, self.src))


@dataclass(frozen=True, slots=True)
class PoolIO:
    """One model's reads and writes of its pool in one micro-batch (None: none of that kind).

    read:       [Kc] pool rows that follow the row's N keys in what attention gathers from
    save:       the row's fresh keys and values kept
    fill:       [C] pool rows of the chunk's cached context, copied into its store when allocated
    store_save: the chunk's whole blocks, from store positions
    """

    pool: ModelPool
    read: torch.Tensor | None = None
    save: Saves | None = None
    fill: torch.Tensor | None = None
    store_save: Saves | None = None

    @property
    def reads(self) -> bool:
        """Whether attention reads the pool (a CUDA graph cannot)."""
        return self.read is not None or self.fill is not None

    def save_rows(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.save is not None:
            self.save.write(self.pool.keys[layer], k)
            self.save.write(self.pool.values[layer], v)

    def source(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[N + Kc, Hk, D] keys and values: the row's, then the cached rows read."""
        if self.read is None:
            return k, v
        return (
            torch.cat([k, self.pool.keys[layer].index_select(0, self.read)]),
            torch.cat([v, self.pool.values[layer].index_select(0, self.read)]),
        )

    def fill_store(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        if self.fill is not None:
            count = self.fill.shape[0]
            torch.index_select(self.pool.keys[layer], 0, self.fill, out=keys[:count])
            torch.index_select(self.pool.values[layer], 0, self.fill, out=values[:count])

    def save_store(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        if self.store_save is not None:
            self.store_save.write(self.pool.keys[layer], keys)
            self.store_save.write(self.pool.values[layer], values)

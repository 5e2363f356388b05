"""Tensor parallel: which part of each tensor a rank holds, and the collectives that join the parts.

Megatron's layout over the fused decoder's GEMMs (decoder/fused.py), for N ranks:

    q|k|v, gate|up   column-parallel: rank r holds Hq/N query heads, Hk/N key/value heads and I/N
                     MLP columns; attention runs on its own heads, no communication
    o_proj, down     row-parallel: each rank's GEMM gives a partial [N, H] sum; ONE all-reduce each
                     per layer joins them (the bias, replicated, is added once, after it)
    embed_tokens     vocabulary-parallel: rank r holds rows [start, end) of the vocabulary; a token
                     outside them embeds to zero, one all-reduce per forward
    lm_head          vocabulary-parallel, the same rows (tied embeddings stay tied): log-softmax,
                     entropy and the target's logit from all-reduced per-row statistics
                     (heads/vocab_parallel.py); the [rows, V] logits are never gathered
    the rest         replicated: norms, Qwen3's per-head q/k norms, rotary tables, a critic's value head

A rank builds its model from a config of its shard's sizes (`Layout.config`) and reads only its slice
of each tensor (`Layout.part`; loading/checkpoint.py's `sliced` reads it), so no rank holds a whole
tensor it does not serve.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class Shard:
    """This process's place among the ranks of one replica, and the process group they share."""

    rank: int
    world: int
    group: Any = None  # a torch.distributed ProcessGroup; None: the default group

    def all_reduce_(self, x: torch.Tensor) -> None:
        """x = Σ over the ranks of x, in place."""
        dist.all_reduce(x, group=self.group)

    def all_reduce_max_(self, x: torch.Tensor) -> None:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group)

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's x (the same shape on each), in rank order."""
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return parts


def even(total: int, world: int, rank: int, what: str) -> tuple[int, int]:
    """[start, end) of rank's equal part of `total`; ValueError when `world` does not divide it."""
    if total % world:
        raise ValueError(f"tensor parallel size {world} does not divide the {total} {what}")
    part = total // world
    return rank * part, (rank + 1) * part


def vocabulary(total: int, world: int, rank: int) -> tuple[int, int]:
    """[start, end) of rank's rows of a vocabulary: ceil(V / N) each, the last ones shorter."""
    part = -(-total // world)
    start, end = min(rank * part, total), min((rank + 1) * part, total)
    if start == end:
        raise ValueError(f"a vocabulary of {total} tokens leaves rank {rank} of {world} none")
    return start, end


@dataclass(frozen=True, slots=True)
class Layout:
    """How one model's tensors split over the ranks, seen from one rank."""

    rank: int
    world: int
    head_dim: int
    q: tuple[int, int]  # this rank's query heads [start, end)
    kv: tuple[int, int]  # its key/value heads
    mlp: tuple[int, int]  # its MLP columns (intermediate_size)
    vocab: tuple[int, int]  # its vocabulary rows
    vocab_size: int  # the whole vocabulary

    @classmethod
    def of(cls, config: Any, shard: Shard) -> Layout:
        """The layout of a Llama-family text config; ValueError naming what N does not divide."""
        heads, world, rank = int(config.num_attention_heads), shard.world, shard.rank
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(config, "head_dim", None) or int(config.hidden_size) // heads)
        return cls(
            rank=rank,
            world=world,
            head_dim=head_dim,
            q=even(heads, world, rank, "query heads (num_attention_heads)"),
            kv=even(kv_heads, world, rank, "key/value heads (num_key_value_heads)"),
            mlp=even(int(config.intermediate_size), world, rank, "MLP columns (intermediate_size)"),
            vocab=vocabulary(int(config.vocab_size), world, rank),
            vocab_size=int(config.vocab_size),
        )

    def config(self, config: Any) -> Any:
        """A copy of `config` whose model is this rank's shard: its heads, MLP columns and vocabulary
        rows (head_dim explicit: no longer hidden_size / heads; no padding id, which may lie past the
        shard's rows)."""
        shard = copy.deepcopy(config)
        shard.num_attention_heads = self.q[1] - self.q[0]
        shard.num_key_value_heads = self.kv[1] - self.kv[0]
        shard.intermediate_size = self.mlp[1] - self.mlp[0]
        shard.vocab_size = self.vocab[1] - self.vocab[0]
        shard.head_dim = self.head_dim
        shard.pad_token_id = None
        return shard

    def part(self, name: str) -> tuple[int, int, int] | None:
        """(dim, start, end) of this rank's slice of the checkpoint tensor `name`; None: replicated."""
        d = self.head_dim
        q, kv, mlp = self.q, self.kv, self.mlp
        rules = (
            (("self_attn.q_proj.weight", "self_attn.q_proj.bias"), 0, (q[0] * d, q[1] * d)),
            (("self_attn.k_proj.weight", "self_attn.k_proj.bias"), 0, (kv[0] * d, kv[1] * d)),
            (("self_attn.v_proj.weight", "self_attn.v_proj.bias"), 0, (kv[0] * d, kv[1] * d)),
            (("self_attn.o_proj.weight",), 1, (q[0] * d, q[1] * d)),
            (
                ("mlp.gate_proj.weight", "mlp.gate_proj.bias", "mlp.up_proj.weight", "mlp.up_proj.bias"),
                0,
                mlp,
            ),
            (("mlp.down_proj.weight",), 1, mlp),
            (("embed_tokens.weight", "lm_head.weight"), 0, self.vocab),
        )
        for suffixes, dim, (start, end) in rules:
            if name.endswith(suffixes):
                return dim, start, end
        return None

    def whole(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The whole checkpoint tensor `name`'s shape, from the shape of this rank's slice of it."""
        part = self.part(name)
        if part is None:
            return shape
        dim, start, end = part
        vocab = name.endswith(("embed_tokens.weight", "lm_head.weight"))
        total = self.vocab_size if vocab else (end - start) * self.world  # the other parts are even
        return (*shape[:dim], total, *shape[dim + 1 :])


@dataclass(frozen=True, slots=True)
class Sharded:
    """What a rank's PackedScorer needs to serve sharded models: the ranks, and per model (policy,
    reference, critic) its layout and its whole text config (a reload is checked against it)."""

    shard: Shard
    layouts: dict[str, Layout]
    configs: dict[str, Any]

"""The extras of the fused head (heads/extras.py's ExtraScores) from a chunk's 16-bit logits, searched
by heads/topk_kernel.py's radix select, with no [r, V] float32 or int64 tensor.

Boundary: z [c, V] bfloat16 / float16 logits of a chunk, the asking rows' indices into it, the
logit scale and the rows' 1 / T in; ExtraScores out. The kernels give each row's shift (log-sum-exp
of x), its target's rank and the ids of its K largest logits; everything else runs in torch on
[r, K] columns: z gathered at those ids and tempered with the torch path's own operations
((float(z)·scale)·(1 / T)), so the logits, keys and order are bitwise those of extras.score over
the whole x (the kernel's order is z's, which x keeps: topk_kernel.py). Ids and ranks equal that
path's exactly; log-probs differ by the shift's rounding (a float32 online sum, not torch's); the
processed log-prob's kept mass is the kernel's sum, so its values differ by rounding too.

Not for: float32 logits, a seeded draw (it adds noise to every logit), a vocabulary split over ranks;
`usable` says so and chunked.py keeps extras.score for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from service.engine.heads import extras as extra
from service.engine.heads import topk_kernel
from service.engine.heads.contract import Extras, ExtraScores
from service.engine.runtime import triton_jit


def usable(z: torch.Tensor, asks: Extras) -> bool:
    """True where these kernels can give the asks: 16-bit logits on a device the kernels run on
    (CUDA, or any under Triton's interpreter), no draw."""
    return (
        z.dtype in topk_kernel.SIXTEEN
        and asks.seeds is None
        and (z.is_cuda or triton_jit.interpreting())
        and triton_jit.triton() is not None
    )


@dataclass(frozen=True, slots=True)
class Radix:
    """extras.Rows over a chunk's 16-bit logits: rows [r] of z, their multiplier, the first prefix."""

    z: torch.Tensor  # [c, V]
    rows: torch.Tensor  # [r] int64 indices into z's rows
    scale: float
    inv_t: torch.Tensor | None  # [r] 1 / T (the kernels read it as float32)
    first: torch.Tensor  # [r, n] each row's n largest keys, largest first (n >= 1)

    @property
    def vocab(self) -> int:
        return int(self.z.shape[1])

    def logits(self, rows: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor:
        """[p, m] float32 x at token ids [p, m] of rows (None: all): the torch path's operations."""
        x = self.z[_take(self.rows, rows)[:, None], ids].to(torch.float32)
        if self.scale != 1.0:
            x.mul_(self.scale)  # LogitTransform's scale, as transform() applies it
        if self.inv_t is not None:
            x.mul_(_take(self.inv_t, rows)[:, None])
        return x

    def prefix(self, n: int, pending: torch.Tensor | None) -> torch.Tensor:
        n = min(n, self.vocab)
        if n <= self.first.shape[1]:  # within the first selection (a top list may be longer)
            return _take(self.first, pending)[:, :n]
        rows = _take(self.rows, pending)
        targets = torch.zeros_like(rows)  # the rank is not wanted here
        found = topk_kernel.select(self.z, rows, targets, self.scale, _maybe(self.inv_t, pending), n)
        assert found.ids is not None
        return sorted_keys(self, pending, found.ids)

    def row_max(self) -> torch.Tensor:
        return extra.decode(self.first[:, 0], self.vocab)[1]

    def mass(
        self, shift: torch.Tensor, floor: torch.Tensor, kth: torch.Tensor, kth_key: torch.Tensor
    ) -> torch.Tensor:
        # x >= kth <=> z's order key >= that of the k-th token (x keeps z's order); 0: every token
        at = extra.decode(kth_key, self.vocab)[0].clamp(0, self.vocab - 1)
        least = topk_kernel.order_keys(self.z[self.rows, at]).masked_fill(kth_key == extra.LOWEST, 0)
        return topk_kernel.mass(self.z, self.rows, self.scale, self.inv_t, shift, floor, least)


def sorted_keys(source: Radix, rows: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor:
    """[p, W] extras.keys of rows' tokens ids [p, W] (int32, -1: none), largest first (none: LOWEST)."""
    real = ids >= 0
    at = ids.long().clamp(min=0)
    k = extra.keys(source.logits(rows, at), at, source.vocab).masked_fill(~real, extra.LOWEST)
    return torch.sort(k, dim=1, descending=True).values


def score(  # noqa: PLR0917 (the chunk and what its rows need)
    z: torch.Tensor,  # [c, V] bfloat16 / float16
    rows: torch.Tensor,  # [r] int64 the asking rows' indices into z
    targets: torch.Tensor,  # [r] token ids
    scale: float,  # the logit transform's scale (> 0)
    inv_t: torch.Tensor | None,  # [r] 1 / T; None: every T is 1
    asks: Extras,
) -> ExtraScores:
    """The r rows' ExtraScores, as extras.score gives them from the whole x = (float(z)·scale)·(1 / T)."""
    vocab = z.shape[1]
    sampler = asks.top_p is not None
    width = max(asks.top, asks.most_top_k, extra.PREFIX if asks.any_top_p else 0, 1 if sampler else 0)
    found = topk_kernel.select(z, rows, targets, scale, inv_t, min(width, vocab))
    shift = found.shift
    empty = torch.empty(rows.shape[0], 0, dtype=torch.int64, device=z.device)
    source = Radix(z, rows, scale, inv_t, empty)
    if found.ids is not None:
        source = Radix(z, rows, scale, inv_t, sorted_keys(source, None, found.ids))
    x_target = source.logits(None, targets[:, None])[:, 0]
    top_ids = top_logprobs = candidate_logprobs = processed = None
    if asks.top:
        top_ids, values = extra.decode(source.first[:, : asks.top], vocab)
        top_logprobs = values - shift[:, None]
    if asks.candidates is not None:
        candidate_logprobs = source.logits(None, asks.candidates) - shift[:, None]
    if sampler:
        processed = extra.processed_logprobs(source, shift, x_target, targets, asks, vocab)
    return ExtraScores(top_ids, top_logprobs, found.ranks, candidate_logprobs, processed, None)


def _take(t: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return t if rows is None else t[rows]


def _maybe(t: torch.Tensor | None, rows: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else _take(t, rows)

"""The lm_head on action positions only, in row chunks, with log-softmax and entropy in float32.

Never builds a [tokens, vocab] tensor: at most [chunk_rows, vocab] logits exist at once, and only
rows that predict an action are computed. Does not rely on `logits_to_keep`-style model kwargs.
A chunk's logits are the head's largest tensors, so every pass over them costs memory bandwidth:
- on CUDA with triton, when the final-logit transform is at most a positive scale, one Triton kernel
  (heads/fused_kernel.py) reads them once and writes each row's log-prob and entropy;
- otherwise (CPU, no triton, soft-capping), one torch log-softmax over float32 logits (upcast inside
  the kernel when there is nothing to apply first), a gather, and the entropy from its result.

Rows that ask more (Extras: top K, candidates, processed log-probs, a draw) get it from the same
chunk's logits (heads/extras.py): on the torch path from its float32 log-softmax, per chunk; on the
fused path from 16-bit logits by a radix select (heads/extras_radix.py: per chunk only its kernels,
writing buffers of the call's asking rows; the torch work once for all of them after the chunks)
or, for float32 logits, per chunk from a float32 copy of those rows' tempered logits (the kernel
still writes their log-prob and entropy). A draw (a token sampled at a row) comes from a float32
copy of the drawing rows alone; on the radix path every other ask of theirs from the select. A chunk
whose rows ask nothing does no more work.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from service.engine.batch.asks import Extras
from service.engine.heads import extras as extra
from service.engine.heads import extras_radix
from service.engine.heads import fused_kernel as fused_head
from service.engine.heads.base import ActionScores, ExtraScores, LogitTransform
from service.engine.runtime import triton_jit
from service.engine.runtime.copies import to_device


def score_actions(
    *,
    hidden: torch.Tensor,  # [A, H] final hidden state at t-1 for each action t
    targets: torch.Tensor,  # [A]
    inv_temperature: torch.Tensor | None,  # [A]; None: every T is 1
    lm_head: torch.nn.Module,
    transform: LogitTransform,
    chunk_rows: int,
    want_entropy: bool,
    fused: bool | None = None,  # the Triton kernel; None: where triton_jit.available and it fits
    extras: Extras | None = None,  # what some rows ask beyond the log-prob
) -> ActionScores:
    """Each row's log-prob of its target (and entropy) under softmax(g(z) / T), z = lm_head(hidden).

    fused=None picks the Triton kernel on CUDA when triton imports and g is at most a positive scale
    (folded into the kernel's per-row multiplier with 1 / T); fused=False forces the torch path;
    fused=True forces the kernel (ValueError for a soft-capping g; CPU tensors need TRITON_INTERPRET=1).
    """
    fits = transform.softcap is None and transform.scale > 0.0  # a scale folds into the row multiplier
    if fused is None:
        fused = fits and triton_jit.available(hidden.device)
    elif fused and not fits:
        raise ValueError(f"the fused head cannot apply {transform}")
    rows = hidden.shape[0]
    logprobs = torch.empty(rows, dtype=torch.float32, device=hidden.device)
    entropy = torch.empty_like(logprobs) if want_entropy else None
    multiplier = row_multiplier(inv_temperature, transform.scale, rows, hidden.device) if fused else None
    parts: list[ExtraScores] = []
    radix: extras_radix.Collector | None = None
    draws: _Draws | None = None
    bare = None if extras is None else _without_draws(extras)  # the radix select's asks

    def logits_of(at: int) -> torch.Tensor:  # a chunk's logits again (a top-p prefix past W keys)
        return lm_head(hidden[at : min(at + chunk_rows, rows)])  # type: ignore[no-any-return]

    for start in range(0, rows, chunk_rows):
        end = min(start + chunk_rows, rows)
        z = lm_head(hidden[start:end])  # [c, V] in the model's dtype
        if fused:
            if bare is not None and radix is None and _radix(z, transform, bare):
                radix = extras_radix.Collector(
                    bare, targets, inv_temperature, transform.scale, 0, chunk_rows, logits_of
                )
                if extras is not None and bare is not extras:
                    draws = _Draws(extras, inv_temperature, transform)
            if radix is not None:
                radix.chunk_of(z, start, end)
                if draws is not None:
                    draws.chunk_of(z, start, end)
            elif extras is not None:
                parts += from_float_copy(z, start, end, targets, inv_temperature, transform, extras)
            s = multiplier[start:end] if multiplier is not None else None
            chunk_logprobs, chunk_entropy = fused_head.fused_logprobs(z, targets[start:end], s, want_entropy)
            del z  # freed before the next chunk's logits are made
            logprobs[start:end] = chunk_logprobs
            if entropy is not None and chunk_entropy is not None:
                entropy[start:end] = chunk_entropy
        else:
            if inv_temperature is not None or not transform.identity:
                z = transform(z.float())  # float32 temporary, modified in place
                if inv_temperature is not None:
                    z.mul_(inv_temperature[start:end, None])
            logp = torch.log_softmax(z, dim=-1, dtype=torch.float32)  # [c, V] float32
            del z
            logprobs[start:end] = logp.gather(1, targets[start:end, None]).squeeze(1)
            if extras is not None:
                parts += _from_logprobs(logp, start, end, targets, extras)
            if entropy is not None:
                entropy[start:end] = torch.special.entr(logp.exp_()).sum(dim=-1)  # -Σ p·log p
    if radix is not None:
        parts = radix.done()
        if draws is not None:
            parts = [dataclasses.replace(extra.cat(parts), drawn=draws.drawn)]
    return ActionScores(logprobs=logprobs, entropy=entropy, extras=extra.cat(parts) if parts else None)


def _from_logprobs(
    logp: torch.Tensor, start: int, end: int, targets: torch.Tensor, extras: Extras
) -> list[ExtraScores]:
    """The asking rows of chunk [start, end) from its float32 log-softmax [c, V] (shift 0)."""
    vocab = logp.shape[1]
    join = extra.Join(0, vocab)
    out = []
    for asks, rows in extra.passes(extras, start, end, vocab):
        x = logp[rows]
        out.append(extra.score(x, x.new_zeros(x.shape[0]), targets[asks.index], asks, join))
    return out


def _without_draws(extras: Extras) -> Extras:
    """`extras` but the draw (the radix select's asks; _Draws draws apart), itself where none draws."""
    if extras.seeds is None:
        return extras
    return dataclasses.replace(extras, seeds=None, positions=None, drawing=None)


class _Draws:
    """The draws of the rows that draw, chunk by chunk, from a float32 copy of those rows' tempered
    logits alone (the radix select serves every asking row the rest): [R] int64, -1 at the others.
    Which rows draw is copied to the device once, queued (a chunk's draw waits for nothing)."""

    def __init__(
        self, extras: Extras, inv_temperature: torch.Tensor | None, transform: LogitTransform
    ) -> None:
        assert extras.seeds is not None
        assert extras.positions is not None
        self.extras, self.inv_temperature, self.transform = extras, inv_temperature, transform
        rows, device = extras.rows.shape[0], extras.index.device
        self.drawn = torch.full((rows,), -1, dtype=torch.int64, device=device)
        self.drawing = extras.drawn_rows(0, rows)  # [d] host, sorted, into the R rows
        self.index = to_device(self.drawing, device)
        self.action_rows = to_device(extras.rows[self.drawing], device)  # [d] their rows among the actions

    def chunk_of(self, z: torch.Tensor, start: int, end: int) -> None:
        """The draws among action rows [start, end), whose logits z [c, V] holds."""
        lo, hi = np.searchsorted(self.drawing, self.extras.span(start, end))
        if lo == hi:
            return
        asks = self.extras
        index = self.index[lo:hi]
        local = self.action_rows[lo:hi] - start
        x = self.transform(z[local].to(torch.float32, copy=True))  # [d, V], as from_float_copy makes it
        if self.inv_temperature is not None:
            x.mul_(self.inv_temperature[asks.index[index], None])
        assert asks.seeds is not None
        assert asks.positions is not None
        vocab = z.shape[1]
        ids = torch.arange(vocab, device=z.device)
        self.drawn[index] = extra.draw(x, asks.seeds[index], asks.positions[index], ids, extra.Join(0, vocab))


def _radix(z: torch.Tensor, transform: LogitTransform, extras: Extras) -> bool:
    """True where the rows' extras come from z by the radix select (the same for every chunk)."""
    return transform.softcap is None and extras_radix.usable(z, extras)


def from_float_copy(  # noqa: PLR0917
    z: torch.Tensor,
    start: int,
    end: int,
    targets: torch.Tensor,
    inv_temperature: torch.Tensor | None,
    transform: LogitTransform,
    extras: Extras,
) -> list[ExtraScores]:
    """The asking rows of chunk [start, end) from a float32 copy of their tempered logits (z [c, V],
    any dtype; draws), PASS_ELEMENTS at a time: the fused path's extras where the radix select does
    not serve (benchmarks/probes/head_extras.py times it against that path)."""
    vocab = z.shape[1]
    join = extra.Join(0, vocab)
    out = []
    for asks, rows in extra.passes(extras, start, end, vocab):
        x = transform(z[rows].to(torch.float32, copy=True))  # [r, V] float32, a copy
        if inv_temperature is not None:
            x.mul_(inv_temperature[asks.index, None])
        out.append(extra.score(x, torch.logsumexp(x, dim=1), targets[asks.index], asks, join))
    return out


def row_multiplier(
    inv_temperature: torch.Tensor | None, scale: float, rows: int, device: torch.device
) -> torch.Tensor | None:
    """s of each row for the fused kernel: 1 / T times the logit scale; None when every s is 1."""
    if inv_temperature is None:
        return None if scale == 1.0 else torch.full((rows,), scale, dtype=torch.float32, device=device)
    return inv_temperature.float() * scale if scale != 1.0 else inv_temperature.float()

"""The lm_head and the log-softmax in one GEMM (quack-kernels): each action row's log-prob of its
target with no logits in memory.

quack's GEMM over h [A, H] and the lm_head weight [V, H] keeps, in its epilogue, each row's online
(max, sum of exp) of s·z over every N tile of the vocabulary and copies the target column's s·z, where
z = h·Wᵀ in the float32 accumulators and s the row's 1/T times the model's logit scale; one
logsumexp over the tiles' partials finishes it:

    log p(t) = s·z_t - logsumexp_v(s·z_v)

The chunked head (chunked.py) computes the same function from logits rounded to the model's dtype,
written to memory and read back per chunk of rows; here they are never rounded or written, so the two
differ by that rounding (under 1e-2 in bf16 logits; this one is the closer to float32).

It serves rows that ask for their log-prob alone (no entropy, no extras) of a head without a bias or
soft-capping, on a CUDA device of compute capability 9.0 in bf16/fp16, outside batch-invariant mode;
every other call takes chunked.py. `choose` resolves the `head_kernel` setting and probes the kernel
on the model's own lm_head at start.

Boundary: hidden [A, H], targets [A] int64, scale [A] float32 | None -> log-probs [A] float32.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from service.engine.heads.base import LogitTransform
from service.engine.ops.fixed_tile import quack_aligned
from service.engine.runtime import packages as optional
from service.engine.runtime.packages import FAST_DTYPES

log = logging.getLogger(__name__)

QUACK = ("quack.epilogue.library", "quack-kernels")
ROWS_PER_CALL = 8192  # bounds the [rows, V / tile_N] float32 partials of one call (~25 MiB at 152k)

# (hidden [A, H], weightᵀ [H, V], targets [A] int32, scale [A] float32 | None) -> (lse [A], target logit [A])
Kernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]
]


@dataclass(frozen=True, slots=True)
class QuackHead:
    """The fused lm_head log-prob: `kernel` runs the GEMM; `scaled`: whether it takes a row scale
    (rows with a temperature or a logit scale go to chunked.py where it does not)."""

    kernel: Kernel
    scaled: bool
    name: str = "quack"

    def serves(self, transform: LogitTransform, *, want_entropy: bool, extras: bool, scaled: bool) -> bool:
        """Whether a call of these asks runs here."""
        return transform.softcap is None and not want_entropy and not extras and (self.scaled or not scaled)

    def logprobs(
        self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor | None
    ) -> torch.Tensor:
        """[A] float32 log p(targets) under softmax(scale · hidden · weightᵀ) (scale None: 1)."""
        rows = hidden.shape[0]
        out = torch.empty(rows, dtype=torch.float32, device=hidden.device)
        if not rows:
            return out
        hidden = hidden if quack_aligned(hidden) else hidden.contiguous()
        index = targets.to(torch.int32)  # the epilogue's column index
        for start in range(0, rows, ROWS_PER_CALL):
            end = min(start + ROWS_PER_CALL, rows)
            s = None if scale is None else scale[start:end]
            lse, target_logit = self.kernel(hidden[start:end], weight.t(), index[start:end], s)
            torch.sub(target_logit, lse, out=out[start:end])
        return out


def _kernels() -> tuple[Kernel, Kernel]:
    """quack's target log-sum-exp epilogue, and the same with a per-row scale (one of ours, from
    quack's epilogue ops)."""
    from quack.epilogue.frontend import gemm_epilogue
    from quack.epilogue.library import lse_target_epi
    from quack.epilogue.ops import ColVecLoad, ColVecSelect, OnlineLSEReduce

    index = ColVecLoad("target")

    @gemm_epilogue(  # type: ignore[untyped-decorator]
        ops={"scale": ColVecLoad("scale")},
        outs={"lse": OnlineLSEReduce("lse"), "target_logit": ColVecSelect("target_logit", idx_op=index)},
        extra_ops=(index,),
    )
    def scaled_lse_target_epi(acc: Any, scale: Any) -> dict[str, Any]:
        v = acc * scale
        return {"D": v, "lse": v, "target_logit": v}

    def plain(
        h: torch.Tensor, w_t: torch.Tensor, t: torch.Tensor, s: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert s is None
        r = lse_target_epi(h, w_t, store_d=False, target=t, tuned=False)
        return r["lse"], r["target_logit"]

    def scaled(
        h: torch.Tensor, w_t: torch.Tensor, t: torch.Tensor, s: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if s is None:
            return plain(h, w_t, t, None)
        r = scaled_lse_target_epi(h, w_t, store_d=False, target=t, scale=s, tuned=False)
        return r["lse"], r["target_logit"]

    return plain, scaled


def reference_kernel(
    h: torch.Tensor, w_t: torch.Tensor, t: torch.Tensor, s: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' function in torch (the CPU twin): float32 logits s·h·wᵀ, their log-sum-exp per row
    and the target's logit."""
    z = h.float() @ w_t.float()
    if s is not None:
        z.mul_(s[:, None])
    return torch.logsumexp(z, dim=-1), z.gather(1, t.long()[:, None]).squeeze(1)


def importable() -> bool:
    """quack-kernels' epilogue library imports (a broken install: one warning, False)."""
    return optional.importable(*QUACK)


def _device_can_run(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


def eligible(lm_head: Any, device: torch.device) -> str | None:
    """Why this head cannot run fused here (None: it can)."""
    weight = getattr(lm_head, "weight", None)
    if not isinstance(lm_head, torch.nn.Linear) or weight is None:
        return "the lm_head is not a plain Linear"
    if lm_head.bias is not None:
        return "the lm_head has a bias"
    if weight.dtype not in FAST_DTYPES:
        return f"the lm_head is {weight.dtype} (bf16/fp16 only)"
    if not _device_can_run(device):
        return "quack's fused head needs a CUDA device of compute capability 9.0"
    if not quack_aligned(weight):
        return "the lm_head's rows are not 16-byte aligned"
    return None


def choose(setting: str, lm_head: Any, device: torch.device, *, batch_invariant: bool) -> QuackHead | None:
    """auto: quack where it can run and its probe on this lm_head passes (the scaled form too, or
    rows with a scale take chunked.py); chunked: None; quack: the same or a RuntimeError saying why not."""
    if setting == "chunked":
        return None
    why = "batch-invariant mode keeps the chunked head" if batch_invariant else eligible(lm_head, device)
    if why is None and not importable():
        why = "quack-kernels is not importable"
    if why is not None:
        if setting == "quack":
            if device.type == "cuda" and not importable():
                optional.required(*QUACK, "head_kernel=quack")  # raises: what is wrong with the package
            raise RuntimeError(f"head_kernel=quack cannot run: {why}")
        return None
    try:
        plain, scaled = _kernels()
        head = QuackHead(plain, scaled=False)
        probe(head, lm_head.weight, scaled=False)
    except Exception as exc:  # an import, compile or launch failure of a third-party kernel, or numbers
        if setting == "quack":
            raise
        log.warning(
            "head_kernel=auto: quack's fused head cannot run here (%s: %s); using chunked",
            type(exc).__name__,
            exc,
        )
        return None
    try:
        with_scale = QuackHead(scaled, scaled=True)
        probe(with_scale, lm_head.weight, scaled=True)
    except Exception as exc:
        log.warning(
            "head_kernel: quack's fused head takes no row scale here (%s: %s); rows with a temperature "
            "run chunked",
            type(exc).__name__,
            exc,
        )
        return head
    return with_scale


@torch.inference_mode()
def probe(head: QuackHead, weight: torch.Tensor, *, scaled: bool) -> None:
    """Raise unless `head` gives rows of random hidden states their float32 log-probs under this
    weight within 2e-2 (and under a row scale where `scaled`)."""
    gen = torch.Generator(device=weight.device).manual_seed(0)
    rows = 300
    hidden = torch.randn(rows, weight.shape[1], device=weight.device, dtype=weight.dtype, generator=gen)
    targets = torch.randint(0, weight.shape[0], (rows,), device=weight.device, generator=gen)
    scale = torch.rand(rows, device=weight.device, generator=gen) + 0.5 if scaled else None
    got = head.logprobs(hidden, weight, targets, scale)
    z = hidden.float() @ weight.float().t()
    if scale is not None:
        z.mul_(scale[:, None])
    want = torch.log_softmax(z, dim=-1).gather(1, targets[:, None]).squeeze(1)
    error = float((got - want).abs().max())
    if not error <= 2e-2:
        raise RuntimeError(f"its log-probs are {error:.3g} from float32's")

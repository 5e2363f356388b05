"""One-pass log-softmax of a chunk of logits (Triton): each row's target log-prob and entropy.

The torch head reads a chunk's [rows, vocab] logits three times (an upcast copy, the softmax, the
gather) for two floats per row. This kernel reads them once: one program per row walks the vocabulary
in blocks, upcasts each element to float32 (as the torch path does), multiplies it by the row's
optional scale `s` (1 / T, times a folded logit scale), and keeps an online softmax: the running row
max, and per-lane sums rescaled when it grows, so one exp per element. It differs from the torch
path only in the order of its sums and, on a GPU, in exp's rounding (~1e-5 at most). On CUDA only in
the service; on CPU tensors the kernel runs only under Triton's interpreter, which the tests use:
TRITON_INTERPRET=1 in the environment before triton is first imported (triton's own library
functions are jitted or interpreted then).

triton is imported on first use (runtime/triton_jit.py), never at import time.
"""

from __future__ import annotations

from typing import Any

import torch

from service.engine.runtime import triton_jit

# Not tuned on a GPU yet. Compiled for sm_90 (triton 3.7.1), no spills, at most 80 registers a
# thread for bf16/fp16 logits (96 for fp32): 5 programs or more fit an SM, so a 512-row chunk runs
# in one wave on an H100. (2048, 8) and (4096, 8) are the other candidates to measure
# (benchmarks/probes/variants.py --head current against --head torch).
BLOCK = 2048  # vocabulary columns a step: 4 KiB of bf16, 16 a thread
NUM_WARPS = 4

tl: Any = None  # triton.language, bound on first use; the kernel finds it among this module's globals


def fused_logprobs(
    z: torch.Tensor,  # [rows, V] logits, float32 / bfloat16 / float16
    targets: torch.Tensor,  # [rows] integer ids in [0, V)
    scale: torch.Tensor | None,  # [rows] float32 multiplier s (> 0) of each row's logits; None: 1
    want_entropy: bool,
    *,
    block: int = BLOCK,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log_softmax(s·z)[target] and, if wanted, the entropy of softmax(s·z), per row, in float32."""
    triton_jit.runnable(z)
    kernel = triton_jit.jit(_logprob_kernel)
    rows, vocab = z.shape
    if z.stride(1) != 1:
        z = z.contiguous()
    logprobs = torch.empty(rows, dtype=torch.float32, device=z.device)
    entropy = torch.empty_like(logprobs) if want_entropy else None
    if rows == 0:
        return logprobs, entropy
    s = scale.to(torch.float32).contiguous() if scale is not None else logprobs  # unread when None
    with triton_jit.on_device(z):
        kernel[(rows,)](
            z,
            z.stride(0),
            targets.contiguous(),
            s,
            logprobs,
            entropy if entropy is not None else logprobs,  # unwritten when not wanted
            VOCAB=vocab,  # a constant of the kernel: one compilation per model, and a plain loop bound
            HAS_SCALE=scale is not None,
            ENTROPY=want_entropy,
            BLOCK=min(block, triton_jit.next_power_of_2(vocab)),
            num_warps=NUM_WARPS,
            enable_fp_fusion=True,  # FMA contraction, as nvcc does for torch's kernels; explicit: no warning
        )
    return logprobs, entropy


def _logprob_kernel(  # noqa: PLR0917 (a Triton kernel takes its arguments positionally)
    z_ptr: tl.tensor,
    row_stride: tl.tensor,
    target_ptr: tl.tensor,
    scale_ptr: tl.tensor,
    logprob_ptr: tl.tensor,
    entropy_ptr: tl.tensor,
    VOCAB: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    ENTROPY: tl.constexpr,
    BLOCK: tl.constexpr,
) -> None:
    """One row, in blocks of columns: m is the running row max; lane l keeps d = Σ exp(x - m) and
    t = Σ exp(x - m)·(x - m) of its columns, rescaled whenever m grows (one exp per element).

    t is kept relative to m (not Σ exp(x - m)·x) so that the entropy, log Σd - Σt / Σd, is no
    difference of two large numbers when the logits are large. Padding columns load as -inf, and
    the `where`s keep -inf out of products (0·-inf), so no NaN arises. Column 0 is in the first
    block, so m is finite from then on.
    """
    row = tl.program_id(0)
    row_ptr = z_ptr + row.to(tl.int64) * row_stride
    s = tl.load(scale_ptr + row) if HAS_SCALE else 1.0
    m = float("-inf")
    d = tl.zeros([BLOCK], tl.float32)
    t = tl.zeros([BLOCK], tl.float32)
    cols = tl.arange(0, BLOCK)
    ahead = tl.load(row_ptr + cols, mask=cols < VOCAB, other=float("-inf"))
    for start in range(0, VOCAB, BLOCK):
        x = ahead.to(tl.float32)
        cols = start + BLOCK + tl.arange(0, BLOCK)  # the next block's load is in flight while this one runs
        ahead = tl.load(row_ptr + cols, mask=cols < VOCAB, other=float("-inf"))
        if HAS_SCALE:
            x = x * s
        m_new = tl.maximum(m, tl.max(x, axis=0))
        alpha = tl.exp(m - m_new)  # 0 on the first block
        xr = x - m_new
        p = tl.exp(xr)
        if ENTROPY:
            shift = tl.where(m > float("-inf"), m - m_new, 0.0)  # t + shift·d: old terms relative to m_new
            t = alpha * (t + shift * d) + p * tl.where(p > 0.0, xr, 0.0)
        d = d * alpha + p
        m = m_new
    total = tl.sum(d, axis=0)
    log_total = tl.log(total)
    target = tl.load(target_ptr + row)
    x_target = tl.load(row_ptr + target).to(tl.float32)
    if HAS_SCALE:
        x_target = x_target * s
    tl.store(logprob_ptr + row, (x_target - m) - log_total)
    if ENTROPY:
        tl.store(entropy_ptr + row, log_total - tl.sum(t, axis=0) / total)

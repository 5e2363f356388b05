"""The kernel comparisons' CPU-side parts: how they cut the workload and count attention FLOPs."""

from __future__ import annotations

import itertools

import torch

from benchmarks.probes.attention import attention_flops
from benchmarks.probes.kernels import micro_batches
from benchmarks.workload import jobs, workload
from service.engine.ops.attention import Segments


def test_micro_batches_keep_order_and_budget() -> None:
    the_jobs = jobs(workload(512))
    batches = micro_batches(the_jobs, 16384)
    assert [j for b in batches for j in b] == the_jobs
    assert all(sum(j.num_tokens for j in b) <= 16384 for b in batches)
    # each batch but the last is full: the next sequence would not have fitted
    assert all(sum(j.num_tokens for j in b) + n[0].num_tokens > 16384 for b, n in itertools.pairwise(batches))
    assert micro_batches(the_jobs[:1], 10) == [the_jobs[:1]]  # a sequence over the budget goes alone


def test_attention_flops_count_the_causal_half() -> None:
    seg = Segments(torch.tensor([0, 3, 7], dtype=torch.int32), 4, 1.0, None, None)
    # QKᵀ and PV (2 GEMMs, 2 FLOPs a multiply-add) over n(n+1)/2 pairs, per query head and dimension
    assert attention_flops([seg], q_heads=2) == 2 * 2 * 2 * 128 * (3 * 4 / 2 + 4 * 5 / 2)

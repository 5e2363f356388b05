"""The attention probe tries each backend the `attention` setting can choose, and nothing else."""

from __future__ import annotations

import pytest
import torch

from benchmarks.probes.attention import CHOSEN, HEAD_DIM, attention_flops, cut
from service.engine.ops.attention import Segments, choose_backend


@pytest.mark.parametrize("name", CHOSEN)
def test_each_backend_the_probe_tries_says_why_it_cannot_run_on_a_cpu(name: str) -> None:
    with pytest.raises(RuntimeError, match=f"attention={name} needs"):  # the probe's `skipped`
        choose_backend(name, torch.device("cpu"))


def test_the_probe_leaves_out_the_reference_and_batch_invariance_s_kernel() -> None:
    assert CHOSEN == ("flash_attn_cute", "flash_attn", "torch_varlen")
    with pytest.raises(KeyError):
        choose_backend("blocked", torch.device("cpu"))  # built by its mode, not chosen: it broke the probe


def test_sequence_tokens_cut_a_micro_batch_into_sequences_of_that_length() -> None:
    whole = Segments(torch.tensor([0, 700, 1000], dtype=torch.int32), 700, 0.5, None, None)
    seg = cut(whole, 1000, 256)
    assert seg.cu.tolist() == [0, 256, 512, 768, 1000]
    assert (seg.max_len, seg.scale) == (256, 0.5)
    assert attention_flops([seg], 2) == sum(
        4.0 * 2 * HEAD_DIM * n * (n + 1) / 2 for n in (256, 256, 256, 232)
    )
    assert cut(whole, 100, 256).cu.tolist() == [0, 100]

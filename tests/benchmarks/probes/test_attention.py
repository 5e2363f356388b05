"""The attention probe tries each backend the `attention` setting can choose, and nothing else."""

from __future__ import annotations

import pytest
import torch

from benchmarks.probes.attention import CHOSEN
from service.engine.ops.attention import choose_backend


@pytest.mark.parametrize("name", CHOSEN)
def test_each_backend_the_probe_tries_says_why_it_cannot_run_on_a_cpu(name: str) -> None:
    with pytest.raises(RuntimeError, match=f"attention={name} needs"):  # the probe's `skipped`
        choose_backend(name, torch.device("cpu"))


def test_the_probe_leaves_out_the_reference_and_batch_invariance_s_kernel() -> None:
    assert CHOSEN == ("flash_attn_cute", "flash_attn", "torch_varlen")
    with pytest.raises(KeyError):
        choose_backend("blocked", torch.device("cpu"))  # built by its mode, not chosen: it broke the probe

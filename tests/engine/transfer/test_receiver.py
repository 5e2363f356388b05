"""The receiver's device: a bare "cuda" (what `--device cuda` gives the engine) becomes the current GPU,
since torch.cuda.set_device, which joining and receiving call, refuses a device without an index."""

from __future__ import annotations

import torch

from service.engine.transfer.receiver import indexed


def test_a_bare_cuda_device_is_the_current_gpu() -> None:
    assert indexed(torch.device("cuda"), current=lambda: 3) == torch.device("cuda", 3)


def test_an_indexed_or_host_device_is_kept() -> None:
    def unused() -> int:
        raise AssertionError("the current GPU is not asked for")

    assert indexed(torch.device("cuda", 1), current=unused) == torch.device("cuda", 1)
    assert indexed(torch.device("cpu"), current=unused) == torch.device("cpu")

"""Reading a safetensors checkpoint (loading/checkpoint.py): a rank's slices (`sliced`) equal the
whole tensors cut, in either dimension, and a tensor without a part is read whole."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from service.engine.loading.checkpoint import read_all, sliced, tensor_files


def test_sliced_reads_each_part_and_the_rest_whole(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "rows": torch.randn(6, 4, generator=gen),
        "columns": torch.randn(3, 8, generator=gen),
        "bias": torch.randn(6, generator=gen),
        "norm": torch.randn(4, generator=gen),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    parts = {"rows": (0, 2, 5), "columns": (1, 4, 8), "bias": (0, 0, 3)}
    files = tensor_files(tmp_path)
    got = sliced(parts.get)(files, set(tensors))
    assert torch.equal(got["rows"], tensors["rows"][2:5])
    assert torch.equal(got["columns"], tensors["columns"][:, 4:8])
    assert torch.equal(got["bias"], tensors["bias"][:3])
    assert torch.equal(got["norm"], tensors["norm"])
    assert set(got) == set(read_all(files, set(tensors)))

"""A push's buckets (service/client/_buckets.py): what goes on the wire, read back the way SGLang's
receiver reads a flattened bucket (FlattenedTensorBucket.reconstruct_tensors, and logprobd's
engine/transfer/receive.py): entry i is bytes [start_i, start_i + nbytes_i) of one uint8 tensor,
viewed as its dtype, which needs start_i to be a multiple of the dtype's size."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
import torch

from service.client._buckets import Bucket, buckets, named_tensors
from service.client._rank0 import reach_address

# sizes chosen so that the order given would misalign: float32 after 3 bfloat16 starts at byte 6
MIXED = [
    ("a", torch.arange(3, dtype=torch.bfloat16)),
    ("b", torch.arange(5, dtype=torch.float32) / 3),
    ("c", torch.arange(7, dtype=torch.int8)),
    ("d", torch.arange(4, dtype=torch.float64).reshape(2, 2) / 7),
    ("e", torch.tensor(1.5, dtype=torch.float16)),
    ("f", torch.tensor([True, False, True])),
    ("g", torch.arange(6, dtype=torch.float32).reshape(2, 3).t()),  # not contiguous
]


def read_back(flat: torch.Tensor, metadata: dict[str, list[Any]]) -> dict[str, torch.Tensor]:
    """SGLang's reconstruction: no offsets travel; each entry starts where the one before ended."""
    out, start = {}, 0
    for name, dtype_name, shape in zip(
        metadata["names"], metadata["dtypes"], metadata["shapes"], strict=True
    ):
        dtype = getattr(torch, dtype_name)
        nbytes = math.prod(shape) * dtype.itemsize
        assert start % dtype.itemsize == 0, f"{name} ({dtype}) at byte {start}"
        out[name] = flat[start : start + nbytes].view(dtype).reshape(shape)
        start += nbytes
    assert start == flat.numel()
    return out


def bucket_of(pairs: list[tuple[str, torch.Tensor]]) -> Bucket:
    bucket = Bucket()
    for name, tensor in pairs:
        bucket.add(name, tensor)
    return bucket


def test_the_order_given_would_misalign_a_flattened_bucket() -> None:
    flat = torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for _, t in MIXED])
    metadata: dict[str, list[Any]] = {
        "names": [n for n, _ in MIXED],
        "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in MIXED],
        "shapes": [list(t.shape) for _, t in MIXED],
    }
    with pytest.raises(AssertionError, match=re.escape("b (torch.float32) at byte 6")):
        read_back(flat, metadata)


def test_a_flattened_bucket_goes_by_decreasing_item_size_and_reads_back_whole() -> None:
    packed = bucket_of(MIXED).packed(flattened=True)
    assert packed.metadata["names"] == ["d", "b", "g", "a", "e", "c", "f"]  # 8, 4, 4, 2, 2, 1, 1 bytes
    assert packed.metadata["dtypes"] == [
        "float64",
        "float32",
        "float32",
        "bfloat16",
        "float16",
        "int8",
        "bool",
    ]
    assert packed.metadata["shapes"] == [[2, 2], [5], [3, 2], [3], [], [7], [3]]
    [flat] = packed.broadcasts
    assert flat.dtype == torch.uint8
    assert packed.count == len(MIXED)
    assert packed.nbytes == flat.numel() == sum(t.numel() * t.element_size() for _, t in MIXED)
    got = read_back(flat, packed.metadata)
    for name, tensor in MIXED:
        assert torch.equal(got[name], tensor), name


def test_per_tensor_keeps_the_order_and_sends_contiguous_tensors() -> None:
    packed = bucket_of(MIXED).packed(flattened=False)
    assert packed.metadata["names"] == [n for n, _ in MIXED]
    assert packed.metadata["dtypes"][:2] == ["bfloat16", "float32"]
    assert len(packed.broadcasts) == len(MIXED)
    for sent, (_, tensor) in zip(packed.broadcasts, MIXED, strict=True):
        assert sent.is_contiguous()
        assert torch.equal(sent, tensor)


def test_buckets_hold_at_most_their_size_in_order_and_cast_floating_point_only() -> None:
    pairs = [(f"t{i}", torch.full((n,), float(i))) for i, n in enumerate([10, 20, 5, 100, 1, 1])]
    pairs.append(("ids", torch.arange(4)))
    made = list(buckets(iter(pairs), bucket_bytes=100, device=torch.device("cpu"), dtype=torch.bfloat16))
    # bfloat16 is 2 bytes: 20 + 40 + 10; t3 (200 bytes) alone; 2 + 2 + 4 int64
    assert [b.names for b in made] == [["t0", "t1", "t2"], ["t3"], ["t4", "t5", "ids"]]
    assert [b.nbytes for b in made] == [70, 200, 36]
    assert [t.dtype for t in made[-1].tensors] == [torch.bfloat16, torch.bfloat16, torch.int64]


def test_sources_are_modules_mappings_or_pairs() -> None:
    module = torch.nn.Linear(3, 2)
    assert [n for n, _ in named_tensors(module)] == ["weight", "bias"]
    assert [n for n, _ in named_tensors(module.state_dict())] == ["weight", "bias"]
    assert [n for n, _ in named_tensors(iter(module.named_parameters()))] == ["weight", "bias"]
    assert not any(t.requires_grad for _, t in named_tensors(module))
    with pytest.raises(TypeError, match="yields \\(name, tensor\\) pairs"):
        list(named_tensors([("w", [1.0])]))


def test_the_master_address_is_the_one_that_reaches_the_replica() -> None:
    assert reach_address("http://127.0.0.1:8000") == "127.0.0.1"
    assert reach_address("http://localhost:8000") in ("127.0.0.1", "::1")

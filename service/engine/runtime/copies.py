"""Host arrays onto the device without waiting for the device.

A copy from pageable host memory to a CUDA device first waits for every kernel queued on the stream
(CUDA stages it through a pinned buffer only once the stream is idle), which stops the launching
thread mid-launch: the device then runs dry while the thread catches up. From pinned memory the copy
is queued like a kernel. PyTorch's pinned-memory cache keeps the staging block until the copy is
done, so the array may be dropped at once.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """`array` as a tensor on `device`, the copy queued on the current stream (no wait on CUDA)."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)

"""Run each decoder layer's MLP over at most N tokens at a time.

The MLP's intermediate activations ([tokens, intermediate] several times over) are the largest
tensors of a packed forward. The MLP is token-wise, so splitting the row changes no result; chunks
of thousands of rows keep the GEMMs at full speed. (These are row chunks of one micro-batch; a
sequence longer than a micro-batch is cut into chunks by the batcher, which is another thing.)
Only the given model instance is wrapped; a module whose output is not a single tensor (a
mixture-of-experts block returning router logits) is left as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

ACTIVATION_BYTES = 640 * 2**20  # gate|up activations of one MLP chunk, where mlp_chunk_tokens is unset
_UNSET_FALLBACK = 4096  # a model whose config names no intermediate_size


def resolve_tokens(setting: int | None, config: Any, dtype: torch.dtype) -> int:
    """The MLP chunk in tokens (0: none): the setting, or where it is unset, the most tokens (a multiple
    of 1024) whose gate|up activations, 2 · intermediate_size values each, fit ACTIVATION_BYTES.

    Fewer, larger GEMMs run faster (at 4096-token chunks a Qwen2.5-0.5B round took 4 % longer on an
    H200: benchmarks/results/variants-mlp-chunk-h200-2026-11-21.txt), while at 7B's width a whole
    16k-token micro-batch would hold 1.9 GiB there.
    """
    if setting is not None:
        return setting
    intermediate = int(getattr(config, "intermediate_size", 0) or 0)
    if intermediate <= 0:
        return _UNSET_FALLBACK
    per_token = 2 * intermediate * dtype.itemsize
    return max(1024, ACTIVATION_BYTES // per_token // 1024 * 1024)


def chunk_mlps(model: Any, tokens: int) -> int:
    """Wrap every `mlp` submodule of `model`; return how many were wrapped (0 when tokens <= 0)."""
    if tokens <= 0:
        return 0
    wrapped = 0
    for module in list(model.modules()):
        mlp = getattr(module, "mlp", None)
        if isinstance(mlp, torch.nn.Module) and not isinstance(mlp.forward, _Chunked):
            mlp.forward = _Chunked(mlp.forward, tokens)
            wrapped += 1
    return wrapped


class _Chunked:
    def __init__(self, forward: Callable[..., Any], tokens: int) -> None:
        self.forward = forward
        self.tokens = tokens
        self.token_wise = True

    def __call__(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        # x: [B, N, H]; split along N
        if not self.token_wise or x.shape[-2] <= self.tokens:
            return self.forward(x, *args, **kwargs)
        parts = [self.forward(part, *args, **kwargs) for part in torch.split(x, self.tokens, dim=-2)]
        if all(isinstance(part, torch.Tensor) for part in parts):
            return torch.cat(parts, dim=-2)
        self.token_wise = False
        return self.forward(x, *args, **kwargs)

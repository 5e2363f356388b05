"""What the service side of the tests runs on, and how close it must come to the reference.

LOGPROBD_TEST_DEVICE / LOGPROBD_TEST_DTYPE / LOGPROBD_TEST_ATTENTION pick the device, dtype and
attention backend of every app or engine a test builds through `settings_for` (default cpu /
float32 / auto); the reference (`eager`) is always the model's own eager forward in float32 on the
same device. `make test-gpu` runs the suites marked `parity` on cuda in bfloat16, float16 and float32.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from service.settings import Settings

DEVICE = os.environ.get("LOGPROBD_TEST_DEVICE", "cpu")
DTYPE = os.environ.get("LOGPROBD_TEST_DTYPE", "float32")
ATTENTION = os.environ.get("LOGPROBD_TEST_ATTENTION", "auto")
# float32 promises 1e-4 (docs/semantics.md); half precisions are checked against bf16/fp16 noise
TOLERANCES = {"float32": 1e-4, "bfloat16": 0.25, "float16": 0.05}
TOLERANCE = TOLERANCES[DTYPE]
# critic values grow with their head (a random one reaches |v| ~ 10 where log-probs stay near 5): in a
# half precision their rounding grows with them, so they are also allowed 2 % of the row's largest |v|
# (float32: none)
VALUE_RTOL = 0.0 if DTYPE == "float32" else 0.02


# On a GPU the prefix cache takes a share of the memory left when its engine starts: a test process
# builds many engines, and those not yet collected would leave the later ones none. Tests size it as
# the CPU does (65,536 tokens), unless a test asks its own.
CACHE_TOKENS = {"cuda": 1 << 16}


def settings_for(path: Path | None, **overrides: Any) -> Settings:
    """Settings for the checkpoint at `path` on the test device, dtype and attention; `overrides` win."""
    values: dict[str, Any] = {"model": path, "device": DEVICE, "dtype": DTYPE, "attention": ATTENTION}
    if (kind := DEVICE.split(":")[0]) in CACHE_TOKENS:
        values["prefix_cache_tokens"] = CACHE_TOKENS[kind]
    values.update(overrides)
    return Settings(**values)


def eager(path: Path) -> Any:
    """The checkpoint as the per-sequence reference runs it: eager attention, float32."""
    import torch
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
    return model.to(DEVICE).eval()

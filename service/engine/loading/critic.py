"""Critic checkpoints: a decoder plus a value head, in the formats RL frameworks write.

- OpenRLHF (`get_llm_for_sequence_regression`): backbone + bias-free Linear(hidden, 1) whose attribute
  name is config.json's `value_head_prefix` (default "score"); with `normalize_reward` and `mean`/`std`
  in the config, values are (v - mean) / std.
- verl / Hugging Face `AutoModelForTokenClassification` with num_labels=1: head `score`, with bias.
- TRL `AutoModelForCausalLMWithValueHead`: `v_head.summary.weight` / `.bias` beside the causal-LM weights.

value[t] = head(h_{t-1}) on the critic's final hidden state, in float32 (docs/semantics.md).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from service.engine.loading.checkpoint import read_tensor, tensor_files
from service.engine.loading.pretrained import from_local, prepare, require_model_dir, text_config

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ValueHead:
    """weight [1, H] (and bias [1]) in float32; values normalised as (v - shift) / scale."""

    format: str
    weight: torch.Tensor
    bias: torch.Tensor | None
    shift: float = 0.0
    scale: float = 1.0
    prefix: str = "score"  # the checkpoint names its tensors <prefix>.weight and <prefix>.bias

    def tensors(self) -> dict[str, torch.Tensor]:
        """The head's tensors under their checkpoint names."""
        named = {f"{self.prefix}.weight": self.weight}
        if self.bias is not None:
            named[f"{self.prefix}.bias"] = self.bias
        return named

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [A, H] -> [A] float32
        values = hidden.float() @ self.weight[0]
        if self.bias is not None:
            values = values + self.bias[0]
        if self.shift != 0.0 or self.scale != 1.0:
            values = (values - self.shift) / self.scale
        return values

    def to(self, device: torch.device) -> ValueHead:
        bias = self.bias.to(device) if self.bias is not None else None
        return ValueHead(self.format, self.weight.to(device), bias, self.shift, self.scale, self.prefix)


def _read(files: dict[str, Path], name: str) -> torch.Tensor:
    return read_tensor(files, name).float()


def find_value_head(path: Path, config: dict[str, Any], hidden_size: int) -> ValueHead:
    """Recognise the checkpoint's value-head format, or fail with what was looked for."""
    files = tensor_files(path)
    architectures = config.get("architectures") or []
    if "v_head.summary.weight" in files:
        head = ValueHead(
            "trl",
            _read(files, "v_head.summary.weight"),
            _read(files, "v_head.summary.bias") if "v_head.summary.bias" in files else None,
            prefix="v_head.summary",
        )
    elif any(str(a).endswith("ForTokenClassification") for a in architectures) and "score.weight" in files:
        head = ValueHead(
            "token_classification",
            _read(files, "score.weight"),
            _read(files, "score.bias") if "score.bias" in files else None,
        )
    else:
        prefix = str(config.get("value_head_prefix") or "score")
        if f"{prefix}.weight" not in files:
            raise ValueError(
                f"{path}: no value head found. Looked for TRL `v_head.summary.weight`, a "
                "*ForTokenClassification `score.weight`, and OpenRLHF "
                f"`{prefix}.weight` (config value_head_prefix, default `score`)"
            )
        normalise = bool(config.get("normalize_reward")) and "mean" in config and "std" in config
        head = ValueHead(
            "openrlhf",
            _read(files, f"{prefix}.weight"),
            _read(files, f"{prefix}.bias") if f"{prefix}.bias" in files else None,
            shift=float(config["mean"]) if normalise else 0.0,
            scale=float(config["std"]) if normalise else 1.0,
            prefix=prefix,
        )
    if tuple(head.weight.shape) != (1, hidden_size):
        raise ValueError(
            f"{path}: value head of shape {tuple(head.weight.shape)}, expected (1, {hidden_size})"
        )
    return head


@dataclass(frozen=True, slots=True)
class Critic:
    decoder: Any  # a transformers base model (no LM head)
    head: ValueHead


def read_value_head(path: Path, hidden_size: int, device: torch.device) -> ValueHead:
    """The value head of the critic checkpoint directory `path`, on `device`."""
    require_model_dir(path, "critic")
    raw = json.loads((path / "config.json").read_text())
    return find_value_head(path, raw, hidden_size).to(device)


def load_critic(path: Path, dtype: torch.dtype, device: torch.device, attn: str) -> Critic:
    """The critic's decoder (no LM head) and its value head, on `device`."""
    from transformers import AutoModel

    require_model_dir(path, "critic")
    config = text_config(path)
    head = read_value_head(path, int(config.hidden_size), device)
    # transformers reports every tensor its decoder does not take (the value head, an actor's LM head)
    # as UNEXPECTED, which reads as a failure: its report is held back, and what matters said here
    reporters = [
        logging.getLogger(f"transformers.{name}") for name in ("modeling_utils", "utils.loading_report")
    ]
    quiet = _Quiet()
    for reporter in reporters:
        reporter.addFilter(quiet)
    try:
        model, info = from_local(
            AutoModel, path, role="critic", dtype=dtype, attn=attn, config=config, output_loading_info=True
        )
    finally:
        for reporter in reporters:
            reporter.removeFilter(quiet)
    missing = sorted(info.get("missing_keys") or []) + sorted(
        str(k) for k in info.get("mismatched_keys") or []
    )
    if missing:
        log.warning("critic %s: the checkpoint lacks or mis-shapes these decoder tensors: %s", path, missing)
    decoder = prepare(model, device)
    beside = len(info.get("unexpected_keys") or [])
    log.info(
        "loaded critic %s (%s value head) from %s; %d tensors beside the decoder's (its heads) not in it",
        type(decoder).__name__,
        head.format,
        path,
        beside,
    )
    return Critic(decoder, head)


class _Quiet(logging.Filter):
    """Drops transformers' load report (its other records pass)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "LOAD REPORT" not in str(record.msg)

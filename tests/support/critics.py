"""Tiny critic checkpoints in the formats RL frameworks write, built with plain torch/transformers.

- openrlhf: what `get_llm_for_sequence_regression(..., "critic")` saves: the backbone under `model.`,
  a bias-free `<value_head_prefix>.weight`, and config.json with value_head_prefix,
  normalize_reward, mean and std;
- token_classification: `AutoModelForTokenClassification` with num_labels=1 (verl): `score` with bias;
- trl: `AutoModelForCausalLMWithValueHead`: the causal LM's weights plus `v_head.summary.weight/.bias`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tests.support import models
from tests.support.reference import row_tokens_and_window

FORMATS = ("openrlhf", "token_classification", "trl")
OPENRLHF_PREFIX = "value_head"
OPENRLHF_MEAN, OPENRLHF_STD = 0.25, 2.0


def _save(directory: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.detach().clone().contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors")
    )
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def save(fmt: str, directory: Path, seed: int = 3) -> Path:
    gen = torch.Generator().manual_seed(seed)
    lm = models.build("qwen2", seed=seed)
    hidden = lm.config.hidden_size
    head = torch.randn(1, hidden, generator=gen) * 0.5
    bias = torch.randn(1, generator=gen)
    backbone = {k: v for k, v in lm.state_dict().items() if k.startswith("model.")}
    config = lm.config.to_dict()
    if fmt == "openrlhf":
        config.update(
            architectures=["CriticModel"],
            value_head_prefix=OPENRLHF_PREFIX,
            normalize_reward=True,
            mean=OPENRLHF_MEAN,
            std=OPENRLHF_STD,
        )
        return _save(directory, {**backbone, f"{OPENRLHF_PREFIX}.weight": head}, config)
    if fmt == "token_classification":
        config.update(
            architectures=["Qwen2ForTokenClassification"], id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0}
        )
        return _save(directory, {**backbone, "score.weight": head, "score.bias": bias}, config)
    if fmt == "trl":
        tensors = {**lm.state_dict(), "v_head.summary.weight": head, "v_head.summary.bias": bias}
        return _save(directory, tensors, config)
    raise ValueError(fmt)


def expected_values(directory: Path, tokens: list[int]) -> list[float]:
    """value[t] for t = 1..L-1: the head read straight from the safetensors on h_{t-1} of the backbone
    (transformers' eager Qwen2Model on the one unpadded sequence, float32)."""
    from safetensors.torch import load_file
    from transformers import Qwen2Config, Qwen2Model

    config = json.loads((directory / "config.json").read_text())
    tensors = load_file(str(directory / "model.safetensors"))
    qwen = Qwen2Config(**{k: v for k, v in config.items() if k not in ("architectures",)})
    base: Any = Qwen2Model(qwen)
    base.eval()
    base.load_state_dict({k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")})
    base.config._attn_implementation = "eager"
    with torch.no_grad():
        h = base(input_ids=torch.tensor([tokens])).last_hidden_state[0].double()  # [L, H]
    if "v_head.summary.weight" in tensors:
        w, b = tensors["v_head.summary.weight"], tensors["v_head.summary.bias"]
    elif "score.weight" in tensors:
        w, b = tensors["score.weight"], tensors["score.bias"]
    else:
        w, b = tensors[f"{OPENRLHF_PREFIX}.weight"], torch.zeros(1)
    values = h[:-1] @ w[0].double() + b.double()[0]  # position t-1 -> value of action t
    if config.get("normalize_reward"):
        values = (values - config["mean"]) / config["std"]
    return [float(v) for v in values]


def window_values(
    directory: Path, request: dict[str, Any], action_mask: list[list[int]]
) -> list[list[float]]:
    """The `values` rows a request's answer holds: expected_values at each action of each row's window
    (the answer's `action_mask`), 0.0 elsewhere."""
    rows = []
    for i, mask in enumerate(action_mask):
        tokens, window = row_tokens_and_window(request, i)
        per_position = expected_values(directory, tokens)
        rows.append(
            [per_position[p - 1] if m and p is not None else 0.0 for p, m in zip(window, mask, strict=True)]
        )
    return rows

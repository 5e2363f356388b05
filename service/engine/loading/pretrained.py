"""Load a local Hugging Face causal-LM directory, or build the demo model; never touch a hub."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

DEMO_NAME = "logprobd-demo-qwen2"
DEMO_SEED = 0


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: Any  # a transformers PreTrainedModel with a causal-LM head
    name: str
    demo: bool


def resolve_device(setting: str) -> torch.device:
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if setting == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device=cuda but torch sees no CUDA device")
    return torch.device(setting)


def resolve_dtype(setting: str, device: torch.device) -> torch.dtype:
    if setting == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype: torch.dtype = getattr(torch, setting)
    return dtype


def demo_config() -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        architectures=["Qwen2ForCausalLM"],
    )


def load_model(
    path: Path | None,
    name: str | None,
    dtype: torch.dtype,
    device: torch.device,
    attn: str,
    *,
    role: str = "policy",
) -> LoadedModel:
    from transformers import AutoModelForCausalLM

    if path is None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(DEMO_SEED)
            model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
                demo_config(), attn_implementation=attn, dtype=dtype
            )
        log.warning("serving the DEMO model %s: random weights, for trying the API only", DEMO_NAME)
        return LoadedModel(prepare(model, device), name or DEMO_NAME, demo=True)
    model = from_local(AutoModelForCausalLM, path, role=role, dtype=dtype, attn=attn)
    log.info("loaded %s %s from %s", role, type(model).__name__, path)
    return LoadedModel(prepare(model, device), name or path.resolve().name, demo=False)


def require_model_dir(path: Path, role: str) -> None:
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{role} {path} is not a model directory: no config.json")


def text_config(path: Path) -> Any:
    """The checkpoint's transformers config (its text part, for multimodal wrappers); local only."""
    from transformers import AutoConfig

    return text_part(AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=False))


def text_part(config: Any) -> Any:
    """The text model's config of a (possibly multimodal) config."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def from_local(
    auto_class: Any, path: Path, *, role: str, dtype: torch.dtype, attn: str, **kwargs: Any
) -> Any:
    """`auto_class.from_pretrained` on a local directory only: safetensors, no remote code, no hub."""
    require_model_dir(path, role)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return auto_class.from_pretrained(
        str(path),
        dtype=dtype,
        attn_implementation=attn,
        local_files_only=True,
        use_safetensors=True,
        trust_remote_code=False,
        **kwargs,
    )


def prepare(model: Any, device: torch.device) -> Any:
    """Inference only: eval mode, no gradients, on `device`."""
    model.eval()
    model.requires_grad_(False)
    return model.to(device)

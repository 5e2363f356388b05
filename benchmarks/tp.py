"""Tensor parallel: the standard workload at shapes too big for one GPU, and scaling on the long one.

    python -m benchmarks.tp --tp 2 --models qwen2.5-32b               # on nvidia-h200-x2
    python -m benchmarks.tp --tp 4 --models qwen2.5-72b               # on nvidia-h200-x4
    python -m benchmarks.tp --tp 1 2 --models qwen2.5-7b --workload long   # scaling, 1 and 2 GPUs
    python -m benchmarks.tp --tp 2 --models tiny --device cpu --dtype float32 --sequences 8 --reps 1
                                                  # CPU smoke test over gloo (tests/benchmarks runs it)

Per model and tensor-parallel size N: a checkpoint of random weights with the real shapes is written
once (safetensors, one file per layer, under --checkpoints), a real `python -m service serve
--tensor-parallel-size N` serves it (one process per GPU), and the workload goes over HTTP from 8
client processes in compact frames (client.py). Reported: milliseconds (median of --reps),
tokens/s, and the fraction of the FLOP floor, whose denominator is the dense matmul rate measured on
one GPU times N. `standard`: 64 RL-shaped sequences (workload.py); `long`: 8 sequences of 9k-25k
tokens (workload.py's long_workload), chunked at max_batch_tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import torch
from safetensors.torch import save_file

from benchmarks.harness import CACHE_IN_ROUNDS, RESULTS, matmul_rate, provenance, write_result
from benchmarks.server import http_bodies, http_seconds, serve_process
from benchmarks.shapes import SHAPES, TP_SHAPES
from benchmarks.workload import Sample, floor_flops, long_workload, workload

ALL_SHAPES = {**SHAPES, **TP_SHAPES}
POSITIONS = 32768


def layer_tensors(shape: dict[str, int | bool], layer: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One decoder layer's tensors, Qwen2 names, random (N(0, 0.02), norms 1); generated on a GPU
    when there is one."""
    h, i = int(shape["hidden_size"]), int(shape["intermediate_size"])
    heads, kv = int(shape["num_attention_heads"]), int(shape["num_key_value_heads"])
    d = h // heads
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device).manual_seed(layer)
    sizes = {
        "self_attn.q_proj.weight": (heads * d, h),
        "self_attn.q_proj.bias": (heads * d,),
        "self_attn.k_proj.weight": (kv * d, h),
        "self_attn.k_proj.bias": (kv * d,),
        "self_attn.v_proj.weight": (kv * d, h),
        "self_attn.v_proj.bias": (kv * d,),
        "self_attn.o_proj.weight": (h, heads * d),
        "mlp.gate_proj.weight": (i, h),
        "mlp.up_proj.weight": (i, h),
        "mlp.down_proj.weight": (h, i),
    }
    prefix = f"model.layers.{layer}."
    out = {
        prefix + name: (torch.randn(size, generator=gen, device=device) * 0.02).to(dtype).cpu()
        for name, size in sizes.items()
    }
    out[prefix + "input_layernorm.weight"] = torch.ones(h, dtype=dtype)
    out[prefix + "post_attention_layernorm.weight"] = torch.ones(h, dtype=dtype)
    return out


def write_checkpoint(name: str, root: Path, dtype: torch.dtype) -> Path:
    """A Qwen2 checkpoint of random weights with `name`'s shape, one safetensors file per layer (the
    host holds one layer at a time); kept and reused under `root`."""
    from transformers import Qwen2Config

    shape: dict[str, Any] = dict(ALL_SHAPES[name])
    path = root / f"{name}-{str(dtype).removeprefix('torch.')}"
    if (path / "model.safetensors.index.json").is_file():
        return path
    path.mkdir(parents=True, exist_ok=True)
    config = Qwen2Config(**shape, max_position_embeddings=POSITIONS, architectures=["Qwen2ForCausalLM"])
    weight_map: dict[str, str] = {}

    def save(tensors: dict[str, torch.Tensor], file: str) -> None:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / file))
        weight_map.update(dict.fromkeys(tensors, file))

    h, v = int(shape["hidden_size"]), int(shape["vocab_size"])
    gen = torch.Generator().manual_seed(12345)
    ends = {"model.embed_tokens.weight": (torch.randn(v, h, generator=gen) * 0.02).to(dtype)}
    ends["model.norm.weight"] = torch.ones(h, dtype=dtype)
    if not shape["tie_word_embeddings"]:
        ends["lm_head.weight"] = (torch.randn(v, h, generator=gen) * 0.02).to(dtype)
    save(ends, "ends.safetensors")
    for layer in range(int(shape["num_hidden_layers"])):
        save(layer_tensors(shape, layer, dtype), f"layer-{layer:03d}.safetensors")
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config.save_pretrained(path)  # written last: a checkpoint with a config is complete
    return path


def non_embedding_params(shape: dict[str, int | bool]) -> int:
    """Parameters outside the embedding and the head (the floor's 2·params·tokens)."""
    h, i, layers = int(shape["hidden_size"]), int(shape["intermediate_size"]), int(shape["num_hidden_layers"])
    heads, kv = int(shape["num_attention_heads"]), int(shape["num_key_value_heads"])
    d = h // heads
    attention = h * (heads + 2 * kv) * d + (heads + 2 * kv) * d + heads * d * h
    return layers * (attention + 3 * h * i + 2 * h) + h


@contextmanager
def server(checkpoint: Path, tp: int, args: argparse.Namespace) -> Iterator[str]:
    """`python -m service serve --tensor-parallel-size tp` on loopback, once ready; its URL."""
    argv = ["--model", str(checkpoint), "--device", args.device, "--dtype", args.dtype,
            "--tensor-parallel-size", str(tp), "--max-batch-tokens", str(args.max_batch_tokens)]  # fmt: skip
    argv += ["--prefix-cache" if CACHE_IN_ROUNDS else "--no-prefix-cache"]
    with serve_process(argv, start_timeout=args.start_timeout, verbose=args.verbose) as url:
        yield url


def samples_of(name: str, args: argparse.Namespace) -> list[Sample]:
    vocab = int(ALL_SHAPES[name]["vocab_size"])
    if args.workload == "long":
        return long_workload(vocab, args.long_scale)
    return workload(vocab, sequences=args.sequences)


def bench(name: str, tp: int, args: argparse.Namespace, rate_per_gpu: float) -> dict[str, Any]:
    dtype: torch.dtype = getattr(torch, args.dtype if args.dtype != "auto" else "bfloat16")
    checkpoint = write_checkpoint(name, args.checkpoints, dtype)
    samples = samples_of(name, args)
    tokens = sum(len(s.tokens) for s in samples)
    floor = floor_flops(ALL_SHAPES[name], non_embedding_params(ALL_SHAPES[name]), samples)
    with server(checkpoint, tp, args) as url:
        info = httpx.get(f"{url}/info").json()
        assert info["tensor_parallel_size"] == tp, info
        seconds = http_seconds(url, http_bodies(samples), args.reps)
    return {
        "model": name,
        "tensor_parallel_size": tp,
        "workload": args.workload,
        "sequences": len(samples),
        "tokens": tokens,
        "ms": seconds * 1e3,
        "tokens_per_s": tokens / seconds,
        "floor_fraction": floor / (rate_per_gpu * tp) / seconds,
        "decoder": info["decoder"],
        "kernels": info["kernels"],
        "attention_backend": info["attention_backend"],
    }


def parser() -> argparse.ArgumentParser:
    """The command line (tests/benchmarks/test_page.py parses each cited command with it)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tp", description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["qwen2.5-32b"], choices=sorted(ALL_SHAPES))
    parser.add_argument("--tp", nargs="+", type=int, default=[2], help="tensor-parallel sizes to run")
    parser.add_argument("--workload", choices=["standard", "long"], default="standard")
    parser.add_argument("--sequences", type=int, default=64, help="standard workload's sequences")
    parser.add_argument("--long-scale", type=float, default=1.0, help="long workload's lengths x this")
    parser.add_argument("--max-batch-tokens", type=int, default=16384)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--start-timeout", type=float, default=1800.0)
    parser.add_argument("--checkpoints", type=Path, default=Path(tempfile.gettempdir()) / "logprobd-tp-ckpt")
    parser.add_argument("--output", type=Path, default=RESULTS / "tp-latest.json")
    parser.add_argument("--verbose", action="store_true", help="echo the servers' logs")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device(args.device)
    dtype = getattr(torch, args.dtype if args.dtype != "auto" else "bfloat16")
    rate = matmul_rate(device, dtype)  # one GPU's; the floor's denominator is N of them
    runs = [bench(name, tp, args, rate) for name in args.models for tp in args.tp]
    result = {
        **provenance("tp", device, argv, gpus=max(args.tp)),
        "matmul_tflops_per_gpu": rate / 1e12,
        "runs": runs,
    }
    for run in runs:
        print(
            f"{run['model']:>14} tp={run['tensor_parallel_size']} {run['workload']:>8}: "
            f"{run['ms']:9.1f} ms  {run['tokens_per_s']:10.0f} tok/s  "
            f"{100 * run['floor_fraction']:5.1f} % of the floor"
        )
    write_result(args.output, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What every benchmark shares: the stack and device a result came from, the random-weight models it
builds, the clock it times with, and the result file it writes.

A result file is one JSON object. Its top level says where it came from (`provenance`): `suite`,
`device`, `gpus`, `date`, `commit` (LOGPROBD_COMMIT where set, else git's HEAD, `+dirty` when
service/ or benchmarks/ differ from it), `command` (the `python -m benchmarks.<suite> ...` that
reproduces it, without --output), `environment` (the LOGPROBD_* settings the run's environment gave)
and `versions` (python, torch, cuda and the packages that choose the
kernels); beside it the suite's own keys (`settings`, `matmul_tflops`, `models`, ...) and `clocks`, the
GPU's clock and power in the windows the run marked (benchmarks/clocks.py; the matmul rates' always).
benchmarks/page renders BENCHMARKS.md from such files.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.clocks import ClockTrace, window
from benchmarks.workload import Sample
from service.engine.ops.attention import AttentionBackend, choose_backend, register
from service.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PACKAGES = ("transformers", "triton", "flash-attn-4", "quack-kernels", "nvidia-cutlass-dsl", "liger-kernel")
ACCURACY_SAMPLE = 4  # sequences scored against a float32 forward
SUSTAINED_S = 0.25  # about one round of the standard workload at 1.5B on an H100
# A suite's rounds send the same sequences again, where a trainer's steps send new ones: the prefix
# cache would serve every round after the first. The suites that time rounds serve with it off
# (benchmarks.prefix_cache measures it on and off, flushing it between rounds: <= 2 % on these).
CACHE_IN_ROUNDS = False


# --- where a result came from ------------------------------------------------------------------


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"


def versions() -> dict[str, str]:
    """Python, torch, the CUDA torch was built with, and the installed packages that pick kernels."""
    found = {"python": platform.python_version(), "torch": torch.__version__}
    if torch.version.cuda:
        found["cuda"] = torch.version.cuda
    for name in PACKAGES:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            continue
    return found


def commit() -> str:
    """LOGPROBD_COMMIT where set (a machine without the git history), else the checkout's short HEAD,
    `+dirty` when service/ or benchmarks/ differ from it; `unknown` without either."""
    if given := os.environ.get("LOGPROBD_COMMIT"):
        return given
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        changed = subprocess.run(
            ["git", "status", "--porcelain", "--", "service", "benchmarks"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{head}+dirty" if changed else head


def command(suite: str, argv: list[str] | None) -> str:
    """`python -m benchmarks.<suite>` with the arguments given, --output and its value left out."""
    args = list(sys.argv[1:] if argv is None else argv)
    kept: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg == "--output":
            skip = True
        elif not arg.startswith("--output="):
            kept.append(arg)
    return " ".join(["python", "-m", f"benchmarks.{suite}", *map(shlex.quote, kept)])


def provenance(suite: str, device: torch.device, argv: list[str] | None, gpus: int = 1) -> dict[str, Any]:
    """The top level every result file starts with (the module docstring); `gpus`: how many the run
    used (none off a GPU); `environment`: the server settings given as LOGPROBD_* variables (a run's
    Settings read them; other LOGPROBD_* variables, such as LOGPROBD_COMMIT, are not settings)."""
    return {
        "suite": suite,
        "device": device_name(device),
        "gpus": gpus if device.type == "cuda" else 0,
        "date": dt.date.today().isoformat(),
        "commit": commit(),
        "command": command(suite, argv),
        "environment": {k: v for k, v in sorted(os.environ.items()) if _setting(k)},
        "versions": versions(),
    }


def _setting(variable: str) -> bool:
    """Whether `variable` sets one of the server's Settings (LOGPROBD_<FIELD>)."""
    prefix = "LOGPROBD_"
    return variable.startswith(prefix) and variable[len(prefix) :].lower() in Settings.model_fields


def write_result(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")


# --- the clock -------------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median wall seconds of fn() between device synchronisations, after one warm-up call: what a
    caller waits for a whole round (host work included)."""
    fn()
    times = []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def median_ms(run: Callable[[], object], device: torch.device, reps: int, warmup: int = 3) -> float:
    """Median milliseconds of run() after `warmup` calls: between CUDA events on a GPU (the device's
    time for what run queues), wall time elsewhere."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            begin = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            begin.record()
            run()
            end.record()
            end.synchronize()
            times.append(float(begin.elapsed_time(end)))
        else:
            began = time.perf_counter()
            run()
            times.append((time.perf_counter() - began) * 1e3)
    return float(statistics.median(times))


def _square_operands(device: torch.device, dtype: torch.dtype) -> tuple[int, torch.Tensor, torch.Tensor]:
    """The matmul both rates time: n and two random [n, n] operands (8192 on CUDA, 512 on the CPU)."""
    n = 8192 if device.type == "cuda" else 512
    return n, torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)


def matmul_rate(device: torch.device, dtype: torch.dtype) -> float:
    """Measured dense matmul FLOP/s on this device (every floor's denominator): the median of 20
    matmuls, each alone between synchronisations, so the GPU runs them at its boost clock."""
    n, a, b = _square_operands(device, dtype)
    return 2.0 * n**3 / timed(lambda: a @ b, device, reps=20)


def sustained_matmul_rate(device: torch.device, dtype: torch.dtype, seconds: float = SUSTAINED_S) -> float:
    """Dense matmul FLOP/s kept over `seconds` of the same matmuls back to back, as a round's GEMMs run:
    under a load that long an H100 meets its power cap and lowers its clock, so this is below
    matmul_rate. Reported beside the floor, never its denominator."""
    n, a, b = _square_operands(device, dtype)
    out = torch.mm(a, b)
    sync(device)
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        for _ in range(10):
            torch.mm(a, b, out=out)
        calls += 10
        sync(device)
    return 2.0 * n**3 * calls / elapsed


def peak_memory(fn: Callable[[], object], device: torch.device) -> float:
    """GiB: the allocator's peak over one fn() call (0 off a GPU)."""
    if device.type != "cuda":
        return 0.0
    gc.collect()  # cyclic garbage from an earlier variant must not count against this one
    sync(device)
    torch.cuda.reset_peak_memory_stats()
    fn()
    sync(device)
    return torch.cuda.max_memory_allocated() / 2**30


# --- the models ------------------------------------------------------------------------------------


def build_model(
    shape: dict[str, Any], dtype: torch.dtype, device: torch.device, attn: str, positions: int = 32768
) -> Any:
    """A random-weight model of `shape` (shapes.py: dense Qwen2, or an MoE `family`), built on `device`
    in `dtype` (no host copy of the weights), seeded, in eval mode."""
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen2Config, Qwen3MoeConfig

    family = {"qwen2": Qwen2Config, "qwen3_moe": Qwen3MoeConfig, "mixtral": MixtralConfig}
    kwargs = {k: v for k, v in shape.items() if k != "family"}
    config = family[shape.get("family", "qwen2")](**kwargs, max_position_embeddings=positions)
    with torch.device(device), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype)  # type: ignore[no-untyped-call]
    return model.eval().requires_grad_(False)


def packed_model(
    shape: dict[str, Any],
    dtype: torch.dtype,
    device: torch.device,
    attention: str = "auto",
    positions: int = 32768,
) -> tuple[AttentionBackend, str, Any]:
    """The attention backend `attention` resolves to on `device`, the name transformers calls its
    packed kernel by, and a model of `shape` built to run it (build_model)."""
    backend = choose_backend(attention, device)
    packed = register(backend)
    return backend, packed, build_model(shape, dtype, device, packed, positions)


def active_params(model: Any) -> int:
    """Non-embedding parameters a token runs through (the floor's 2·params·tokens): all but the
    embedding, the head and, in a sparse layer, the experts it is not routed to."""
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    total = sum(p.numel() for p in model.parameters())
    total -= embedding.numel() + (0 if head is embedding else head.numel())
    for layer in model.base_model.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            k = int(model.config.num_experts_per_tok)
            per_expert = experts.gate_up_proj[0].numel() + experts.down_proj[0].numel()
            total -= (experts.gate_up_proj.shape[0] - k) * per_expert
    return int(total)


def reference_logprobs(model: Any, samples: list[Sample], device: torch.device) -> list[np.ndarray]:
    """The model's own forward (as it is: cast it to float32 first for a reference), one unpadded
    sequence at a time: each response token's log-prob."""
    out = []
    with torch.inference_mode():
        for s in samples:
            ids = torch.tensor([s.tokens], device=device)
            logp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[0].float(), dim=-1)
            start = len(s.prompt) - 1
            targets = ids[0, len(s.prompt) :]
            out.append(logp[start : start + len(s.response)].gather(1, targets[:, None])[:, 0].cpu().numpy())
    return out


def max_abs_diff(got: list[np.ndarray], want: list[np.ndarray]) -> float:
    return max(float(np.max(np.abs(g.astype(np.float64) - w))) for g, w in zip(got, want, strict=True))


# --- a suite's run over its models ---------------------------------------------------------------------

Bench = Callable[[str, argparse.Namespace, torch.device, float], dict[str, Any]]


def run_models(suite: str, args: argparse.Namespace, argv: list[str] | None, bench: Bench) -> dict[str, Any]:
    """The provenance and the matmul rates, then `bench` of each of args.models (each in a process of
    its own, `python -m benchmarks.<suite>`, when there are several: nothing one model patches or
    caches reaches the next): the result, written to args.output after each model."""
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    trace = ClockTrace.start(device)
    with trace:
        with window("matmul"):
            rate = matmul_rate(device, dtype)
        with window("matmul_sustained"):
            sustained = sustained_matmul_rate(device, dtype)
        results = _run(suite, args, argv, bench, device, rate, sustained)
    results["clocks"] = trace.summary()
    write_result(args.output, results)
    return results


def _run(  # noqa: PLR0917
    suite: str,
    args: argparse.Namespace,
    argv: list[str] | None,
    bench: Bench,
    device: torch.device,
    rate: float,
    sustained: float,
) -> dict[str, Any]:
    results: dict[str, Any] = {
        **provenance(suite, device, argv),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "matmul_tflops": rate / 1e12,
        "matmul_tflops_sustained": sustained / 1e12,
        "models": {},
    }
    print(
        f"{results['device']}: measured {args.dtype} matmul {rate / 1e12:.0f} TFLOP/s (the floor's rate; "
        f"{sustained / 1e12:.0f} TFLOP/s kept over {SUSTAINED_S} s back to back)",
        flush=True,
    )
    for name in args.models:
        if len(args.models) == 1:
            results["models"][name] = bench(name, args, device, rate)
        else:
            results["models"][name] = isolated(name, sys.argv[1:] if argv is None else argv, suite)
        write_result(args.output, results)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


def isolated(name: str, argv: list[str], suite: str) -> dict[str, Any]:
    """`python -m benchmarks.<suite> ... --models name` in a process of its own: that model's result
    (with that process's clock windows as its `clocks`)."""
    keep: list[str] = []
    skip = False
    for arg in argv:  # drop --models and --output with their values
        if arg in ("--models", "--output"):
            skip = True
            continue
        if skip and not arg.startswith("--"):
            continue
        skip = False
        keep.append(arg)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "one.json"
        cmd = [sys.executable, "-m", f"benchmarks.{suite}", *keep, "--models", name, "--output", str(out)]
        subprocess.run(cmd, check=True, stdout=sys.stderr)
        child = json.loads(out.read_text())
        model_result: dict[str, Any] = child["models"][name]
        if child.get("clocks"):
            model_result["clocks"] = child["clocks"]
        return model_result

"""Where a server's start goes, from the weights built to /health/ready, with cold and warm caches.

    python -m benchmarks.startup --model qwen3-30b-a3b            # H100: a cold start, then a warm one
    python -m benchmarks.startup --model qwen3-30b-a3b-8l --runs 3 --cache-dir /tmp/cc
    python -m benchmarks.startup --model tiny-moe --device cpu --dtype float32 --runs 1

Each start runs in a process of its own (kernels compiled in a process stay in it), with every
compile cache the stack keeps on disk pointed under one directory, as the Docker image points them
under /tmp/kernels: Triton's (TRITON_CACHE_DIR), quack's (QUACK_CACHE_DIR), flash-attn 4's (turned
on, as the image does) and the CUDA driver's PTX cache (CUDA_CACHE_PATH). A fresh directory makes
the first start cold, as on a new node; the later ones find what the first wrote, as after a
restart or on a pod sharing the chart's compileCache volume.

Per start: `ready_s` (weights built to ready over HTTP: what benchmarks.moe reports),
`idle_graphs_s` (from ready until the engine has captured the CUDA graphs it leaves for its idle
time: an MoE policy's routed ones), the
engine's own phases (building the decoders, the warm-up's scoring, the self-check, the GEMM shapes
met, a micro-batch's working set measured, the prefix cache's pools allocated, the CUDA graphs
checked and captured, the longest sequence sized, and after ready, within `idle_graphs_s`, an MoE
policy's routed modes checked: each timed to the device's idle; a phase in several calls, such as
the routed check's two idle-time steps, also its longest call: what a request arriving then waits
for at most), and the
compiles within them: Triton's (`_do_compile`, a disk hit included) and the CuTe DSL's
(`cute.compile`, quack's and flash-attn 4's kernels; a disk hit skips it), by kernel and by the
outermost phase they fell in.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import functools
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

CACHES = {  # environment variable -> subdirectory of the run's cache directory
    "TRITON_CACHE_DIR": "triton",
    "QUACK_CACHE_DIR": "quack",
    "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR": "flash_attn_cute",
    "CUDA_CACHE_PATH": "cuda",
}


class Clock:
    """Wall seconds per phase and per compiled kernel, filled by the wrappers `instrument` installs."""

    def __init__(self, sync: Callable[[], None]) -> None:
        self.sync = sync
        self.calls: dict[str, list[float]] = defaultdict(list)  # each call of a phase, in order
        self.compiles_in: dict[str, float] = defaultdict(float)  # compile seconds per outermost phase
        self.compiles: dict[str, dict[str, list[float]]] = {
            "triton": defaultdict(list),
            "cute": defaultdict(list),
        }
        self._stack: list[str] = []

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time `name` to the device's idle; a phase inside another is named "outer/inner" (and
        counts in the outer one too)."""
        self._stack.append(name)
        key = "/".join(self._stack)
        self.sync()
        started = time.perf_counter()
        try:
            yield
        finally:
            self.sync()
            self._stack.pop()
            self.calls[key].append(time.perf_counter() - started)

    def timed_phase(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self.phase(name):
                return fn(*args, **kwargs)

        return wrapper

    def timed_compile(
        self, kind: str, label: Callable[..., str], fn: Callable[..., Any]
    ) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - started
                self.compiles[kind][label(*args, **kwargs)].append(elapsed)
                self.compiles_in[self._stack[0] if self._stack else "outside the phases"] += elapsed

        return wrapper

    def report(self) -> dict[str, Any]:
        return {
            "phases_s": {k: sum(v) for k, v in self.calls.items()},
            "phase_calls": {k: len(v) for k, v in self.calls.items()},
            "phase_longest_s": {k: max(v) for k, v in self.calls.items()},
            "compile_s_by_phase": dict(self.compiles_in),
            "compiles": {
                kind: {
                    "count": sum(len(v) for v in by.values()),
                    "seconds": sum(sum(v) for v in by.values()),
                    "by_kernel": {k: {"count": len(v), "seconds": sum(v)} for k, v in sorted(by.items())},
                }
                for kind, by in self.compiles.items()
            },
        }


def _cute_label(fn: Any, *_: Any, **__: Any) -> str:
    inner = getattr(fn, "__func__", fn)
    owner = type(getattr(fn, "__self__", None)).__name__
    return f"{owner}.{getattr(inner, '__name__', type(fn).__name__)}"


def instrument(clock: Clock) -> None:
    """Wrap the engine's start-up steps and the compilers with `clock`'s timers (this process only)."""
    from service.engine import decoder
    from service.engine.decoder import graphs
    from service.engine.moe import grouped_gemm
    from service.engine.ops import gate_up as gated
    from service.engine.scorer import build
    from service.engine.scorer.engine import PackedScorer

    PackedScorer.__init__ = clock.timed_phase("build decoders", PackedScorer.__init__)  # type: ignore[method-assign]
    steps = {"score": "warm-up scoring", "_self_check": "self-check", "meet_shapes": "GEMM shapes"}
    steps |= {"_measure": "working set", "_open_cache": "prefix cache", "_size_longest": "longest sequence"}
    steps |= {"_check_routed": "idle: routed modes checked"}  # an MoE policy's, after ready (idle_graphs_s)
    for method, name in steps.items():
        setattr(PackedScorer, method, clock.timed_phase(name, getattr(PackedScorer, method)))
    for module, function, name in [
        (decoder, "build", "fused decoder"),
        (grouped_gemm, "choose", "MoE kernel probe"),
        (gated, "choose", "MLP kernel probe"),
        (build, "apply_fused_kernels", "kernel patches"),
    ]:
        setattr(module, function, clock.timed_phase(name, getattr(module, function)))
    graphs.GraphedDecoder.capture = clock.timed_phase("CUDA graphs", graphs.GraphedDecoder.capture)  # type: ignore[method-assign]
    with contextlib.suppress(ImportError):
        jit = importlib.import_module("triton.runtime.jit").JITFunction
        label = lambda self, *_a, **_k: str(self.fn.__name__)  # noqa: E731
        jit._do_compile = clock.timed_compile("triton", label, jit._do_compile)
    with contextlib.suppress(ImportError):
        cute: Any = importlib.import_module("cutlass.cute")
        cute.compile = clock.timed_compile("cute", _cute_label, cute.compile)


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One start in this process: build the model, instrument, start the server, report."""
    import torch

    from benchmarks.harness import build_model, device_name, versions
    from benchmarks.server import HttpServer
    from benchmarks.shapes import MOE_SHAPES
    from service.engine.config import EngineConfig
    from service.engine.loading.pretrained import LoadedModel
    from service.engine.ops.attention import choose_backend, register
    from service.engine.scorer.engine import PackedScorer
    from service.settings import Settings

    device = torch.device(args.device)
    clock = Clock(lambda: torch.cuda.synchronize(device) if device.type == "cuda" else None)
    instrument(clock)
    shape = dict(MOE_SHAPES[args.model])
    backend = choose_backend(args.attention, device)
    built_at = time.perf_counter()
    model = build_model(shape, getattr(torch, args.dtype), device, register(backend))
    clock.sync()
    build_s = time.perf_counter() - built_at
    settings = Settings(
        device=device.type, dtype=args.dtype, decoder="fused", max_batch_tokens=args.max_batch_tokens
    )
    engines: list[PackedScorer] = []

    def factory(_: EngineConfig) -> PackedScorer:
        engines.append(
            PackedScorer(
                LoadedModel(model, args.model, demo=False), device, backend, settings.engine_config()
            )
        )
        return engines[0]

    loaded = time.perf_counter()
    server = HttpServer(factory, settings)
    with server:
        info = engines[0].info
    return {
        "device": device_name(device),
        "versions": versions(),
        "ready_s": server.ready_at - loaded,
        "idle_graphs_s": server.settled_at - server.ready_at,
        "model_build_s": build_s,
        **clock.report(),
        "kernels": info.kernels,
        "moe_kernel": info.moe_kernel,
        "attention": info.attention_backend,
    }


def _summary(n: int, run: dict[str, Any]) -> str:
    calls, longest = run["phase_calls"], run["phase_longest_s"]
    phases = ", ".join(
        f"{k} {v:.1f}" + (f" ({calls[k]} calls, the longest {longest[k]:.1f})" if calls[k] > 1 else "")
        for k, v in run["phases_s"].items()
        if "/" not in k
    )
    compiles = ", ".join(f"{k} {v['count']} in {v['seconds']:.1f} s" for k, v in run["compiles"].items())
    graphs = run["idle_graphs_s"]
    idle = f"; idle-time graphs {graphs:.1f} s after ready" if graphs >= 0.1 else ""
    return f"start {n + 1}: ready {run['ready_s']:.1f} s ({phases}){idle}; compiles: {compiles}"


def parser() -> argparse.ArgumentParser:
    """The command line (tests/benchmarks/test_page.py parses each cited command with it)."""
    from benchmarks.harness import RESULTS

    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.startup",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default="qwen3-30b-a3b")
    parser.add_argument("--runs", type=int, default=2, help="starts, one after another, sharing the caches")
    parser.add_argument("--cache-dir", type=Path, help="the caches' directory (default: a fresh one: cold)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--attention", default="auto")
    parser.add_argument("--max-batch-tokens", type=int, help="unset: the service's default")
    parser.add_argument("--output", type=Path, default=RESULTS / "startup-latest.json")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)  # write one start's result here
    return parser


def main(argv: list[str] | None = None) -> int:
    from benchmarks.harness import command, commit, write_result

    args = parser().parse_args(argv)
    if args.child is not None:
        args.child.write_text(json.dumps(child(args)))
        return 0
    with contextlib.ExitStack() as stack:
        root = args.cache_dir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="logprobd-cc-")))
        root.mkdir(parents=True, exist_ok=True)
        env = os.environ | {var: str(root / sub) for var, sub in CACHES.items()}
        env["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] = "1"  # as the image sets it
        runs = []
        for n in range(args.runs):
            out = root / f"start-{n}.json"
            cmd = [sys.executable, "-m", "benchmarks.startup", "--model", args.model, "--device", args.device]
            cmd += ["--dtype", args.dtype, "--attention", args.attention]
            if args.max_batch_tokens is not None:
                cmd += ["--max-batch-tokens", str(args.max_batch_tokens)]
            cmd += ["--child", str(out)]
            subprocess.run(cmd, check=True, env=env, stdout=sys.stderr)
            runs.append(json.loads(out.read_text()))
            print(_summary(n, runs[-1]), flush=True)
    first = runs[0]
    result = {
        "suite": "startup",
        "device": first["device"],
        "gpus": 1 if args.device == "cuda" else 0,
        "date": dt.date.today().isoformat(),
        "commit": commit(),
        "command": command("startup", argv),
        "versions": first["versions"],
        "model": args.model,
        "cache_dir": str(args.cache_dir) if args.cache_dir else "fresh (the first start cold)",
        "starts": runs,
    }
    write_result(args.output, result)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

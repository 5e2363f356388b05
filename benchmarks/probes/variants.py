"""Engine variants, measured one configuration set per process: what pays.

    python -m benchmarks.probes.variants --model qwen2.5-1.5b [--decoder fused] [--kernels auto|none]
    python -m benchmarks.probes.variants --model qwen2.5-1.5b --decoder transformers --kernels liger \\
        [--rope none]
    python -m benchmarks.probes.variants --model qwen2.5-1.5b --configs 16384:512 --profile \\
        [--head torch|previous]

The service's engine in-process on the benchmark workload, for several token budgets and lm_head
chunk sizes. `--decoder fused` (the default, as the service picks for Qwen2) is logprobd's own
forward, with its Triton kernels unless `--kernels none`; `--decoder transformers --kernels liger`
is transformers' forward with liger-kernel's RMSNorm, SwiGLU and RoPE; `--rope none` takes that
fused RoPE back out; `--head current` is the service's head (the one-pass
Triton kernel of fused_head.py where it applies), `--head torch` forces its torch log-softmax path,
`--head previous` scores with the head as it was before the single fused log-softmax (upcast copy,
temperature multiply, logsumexp); `--attention` picks the packed attention kernel and
`--mlp-kernel` the gate|up projection (auto: as the service picks); `--profile` prints the CUDA
kernels of one round by total time.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import sys
from typing import Any, get_args

import torch

from benchmarks.harness import CACHE_IN_ROUNDS, packed_model, peak_memory, timed
from benchmarks.shapes import SHAPES
from benchmarks.workload import jobs, workload
from service.batcher import Batcher
from service.engine.heads.base import ActionScores, LogitTransform
from service.engine.heads.chunked import score_actions
from service.engine.loading.pretrained import LoadedModel
from service.engine.ops.attention import BACKENDS, choose_backend
from service.engine.ops.rope import unfuse_rope
from service.engine.scorer import engine as scorer
from service.engine.scorer.engine import PackedScorer
from service.metrics import Metrics
from service.settings import CudaGraphs, MlpKernel, Settings

CONFIGS = ["16384:1024", "16384:512", "16384:256", "32768:512", "8192:512"]


def previous_head(
    *,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    inv_temperature: torch.Tensor | None,
    lm_head: torch.nn.Module,
    transform: LogitTransform,
    chunk_rows: int,
    want_entropy: bool,
) -> ActionScores:
    """The head before this change (commit fa92fd3..2f44f22), for comparison only."""
    rows = hidden.shape[0]
    logprobs = torch.empty(rows, dtype=torch.float32, device=hidden.device)
    entropy = torch.empty_like(logprobs) if want_entropy else None
    inv_t = inv_temperature if inv_temperature is not None else torch.ones_like(logprobs)
    for start in range(0, rows, chunk_rows):
        end = min(start + chunk_rows, rows)
        z = transform(lm_head(hidden[start:end]).float())
        z.mul_(inv_t[start:end, None])
        lse = torch.logsumexp(z, dim=-1)
        logprobs[start:end] = z.gather(1, targets[start:end, None]).squeeze(1) - lse
        if entropy is not None:
            p = torch.exp(z - lse[:, None])
            entropy[start:end] = lse - (p * z).sum(dim=-1)
    return ActionScores(logprobs=logprobs, entropy=entropy)


def measure(
    model: Any, name: str, settings: Settings, *, reps: int, profile: bool, rope: str
) -> tuple[str, float, float]:
    device = torch.device("cuda")
    backend = choose_backend(settings.attention, device)
    engine = PackedScorer(LoadedModel(model, name, demo=False), device, backend, settings.engine_config())
    label = f"{engine.info.decoder}/{engine.info.kernels}"
    if rope == "none" and unfuse_rope(model):
        label += "-rope"
    budget = engine.info.max_batch_tokens
    the_jobs = jobs(workload(int(SHAPES[name]["vocab_size"])))
    loop = asyncio.new_event_loop()
    batcher = Batcher(engine, budget, Metrics())
    loop.call_soon(batcher.start)

    def run() -> object:
        return loop.run_until_complete(batcher.score(the_jobs))

    seconds = timed(run, device, reps)
    peak = peak_memory(run, device)
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as profiler

        with profiler(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
            run()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
        grouped = prof.key_averages(group_by_input_shape=True)
        ops = [e for e in grouped if e.key.startswith(("aten::", "torch_"))]
        print("torch ops by the GPU time of the kernels they launch (count, ms, input shapes):")
        for e in sorted(ops, key=lambda e: -e.device_time_total)[:30]:  # which op launches what
            print(f"  {e.key:40s} {e.count:6d} {e.device_time_total / 1e3:9.2f}  {str(e.input_shapes)[:150]}")
    loop.run_until_complete(batcher.stop())
    loop.close()
    return label, seconds * 1e3, peak


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen2.5-1.5b")
    parser.add_argument("--decoder", default="auto", choices=["auto", "fused", "transformers"])
    parser.add_argument("--kernels", default="auto", choices=["auto", "none", "liger"])
    parser.add_argument("--rope", default="fused", choices=["fused", "none"])
    parser.add_argument("--attention", default="auto", choices=["auto", *BACKENDS])
    parser.add_argument("--mlp-kernel", default="auto", choices=get_args(MlpKernel))
    parser.add_argument("--cuda-graphs", default="auto", choices=get_args(CudaGraphs))
    parser.add_argument("--head", default="current", choices=["current", "torch", "previous"])
    parser.add_argument(
        "--mlp-chunk-tokens", type=int, default=None, help="0: all at once; unset: the service's default"
    )
    parser.add_argument("--configs", nargs="+", default=CONFIGS, help="BUDGET:CHUNK_ROWS ...")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    backend, _, model = packed_model(dict(SHAPES[args.model]), torch.bfloat16, device, args.attention)
    label = f"+{backend.name}" + (f"+mlp{args.mlp_chunk_tokens}" if args.mlp_chunk_tokens is not None else "")
    if args.head == "previous":
        setattr(scorer, "score_actions", previous_head)  # noqa: B010 (CausalLM looks it up at call time)
        label += "+prevhead"
    elif args.head == "torch":
        setattr(scorer, "score_actions", functools.partial(score_actions, fused=False))  # noqa: B010 (as above)
        label += "+torchhead"
    for config in args.configs:
        budget, chunk = (int(x) for x in config.split(":"))
        settings = Settings(
            device="cuda",
            dtype="bfloat16",
            max_batch_tokens=budget,
            logits_chunk_rows=chunk,
            mlp_chunk_tokens=args.mlp_chunk_tokens,
            decoder=args.decoder,
            kernels=args.kernels,
            attention=backend.name,
            mlp_kernel=args.mlp_kernel,
            cuda_graphs=args.cuda_graphs,
            prefix_cache=CACHE_IN_ROUNDS,
        )
        engine_label, ms, peak = measure(
            model, args.model, settings, reps=args.reps, profile=args.profile, rope=args.rope
        )
        config_label = f"{engine_label + label:32s} budget={budget:6d} chunk={chunk:5d}"
        print(f"{args.model} {config_label}: {ms:8.1f} ms  peak {peak:5.1f} GiB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The prefix cache's targets (issue 52), with the cache on and off in one run.

    python -m benchmarks.prefix_cache                 # on a GPU host: 7B; results/prefix-cache-latest.json
    python -m benchmarks.prefix_cache --models tiny --device cpu --dtype float32 --scale 0.02 --reps 1
                                                      # CPU smoke test (tests/benchmarks runs it)

Every request is plain JSON from a client process of its own (a trainer rank: a default
httpx.Client, `json=`, `response.json()`), on the real app on loopback over a model of random bf16
weights with the real shape. Scenarios (fixed seeds; --scale multiplies every length):

- `split-grpo` (a): 8 groups x 8 samples, prompts U[2048, 4096], responses Exp(250) in [16, 1024];
  rank i posts sample i of every group, the ranks starting 0-100 ms apart at random (verl's
  balance_batch). Targets: computed <= 1.05x unique, >= 70 % of the unique-token floor.
- `trajectories` (b): 8 agent trajectories of 6 steps, each a rank: an 8k-token context growing by
  U[500, 2000] tokens a step (a third tool result, the rest the answer: the actions), each step
  scored when it ends. Targets: computed <= 1.1x the new tokens, >= 65 % of their floor.
- `teacher` (c): 64 /v1/completions calls with prompt_logprobs (K = 1) of 4,096-token prompts sharing
  a 3,072-token system prompt, 8 ranks of 8 calls one after another. Target: computed <= 1.1x unique.
- `grpo-long` and `grpo-long-grouped` (d): benchmarks/workload.py's 8 groups of 8, one request per
  group (rows in full, or each prompt once), all at once. Target: cache on <= 2 % slower than off.

Per scenario and variant (the cache on: one engine; off: another, built with prefix_cache=False, so
that nothing of the cache runs): wall ms (median of --reps rounds after a warm-up round; the cache
flushed before every round, so each round computes what one training step would), tokens computed
(the server's logprobd_computed_tokens_total over the round) against the unique tokens (a trie over
the sequences) and the cached tokens the answers report, and the unique-token FLOP floor at the
measured matmul rate as a share of the wall time. The result file starts with its provenance
(benchmarks/harness.py).
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import torch

from benchmarks.client import Ranks
from benchmarks.harness import RESULTS, active_params, packed_model, run_models
from benchmarks.server import HttpServer, http_bodies
from benchmarks.shapes import SHAPES
from benchmarks.workload import Sample, grpo_groups, grpo_long, unique_floor_flops, unique_tokens
from service.engine.config import BATCH_TOKENS
from service.engine.loading.pretrained import LoadedModel
from service.engine.scorer.engine import PackedScorer
from service.settings import Settings

ADMIN = "bench-admin"
START_DELAY_S = 0.05  # from the parent's "go" to the round's start: every rank is waiting by then
TARGETS = {  # scenario -> (most computed / unique, least share of the unique-token floor)
    "split-grpo": (1.05, 0.70),
    "trajectories": (1.10, 0.65),
    "teacher": (1.10, None),
}


@dataclass(frozen=True, slots=True)
class Scenario:
    """Each rank's calls (route, JSON body), in order; the sequences they hold; whether ranks start
    0-100 ms apart."""

    ranks: list[list[tuple[str, dict[str, Any]]]]
    samples: list[Sample]
    jitter: bool = True


def _scaled(n: int, scale: float) -> int:
    return max(2, round(n * scale))


def split_grpo(vocab: int, scale: float) -> Scenario:
    low, high = _scaled(2048, scale), _scaled(4096, scale)
    samples = grpo_groups(vocab, prompts=8, responses=8, prompt_range=(low, high), response_mean=250 * scale,
                          response_clip=(_scaled(16, scale), _scaled(1024, scale)))  # fmt: skip
    ranks = []
    for i in range(8):
        rows = [samples[g * 8 + i] for g in range(8)]
        body = {"input_ids": [s.tokens for s in rows], "num_actions": [len(s.response) for s in rows]}
        ranks.append([("/logprobs", body)])
    return Scenario(ranks, samples)


def trajectories(vocab: int, scale: float) -> Scenario:
    rng = np.random.default_rng(52)
    ranks, samples = [], []
    for _ in range(8):
        context = rng.integers(0, vocab, _scaled(8192, scale)).tolist()
        calls = []
        for _ in range(6):
            new = int(rng.integers(_scaled(500, scale), _scaled(2000, scale) + 1))
            answer = new - new // 3  # after a tool result of a third of the new tokens
            context = context + rng.integers(0, vocab, new).tolist()
            samples.append(Sample(prompt=context[:-answer], response=context[-answer:]))
            calls.append(("/logprobs", {"input_ids": [list(context)], "num_actions": answer}))
        ranks.append(calls)
    return Scenario(ranks, samples)


def teacher(vocab: int, scale: float) -> Scenario:
    rng = np.random.default_rng(53)
    system = rng.integers(0, vocab, _scaled(3072, scale)).tolist()
    ranks, samples = [], []
    for _ in range(8):
        calls = []
        for _ in range(8):
            prompt = system + rng.integers(0, vocab, _scaled(1024, scale)).tolist()
            samples.append(Sample(prompt=prompt[:1], response=prompt[1:]))  # every position scored
            body = {"model": "bench", "prompt": [prompt], "max_tokens": 0, "prompt_logprobs": 1}
            calls.append(("/v1/completions", body))
        ranks.append(calls)
    return Scenario(ranks, samples)


def grpo_workload(grouped: bool) -> Callable[[int, float], Scenario]:
    def build(vocab: int, scale: float) -> Scenario:
        samples = grpo_long(vocab, scale)
        bodies = http_bodies(samples, frames=False, grouped=grouped)
        return Scenario([[("/logprobs", orjson.loads(b))] for b in bodies], samples, jitter=False)

    return build


SCENARIOS: dict[str, Callable[[int, float], Scenario]] = {
    "split-grpo": split_grpo,
    "trajectories": trajectories,
    "teacher": teacher,
    "grpo-long": grpo_workload(grouped=False),
    "grpo-long-grouped": grpo_workload(grouped=True),
}


def computed_total(url: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("logprobd_computed_tokens_total "):
            return float(line.split()[1])
    return 0.0


def rounds(url: str, scenario: Scenario, reps: int, seed: int, ranks: Ranks) -> list[dict[str, float]]:
    """Each round after a warm-up: the cache flushed, the ranks' calls from one instant (each rank a
    random 0-100 ms later where the scenario jitters), its wall seconds, computed and cached tokens."""
    ranks.load(url, scenario.ranks)
    rng = random.Random(seed)
    out = []
    for _ in range(reps + 1):  # the first round warms up
        flushed = httpx.post(f"{url}/flush_cache", headers={"authorization": f"Bearer {ADMIN}"})
        flushed.raise_for_status()
        before = computed_total(url)
        start = time.perf_counter() + START_DELAY_S
        delays = [rng.uniform(0.0, 0.1) if scenario.jitter else 0.0 for _ in scenario.ranks]
        ends = ranks.round(start, delays)
        seconds = max(end for end, _ in ends) - start
        time.sleep(0.05)  # the last micro-batch's metrics are counted as it is collected
        out.append(
            {
                "seconds": seconds,
                "computed": computed_total(url) - before,
                "cached": float(sum(c for _, c in ends)),
            }
        )
    return out[1:]


def engine_for(
    name: str, args: argparse.Namespace, device: torch.device, settings: Settings
) -> tuple[PackedScorer, int]:
    """A warmed-up engine over a fresh model of `name`'s shape, and the model's active parameters."""
    backend, _, model = packed_model(dict(SHAPES[name]), getattr(torch, args.dtype), device, args.attention)
    params = active_params(model)
    engine = PackedScorer(LoadedModel(model, "bench", demo=False), device, backend, settings.engine_config())
    engine.warm_up()
    return engine, params


def bench_model(name: str, args: argparse.Namespace, device: torch.device, rate: float) -> dict[str, Any]:
    vocab = int(SHAPES[name]["vocab_size"])
    scenarios = {s: SCENARIOS[s](vocab, args.scale) for s in args.scenarios}
    results: dict[str, Any] = {
        s: {"sequences": len(sc.samples), "unique_tokens": unique_tokens(sc.samples), "variants": {}}
        for s, sc in scenarios.items()
    }
    # the ranks, spawned once for every scenario and both variants
    with Ranks(max(len(sc.ranks) for sc in scenarios.values())) as ranks:
        for variant, on in (("cache_on", True), ("cache_off", False)):
            settings = Settings(
                device=device.type,
                dtype=args.dtype,
                max_batch_tokens=args.max_batch_tokens,
                prefix_cache=on,
                admin_api_keys=ADMIN,
            )
            engine, params = engine_for(name, args, device, settings)
            for s, scenario in scenarios.items():
                floor = unique_floor_flops(SHAPES[name], params, scenario.samples)
                results[s]["floor_ms"] = floor / rate * 1e3
            print(f"  {name} {variant}: prefix cache {engine.info.prefix_cache_tokens} tokens", flush=True)
            with HttpServer(engine, settings) as url:
                for k, (s, scenario) in enumerate(scenarios.items()):
                    measured = rounds(url, scenario, args.reps, k, ranks)
                    r = results[s]
                    seconds = statistics.median(m["seconds"] for m in measured)
                    computed = statistics.median(m["computed"] for m in measured)
                    r["variants"][variant] = {
                        "ms": seconds * 1e3,
                        "computed_tokens": computed,
                        "cached_tokens": statistics.median(m["cached"] for m in measured),
                        "computed_per_unique": computed / r["unique_tokens"],
                        "unique_floor_fraction": r["floor_ms"] / 1e3 / seconds,
                        "rounds_ms": [round(m["seconds"] * 1e3, 1) for m in measured],
                    }
                    print(f"  {name} {s} {variant}: {r['variants'][variant]}", flush=True)
            del engine
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    for r in results.values():
        v = r["variants"]
        if "cache_on" in v and "cache_off" in v:
            r["slowdown_cache_on"] = v["cache_on"]["ms"] / v["cache_off"]["ms"] - 1.0
    return {"scenarios": results}


def table(results: dict[str, Any]) -> str:
    lines = [
        "| model | scenario | variant | ms | computed / unique | cached tokens | unique floor | target |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for name, m in results["models"].items():
        for s, r in m["scenarios"].items():
            for variant, v in r["variants"].items():
                target = TARGETS.get(s)
                want = ""
                if variant == "cache_on" and target is not None:
                    most, least = target
                    ok = v["computed_per_unique"] <= most and (
                        least is None or v["unique_floor_fraction"] >= least
                    )
                    want = (
                        f"<= {most}x" + (f", >= {least:.0%}" if least else "") + (" ok" if ok else " MISSED")
                    )
                if variant == "cache_on" and s.startswith("grpo-long") and "slowdown_cache_on" in r:
                    slower = r["slowdown_cache_on"]
                    want = f"{slower:+.1%} vs off (<= +2 %)" + (" ok" if slower <= 0.02 else " MISSED")
                lines.append(
                    f"| {name} | {s} | {variant} | {v['ms']:.1f} | {v['computed_per_unique']:.3f}x | "
                    f"{v['cached_tokens']:,.0f} | {v['unique_floor_fraction']:.1%} | {want} |"
                )
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    """The command line (tests/benchmarks/test_page.py parses each cited command with it)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.prefix_cache", description=__doc__)
    parser.add_argument("--models", nargs="+", default=["qwen2.5-7b"])
    parser.add_argument("--scenarios", nargs="+", choices=list(SCENARIOS), default=list(SCENARIOS))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--attention", default="auto")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-batch-tokens", type=int, default=BATCH_TOKENS)
    parser.add_argument("--scale", type=float, default=1.0, help="every length x this (a CPU smoke test)")
    parser.add_argument("--output", type=Path, default=RESULTS / "prefix-cache-latest.json")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    results = run_models("prefix_cache", args, argv, bench_model)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

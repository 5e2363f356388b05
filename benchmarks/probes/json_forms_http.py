"""The JSON forms over HTTP on the host (no GPU): the server's CPU per round, and the round's wall time.

    python -m benchmarks.probes.json_forms_http [--parts routes distributions] [--k 100] [--reps 3]

The real app under uvicorn on loopback (benchmarks.run.HttpServer) serving an instant engine
(benchmarks.probes.host_path.InstantEngine: scores at once; here with Qwen3-30B-A3B's 48 sparse layers,
128 experts, top-8, recording a route at every position), the round's 8 requests sent at once by
benchmarks/client.py: JSON forms from 8 plain-client processes (`plain-processes`: httpx `json=`,
`response.json()`, base64 blocks then decoded as docs/api.md shows), frames from logprobd's
transport in one process (`asyncio`, as benchmarks.replay and benchmarks.distribution send them).

- routes (the standard workload, as benchmarks/probes/json_forms.py): `live_json`, `replay_<form>`,
  `record_<form>` for the JSON forms base64 and lists, and `live_frames`, `replay_frames`,
  `record_frames`;
- distributions (GRPO 8 x 8): `plain_json`, `top<K>_lists`, `top<K>_base64`, and `plain_frames`,
  `top<K>_frames`.

Per variant: `server_cpu_ms`, the CPU time of this process (uvicorn's loop, the worker threads that
parse and write, the batcher's) per round, warm-up included: steady on a shared machine; `ms`, the
median round's wall time, which on a small machine also holds the clients' CPU. On the GPU the
engine's time comes on top; benchmarks.replay / benchmarks.distribution --json-forms measure that.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from typing import Any

import numpy as np
import orjson

from benchmarks.probes.host_path import InstantEngine
from benchmarks.probes.json_forms import VOCAB, b64, groups, plain_body
from benchmarks.probes.routes_host import MOE, routes
from benchmarks.server import HttpServer, http_rounds
from benchmarks.workload import grpo_short, host_info, workload
from service.client.wire import to_frame
from service.core.jobs import SequenceJob, SequenceScores
from service.settings import Settings


class RoutedEngine(InstantEngine):
    """InstantEngine with sparse layers: a job that asks records routes drawn once (the first L)."""

    def __init__(self) -> None:
        super().__init__(VOCAB)
        self.info = host_info(VOCAB, MOE)
        self.recorded = routes(4096, np.random.default_rng(7))

    def _scores(self, job: SequenceJob, actions: int) -> SequenceScores:
        scores = super()._scores(job, actions)
        if not job.return_routes:
            return scores
        return dataclasses.replace(scores, routes=self.recorded[: job.num_tokens])


def route_bodies() -> dict[str, tuple[list[bytes], bool]]:
    """Each routes variant's bodies and whether they are frames."""
    batches = groups(workload(VOCAB, sequences=64))
    rng = np.random.default_rng(0)
    given = [[routes(len(s.tokens), rng) for s in g] for g in batches]
    plain = [plain_body(g) for g in batches]
    out: dict[str, tuple[list[bytes], bool]] = {"live_json": ([orjson.dumps(b) for b in plain], False)}
    for form in ("base64", "lists"):
        sent = [[b64(r, "<i4") if form == "base64" else r.tolist() for r in g] for g in given]
        replay = [orjson.dumps({**b, "routed_experts": s}) for b, s in zip(plain, sent, strict=True)]
        out[f"replay_{form}"] = (replay, False)
        asked = {"return_routed_experts": True, "routed_experts_format": form}
        out[f"record_{form}"] = ([orjson.dumps({**b, **asked}) for b in plain], False)
    frames = {
        "live_frames": plain,
        "replay_frames": [{**b, "routed_experts": g} for b, g in zip(plain, given, strict=True)],
        "record_frames": [{**b, "return_routed_experts": True} for b in plain],
    }
    for name, bodies in frames.items():
        out[name] = ([f for f in map(to_frame, bodies) if f is not None], True)
    return out


def distribution_bodies(k: int) -> dict[str, tuple[list[bytes], bool]]:
    plain = [plain_body(g) for g in groups(grpo_short(VOCAB))]
    top = [{**b, "top_logprobs": k} for b in plain]
    out: dict[str, tuple[list[bytes], bool]] = {
        "plain_json": ([orjson.dumps(b) for b in plain], False),
        f"top{k}_lists": ([orjson.dumps(b) for b in top], False),
        f"top{k}_base64": ([orjson.dumps({**b, "distribution_format": "base64"}) for b in top], False),
    }
    for name, bodies in (("plain_frames", plain), (f"top{k}_frames", top)):
        out[name] = ([f for f in map(to_frame, bodies) if f is not None], True)
    return out


def rounds(engine: InstantEngine, variants: dict[str, tuple[list[bytes], bool]], reps: int) -> dict[str, Any]:
    settings = Settings(device="cpu", max_top_logprobs=1024, max_body_bytes=1 << 30)
    out: dict[str, Any] = {}
    with HttpServer(engine, settings) as url:  # type: ignore[arg-type]
        for name, (bodies, framed) in variants.items():
            cpu = time.process_time()
            seconds = http_rounds(url, bodies, reps, "asyncio" if framed else "plain-processes", framed)
            cpu = time.process_time() - cpu
            out[name] = {
                "server_cpu_ms": round(cpu / (reps + 1) * 1e3, 1),
                "ms": round(statistics.median(seconds) * 1e3, 1),
                "request_mb": round(sum(map(len, bodies)) / 1e6, 1),
            }
            print(name, out[name], file=sys.stderr, flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.probes.json_forms_http", description=__doc__)
    parser.add_argument(
        "--parts", nargs="+", choices=["routes", "distributions"], default=["routes", "distributions"]
    )
    parser.add_argument("--k", type=int, nargs="+", default=[100])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    results: dict[str, Any] = {}
    if "routes" in args.parts:
        results["routes"] = rounds(RoutedEngine(), route_bodies(), args.reps)
    if "distributions" in args.parts:
        for k in args.k:
            results[f"top_logprobs_{k}"] = rounds(InstantEngine(VOCAB), distribution_bodies(k), args.reps)
    print(orjson.dumps(results, option=orjson.OPT_INDENT_2).decode())
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What routing replay (R3) and recorded routes (R2) cost over live routing (issue: score the routes
the rollout took).

    python -m benchmarks.replay                      # Qwen3-30B-A3B, 48 layers; results/replay-latest.json
    python -m benchmarks.replay --json-forms base64 lists   # and the JSON forms, from a plain client
    python -m benchmarks.replay --models tiny-moe --device cpu --dtype float32 --sequences 8 --reps 1

One engine (random bf16 weights with the real shapes, benchmarks/shapes.py's MOE_SHAPES), the real app on
loopback, the standard workload (workload.py) in 8 requests from 8 client processes, compact frames:

- live: plain requests;
- record (R2): the same with `return_routed_experts` (every position's experts come back, u1 in frames);
- replay (R3): the same with `routed_experts`: the routes the record pass returned, sent back (u1),
  so the replayed scores must equal the live ones and the agreement must be 1.0 (both checked).

With `--json-forms base64 lists`, the same rounds as JSON from a plain client (`--json-client`:
plain-processes, a process per request as trainer ranks are, or plain, one process; httpx's `json=`
and `response.json()`, benchmarks/client.py): `live_json` plain requests; `record_<form>` with
`return_routed_experts` and `routed_experts_format` <form>; `replay_<form>` with the recorded routes
as SGLang's base64 strings (`base64`) or nested lists (`lists`), each checked once to give the live
scores with agreement 1.0. Their cost is over `live_json`.

Each: the median round's ms after a warm-up round and its cost over live. `route_bytes_per_entry`:
the frames' extra request bytes over the plain frames, per (position, layer, slot) sent. The
benchmark's own objects (the bodies, the routes as lists) are frozen out of the garbage collector's
way before the rounds (benchmarks/server.py's freeze_client_data): the server runs in this process,
and a server's clients are other processes.

With `--timeline PATH`, the server's side of each variant's last round goes there (JSON, per variant:
[what, start ms, end ms] from the round's first request's arrival, benchmarks/probes/overhead.py's
events): each request's `headers` and `body` (its last part read), `parse`, `normalise`, `render`,
each part of an answer handed to uvicorn (`sent`), and each micro-batch's `launch` and `collected`
(the wait for its scores); each JSON variant's figures then split its last round into
`server_span_ms` (the first headers to the last part sent) and `outside_server_ms` (the plain
clients' encoding before it, their reading and parsing after; from the clients' own times,
`encode_ms_max`, the longest any took to encode its body, and of the request that ended the round,
`last_read_after_sent_ms` and `last_parse_ms`).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

import httpx
import numpy as np
import orjson
import torch

from benchmarks.harness import CACHE_IN_ROUNDS, RESULTS, active_params, packed_model, run_models
from benchmarks.probes.overhead import Timelines, split_text
from benchmarks.server import HttpServer, freeze_client_data, http_rounds
from benchmarks.shapes import MOE_SHAPES, floor_shape
from benchmarks.workload import Sample, floor_flops, workload
from service.client.routed_experts import encode
from service.client.wire import from_frame, to_frame
from service.engine.loading.pretrained import LoadedModel
from service.engine.scorer.engine import PackedScorer
from service.settings import CudaGraphs, Settings
from service.wire.frame import MEDIA_TYPE

CLIENTS = 8
FRAME_HEADERS = {"content-type": MEDIA_TYPE, "accept": MEDIA_TYPE}
JSON_FORMS = ("base64", "lists")


def plain_bodies(samples: list[Sample]) -> list[dict[str, Any]]:
    per = max(1, len(samples) // CLIENTS)
    return [
        {"input_ids": [s.tokens for s in g], "num_actions": [len(s.response) for s in g]}
        for g in (samples[i : i + per] for i in range(0, len(samples), per))
    ]


def framed(bodies: list[dict[str, Any]]) -> list[bytes]:
    out = [to_frame(b) for b in bodies]
    assert all(f is not None for f in out)
    return [f for f in out if f is not None]


def recorded(url: str, bodies: list[dict[str, Any]]) -> tuple[list[list[np.ndarray]], list[list[np.ndarray]]]:
    """Each body's rows' recorded routes [L, layers, k] and log-probs, asked once in frames."""
    routes, scores = [], []
    with httpx.Client(base_url=url, timeout=600) as client:
        for body in bodies:
            reply = client.post(
                "/logprobs", content=to_frame({**body, "return_routed_experts": True}), headers=FRAME_HEADERS
            )
            reply.raise_for_status()
            answer = from_frame(reply.content)
            moe = answer["moe"]
            shape = (-1, int(moe["layers"]), int(moe["top_k"]))
            routes.append([np.asarray(r, dtype=np.int64).reshape(shape) for r in answer["routed_experts"]])
            scores.append([np.asarray(r, dtype=np.float64) for r in answer["logprobs"]])
    return routes, scores


def replayed(
    url: str, bodies: list[dict[str, Any]], framed: bool = True
) -> tuple[list[list[np.ndarray]], list[float]]:
    """Each body's log-probs and exact-agreement fractions when its routes are replayed (sent as a
    frame, or as JSON)."""
    scores, agreement = [], []
    with httpx.Client(base_url=url, timeout=600) as client:
        for body in bodies:
            if framed:
                reply = client.post("/logprobs", content=to_frame(body), headers=FRAME_HEADERS)
            else:
                reply = client.post("/logprobs", json=body)
            if reply.status_code != 200:
                raise RuntimeError(reply.text)
            answer = from_frame(reply.content) if framed else reply.json()
            scores.append([np.asarray(r, dtype=np.float64) for r in answer["logprobs"]])
            agreement.append(float(answer["route_agreement"]["exact_fraction"]))
    return scores, agreement


def bench_model(name: str, args: argparse.Namespace, device: torch.device, rate: float) -> dict[str, Any]:
    shape = dict(MOE_SHAPES[name])
    dtype = getattr(torch, args.dtype)
    backend, _, model = packed_model(shape, dtype, device, args.attention)
    samples = workload(int(shape["vocab_size"]), sequences=args.sequences)
    tokens = sum(len(s.tokens) for s in samples)
    floor_s = floor_flops(floor_shape(shape), active_params(model), samples) / rate
    settings = Settings(
        device=device.type,
        dtype=args.dtype,
        cuda_graphs=args.cuda_graphs,
        decoder="fused",
        prefix_cache=CACHE_IN_ROUNDS,
    )
    engine = PackedScorer(LoadedModel(model, name, demo=False), device, backend, settings.engine_config())
    started = time.perf_counter()
    engine.warm_up()
    print(f"  {name}: warm-up {time.perf_counter() - started:.1f} s", flush=True)
    plain = plain_bodies(samples)
    variants: dict[str, dict[str, Any]] = {}
    timeline = Timelines(args.timeline)
    with timeline.recording(engine), HttpServer(engine, settings) as url:
        routes, live_scores = recorded(url, plain)
        replay = [
            {**body, "routed_experts": [r.tolist() for r in rs]}
            for body, rs in zip(plain, routes, strict=True)
        ]
        replay_scores, agreement = replayed(url, replay)
        diff = max(
            float(np.max(np.abs(a - b)))
            for got, want in zip(replay_scores, live_scores, strict=True)
            for a, b in zip(got, want, strict=True)
        )
        wire = {
            "live": framed(plain),
            "record": framed([{**b, "return_routed_experts": True} for b in plain]),
            "replay": framed(replay),
        }
        entries = sum(r.size for rs in routes for r in rs)
        freeze_client_data()
        for variant, bodies in wire.items():
            timeline.start()
            variants[variant] = timed(http_rounds(url, bodies, args.reps), bodies, floor_s)
            timeline.take(variant, len(bodies))
            print(f"  {name} {variant:>7}: {variants[variant]['ms']:9.1f} ms", flush=True)
        if args.json_forms:
            frames_check = RouteCheck(min(agreement), diff)
            json_rounds(url, plain, routes, live_scores, frames_check, args, floor_s, variants, timeline)
    for v in variants.values():
        v["cost_over_live"] = v["ms"] / variants[v.pop("over", "live")]["ms"] - 1
    return {
        "moe_kernel": engine.info.moe_kernel,
        "max_batch_tokens": engine.info.max_batch_tokens,
        "tokens": tokens,
        "floor_ms": floor_s * 1e3,
        "route_entries": entries,
        "route_bytes_per_entry": (variants["replay"]["request_bytes"] - variants["live"]["request_bytes"])
        / entries,
        "replay_vs_live_max_abs_diff": diff,
        "replay_exact_agreement_min": min(agreement),
        "variants": variants,
    }


def json_rounds(  # noqa: PLR0917
    url: str,
    plain: list[dict[str, Any]],
    routes: list[list[np.ndarray]],
    live_scores: list[list[np.ndarray]],
    frames_check: RouteCheck,
    args: argparse.Namespace,
    floor_s: float,
    variants: dict[str, dict[str, Any]],
    timeline: Timelines,
) -> None:
    """The JSON forms' rounds from a plain client, into `variants` (each over `live_json`); every
    replay checked once against the live scores, held to what the same routes replayed from a frame
    gave (`frames_check`): exact in float32, and in bf16 within the drift that scoring the sequences in
    other micro-batches leaves (a near-tie of the live router's flips, a few hundredths of a log-prob)."""
    bodies: dict[str, list[dict[str, Any]]] = {"live_json": plain}
    for form in args.json_forms:
        asked = {"return_routed_experts": True, "routed_experts_format": form}
        bodies[f"record_{form}"] = [{**b, **asked} for b in plain]
        sent = [encode(rs) if form == "base64" else [r.tolist() for r in rs] for rs in routes]
        bodies[f"replay_{form}"] = [{**b, "routed_experts": s} for b, s in zip(plain, sent, strict=True)]
        scores, agreement = replayed(url, bodies[f"replay_{form}"], framed=False)
        diff = max(
            float(np.max(np.abs(a - b)))
            for got, want in zip(scores, live_scores, strict=True)
            for a, b in zip(got, want, strict=True)
        )
        if not frames_check.holds(RouteCheck(min(agreement), diff)):
            raise RuntimeError(
                f"replay_{form}: agreement {min(agreement)}, max |live - replayed| {diff}; from a frame "
                f"{frames_check.agreement}, {frames_check.max_abs_diff}"
            )
    freeze_client_data()
    for variant, sent_bodies in bodies.items():
        raw = [orjson.dumps(b) for b in sent_bodies]
        rounds, split = timeline.json_rounds(variant, url, raw, args.reps, args.json_client)
        variants[variant] = timed(rounds, raw, floor_s) | {"over": "live_json"} | split
        print(f"  {variant:>14}: {variants[variant]['ms']:9.1f} ms{split_text(split)}", flush=True)


@dataclass(frozen=True, slots=True)
class RouteCheck:
    """A replay against the live scores: the least exact-route fraction of a request, and the largest
    |live - replayed| log-prob."""

    agreement: float
    max_abs_diff: float

    def holds(self, other: RouteCheck) -> bool:
        """`other` (the same routes, another wire form) as good as this, up to numeric drift."""
        close = other.max_abs_diff <= max(1e-3, 2 * self.max_abs_diff)
        return other.agreement >= self.agreement - 0.01 and close


def timed(rounds: list[float], bodies: list[bytes], floor_s: float) -> dict[str, Any]:
    """A variant's figures from its rounds' seconds."""
    ms = statistics.median(rounds) * 1e3
    return {
        "ms": ms,
        "rounds_ms": [round(r * 1e3, 1) for r in rounds],
        "floor_fraction": floor_s * 1e3 / ms,
        "request_bytes": sum(map(len, bodies)),
    }


def table(results: dict[str, Any]) -> str:
    lines = [
        "| model | variant | ms | of the floor | cost over live (JSON: over live_json) |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for name, m in results["models"].items():
        for variant, v in m["variants"].items():
            lines.append(
                f"| {name} | {variant} | {v['ms']:.1f} | {v['floor_fraction']:.1%} | "
                f"{v['cost_over_live']:+.1%} |"
            )
    lines.append("")
    for name, m in results["models"].items():
        lines.append(
            f"- {name}: route bytes per (position, layer, slot) in frames {m['route_bytes_per_entry']:.3f}; "
            f"replayed vs live max |Δ| {m['replay_vs_live_max_abs_diff']:.3g}; "
            f"lowest exact agreement {m['replay_exact_agreement_min']:.4f}"
        )
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    """The command line (tests/benchmarks/test_page.py parses each cited command with it)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.replay", description=__doc__)
    parser.add_argument("--models", nargs="+", default=["qwen3-30b-a3b"], choices=list(MOE_SHAPES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--attention", default="auto")
    parser.add_argument("--cuda-graphs", default="auto", choices=get_args(CudaGraphs))
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--json-forms", nargs="*", default=[], choices=JSON_FORMS, help="also these JSON forms (plain client)"
    )
    parser.add_argument(
        "--json-client",
        default="plain-processes",
        choices=["plain-processes", "plain"],
        help="the JSON rounds' client (benchmarks/client.py's modes)",
    )
    parser.add_argument("--output", type=Path, default=RESULTS / "replay-latest.json")
    parser.add_argument("--timeline", type=Path, help="the server's side of each variant's last round (JSON)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("service.engine.scorer.engine").setLevel(logging.INFO)  # the routed graphs' check
    results = run_models("replay", args, argv, bench_model)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

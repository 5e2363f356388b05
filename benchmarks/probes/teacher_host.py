"""The host side of TRL's teacher call on the CPU, the engine's compute taken away: where it goes.

    python -m benchmarks.probes.teacher_host [--prompts 8] [--tokens 4096] [--k 100] [--reps 3]
                                             [--clients subprocess in_process] [--no-stages]
                                             [--no-http] [--device-ms 0] [--whole]

The call is benchmarks.client's `teacher_call` (benchmarks.distribution's), as TRL's
VLLMClient.get_sequence_logprobs makes it (trl/generation/vllm_client.py): one POST /v1/completions
with 8 token-id prompts of 4,096 tokens, `max_tokens: 1`, `temperature: 1.0`, `prompt_logprobs: 100`,
vocabulary 151,936 (Qwen2.5's), no tokenizer (every decoded_token null, as benchmarks.distribution
serves a random-weight model: no answer shows the drawn token, so none is drawn, plan.py).

In this process, each server-side stage alone (median of --reps, ms):

- client_encode: httpx's `json=` encoding of the body (json.dumps, compact, not ASCII-only);
- parse: the route's parse_body into a CompletionRequest; plan: plan_completion;
- collect: InFlight.result of the call's micro-batch, the engine's split of its host copies per job
  (benchmarks.probes.host_path.InstantEngine: PackedScorer's host tensors, ready at once);
- render: response.completion_chunks, the answer's bytes (render_1thread: on one thread);
- client_parse: the client's json.loads of the answer (TRL's own, outside teacher_call's time).

Then over HTTP: the real app under uvicorn on loopback (benchmarks.server.HttpServer) serving
InstantEngine, the call made exactly as benchmarks.client's teacher_call makes it (a fresh
httpx.Client, `client.post(..., json=body)`, `reply.content`), after one warm-up call, from
`subprocess` (a client process, as a trainer is) and `in_process` (the main thread of the server's
process, as benchmarks.distribution makes it): `ms` to the last byte (median; `min_ms` the best,
less disturbed by other work on a shared machine) and `headers_ms` to the status line (an httpx
response hook).

With `--device-ms MS` each micro-batch's scores are ready MS after the simulated device, which runs
one micro-batch at a time, is free (the call's 32,768 tokens are 2 micro-batches of the default
16,384-token budget, as on the GPU), so the call's time shows how much of the answer's writing and
transfer overlaps the compute: the answer goes a choice at a time (completions/stream.py) as each
micro-batch is collected. `--whole` sends it whole after every prompt's scores, the way it went
before (the baseline).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import orjson

from benchmarks.client import teacher_calls
from benchmarks.probes.host_path import VOCAB, InstantEngine, median_ms
from benchmarks.server import HttpServer
from benchmarks.workload import teacher_prompts
from service.http.completions import response, stream
from service.http.completions.pieces import TokenPieces
from service.http.completions.plan import plan_completion
from service.http.completions.response import Drawn, completion_chunks
from service.http.completions.schemas import CompletionRequest
from service.normalise import ModelLimits
from service.settings import Settings
from service.wire.schemas import parse_body

MAX_K = 1000


def teacher_body(prompts: int, tokens: int, k: int, model: str, seed: int = 13) -> dict[str, Any]:
    """teacher_call's body over benchmarks.workload's teacher_prompts (random ids, seed 13)."""
    return {
        "model": model,
        "prompt": teacher_prompts(VOCAB, tokens, prompts, seed),
        "max_tokens": 1,
        "temperature": 1.0,
        "prompt_logprobs": k,
    }


def stages(body: dict[str, Any], reps: int) -> dict[str, float]:
    """Each stage's median ms in this process, and the answer's size."""
    engine = InstantEngine()
    limits = ModelLimits(vocab_size=VOCAB, max_sequence_tokens=32_768, max_top_logprobs=MAX_K)
    raw = orjson.dumps(body)
    request = parse_body(CompletionRequest, raw)
    plan = plan_completion(request, limits, engine.info.model, MAX_K, shows_text=False)
    launched = engine.launch(plan.jobs)
    scores = launched.result()
    pieces = TokenPieces.build(None, VOCAB)
    drawn: list[Drawn | None] = [None] * len(scores)  # shown by no answer here: not drawn

    def render() -> list[bytes]:
        return completion_chunks(
            plan,
            scores,
            drawn,
            model=engine.info.model,
            token_text=None,
            pieces=pieces,
            request_id="cmpl-bench",
            created=0,
        )

    chunks = render()
    answer = b"".join(chunks)
    figures = {
        "client_encode": median_ms(
            lambda: json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode(),
            reps,
        ),
        "parse": median_ms(lambda: parse_body(CompletionRequest, raw), reps),
        "plan": median_ms(
            lambda: plan_completion(request, limits, engine.info.model, MAX_K, shows_text=False), reps
        ),
        "collect": median_ms(launched.result, reps),
        "render": median_ms(render, reps),
    }
    threads = response.RENDER_THREADS
    response.RENDER_THREADS = 1
    try:
        figures["render_1thread"] = median_ms(render, reps)
    finally:
        response.RENDER_THREADS = threads
    figures["client_parse"] = median_ms(lambda: json.loads(answer), 1)
    figures["answer_mb"] = len(answer) / 1e6
    figures["chunks"] = len(chunks)
    return figures


def http(body: dict[str, Any], reps: int, clients: list[str], device_ms: float = 0.0) -> dict[str, Any]:
    """The call over HTTP from each client, against the app serving InstantEngine."""
    settings = Settings(device="cpu", max_top_logprobs=MAX_K)
    out: dict[str, Any] = {}
    engine = InstantEngine(device_ms=device_ms)
    with HttpServer(engine, settings) as url, tempfile.TemporaryDirectory() as tmp:  # type: ignore[arg-type]
        path = Path(tmp) / "body.json"
        path.write_bytes(orjson.dumps(body))
        for client in clients:
            if client == "subprocess":
                cmd = [
                    sys.executable,
                    "-m",
                    "benchmarks.client",
                    url,
                    str(path),
                    str(reps),
                    "--mode",
                    "teacher",
                ]
                done = subprocess.run(cmd, capture_output=True, text=True, check=True)
                out[client] = json.loads(done.stdout)
            else:
                out[client] = teacher_calls(url, body, reps)
            print(f"  {client}: {out[client]['ms']:.1f} ms", file=sys.stderr, flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.probes.teacher_host", description=__doc__)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--k", type=int, default=100)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--clients", nargs="+", choices=["subprocess", "in_process"], default=["subprocess", "in_process"]
    )
    parser.add_argument(
        "--render-threads", type=int, default=response.RENDER_THREADS, help="the writer's pool (the server's)"
    )
    parser.add_argument(
        "--device-ms", type=float, default=0.0, help="the simulated device's ms per micro-batch (HTTP)"
    )
    parser.add_argument(
        "--whole", action="store_true", help="every answer sent whole, after all its scores (the baseline)"
    )
    parser.add_argument("--no-stages", action="store_true", help="over HTTP only")
    parser.add_argument("--no-http", action="store_true", help="the in-process stages only")
    args = parser.parse_args(argv)
    response.RENDER_THREADS = args.render_threads
    if args.whole:
        stream.STREAM_CHUNKS = sys.maxsize
    body = teacher_body(args.prompts, args.tokens, args.k, InstantEngine().info.model)
    results: dict[str, Any] = {
        "shape": f"{args.prompts} x {args.tokens} tokens, K={args.k}, vocab {VOCAB}",
        "render_threads": args.render_threads,
        "device_ms_per_micro_batch": args.device_ms,
        "answer": "whole" if args.whole else "per choice where large (stream.streams)",
    }
    if not args.no_stages:
        results["stages_ms"] = stages(body, args.reps)
    if not args.no_http:
        results["http"] = http(body, args.reps, args.clients, args.device_ms)
    print(orjson.dumps(results, option=orjson.OPT_INDENT_2).decode(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

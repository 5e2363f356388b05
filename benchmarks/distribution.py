"""What the distribution's extras cost (issue: top-K distributions and the completions surface).

    python -m benchmarks.distribution --models qwen2.5-7b   # GPU host; results/distribution-latest.json
    python -m benchmarks.distribution --models qwen2.5-7b --json-forms lists base64 --teacher-budgets
    python -m benchmarks.distribution --models tiny --device cpu --dtype float32 --scale 0.05 \\
        --teacher-tokens 128 --reps 1                                # CPU smoke test

Per model (random bf16 weights with the real shapes), one engine, the real app on loopback:

- `grpo-short` (8 prompts x 8 responses, one request per group from 8 client processes, compact
  frames, prefix sharing on): plain scoring, then the same requests asking `top_logprobs` 100 and
  1000, and `sampling` {top_k 50, top_p 0.9, min_p 0.05} (processed log-probs). Each: the median
  round's ms after a warm-up round and its cost over plain.
- with `--json-forms lists base64`, the same GRPO rounds as JSON from a plain client (`--json-client`:
  plain-processes, a process per request, or plain, one process; httpx's `json=` and
  `response.json()`, benchmarks/client.py): `<variant>_json` the [window, K] blocks as nested lists,
  `<variant>_base64` with `distribution_format: "base64"` (top_logprobs variants; the client decodes
  each row as docs/api.md shows), each over `plain_json`; `--timeline PATH` writes the server's side
  of each one's last round there (benchmarks/probes/overhead.py's last_round, as benchmarks.replay),
  and of the teacher call's last call (`teacher`: its micro-batches, each choice's chunks, the sends);
  each variant's last round is then split into `server_span_ms` and `outside_server_ms` (the plain
  clients' own encoding, reading and parsing; of it, from the clients' own times, the request that
  ended the round: its answer's last byte after the server's last part and its parse,
  `last_read_after_sent_ms`, `last_parse_ms`), the teacher's last call into `client_before_ms`,
  `server_ms` and `client_after_ms` (of it `client_join_ms`: httpx joining the answer's pieces once
  the last byte is in; `join_ms`, the calls' median).
- `teacher`: one TRL-style distillation call, `POST /v1/completions` with 8 token-id prompts of
  --teacher-tokens tokens, `max_tokens: 1`, `prompt_logprobs: 100` (every position's top 100, vLLM's
  form), from a client process as a trainer makes it (benchmarks/client.py --mode teacher), timed
  from the request sent to the answer's last byte received (the client's JSON parse, TRL's own cost,
  is not counted; it is reported apart, from one more call in this process). Its floor counts the
  head over every position (2 · vocab · hidden per position) besides the layers and attention;
  `peak_gib_over_weights` is the device's peak allocation during the calls less the weights.
  `teacher.drawing`: the same call with `logprobs: 1`, whose answer shows the drawn token, so a token
  is drawn after each prompt and its log-prob shown. `teacher.helper`: the same distribution through
  logprobd's helper (service.client.teacher.get_sequence_logprobs: POST /logprobs in compact frames,
  the positions after each prompt's first token), timed to TRL's dict in hand (`--timeline`: the
  server's side of its last call, `helper`); against TRL's call, whose dict comes only after
  `client_parse_ms` more. `teacher.tokenizer`: TRL's call to a server
  whose checkpoint has a tokenizer (a word-level one, `t<id>` for each id, like a BPE piece's
  length): a token drawn after each prompt for `text`, every entry's `decoded_token` a string.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, get_args

import httpx
import orjson
import torch

from benchmarks.harness import CACHE_IN_ROUNDS, RESULTS, active_params, packed_model, run_models
from benchmarks.probes.overhead import Timelines, split_text
from benchmarks.server import HttpServer, histogram_totals, http_rounds
from benchmarks.shapes import SHAPES
from benchmarks.workload import Sample, floor_flops, grpo_short, teacher_prompts, unique_floor_flops
from service.client.wire import to_frame
from service.engine.config import BATCH_TOKENS
from service.engine.loading.pretrained import LoadedModel
from service.engine.scorer.engine import PackedScorer
from service.http.completions.plan import plan_completion
from service.http.completions.schemas import CompletionRequest
from service.normalise import ModelLimits
from service.settings import CudaGraphs, Settings

EXTRAS: dict[str, dict[str, Any]] = {
    "plain": {},
    "top_logprobs_100": {"top_logprobs": 100},
    "top_logprobs_1000": {"top_logprobs": 1000},
    "processed": {"sampling": {"top_k": 50, "top_p": 0.9, "min_p": 0.05}},
}
CLIENTS = 8
FORWARD = "logprobd_forward_duration_seconds"  # the server's histogram of micro-batch forwards
TEACHER_K = 100


def group_bodies(samples: list[Sample], extra: dict[str, Any]) -> list[bytes]:
    """One compact-frame request per GRPO group (8 rows), every response token an action."""
    per = len(samples) // CLIENTS
    bodies = []
    for i in range(0, len(samples), per):
        group = samples[i : i + per]
        body = {
            "input_ids": [s.tokens for s in group],
            "num_actions": [len(s.response) for s in group],
            **extra,
        }
        frame = to_frame(body)
        assert frame is not None
        bodies.append(frame)
    return bodies


def json_group_bodies(samples: list[Sample], extra: dict[str, Any]) -> list[bytes]:
    """group_bodies as JSON."""
    per = len(samples) // CLIENTS
    return [
        orjson.dumps(
            {
                "input_ids": [s.tokens for s in samples[i : i + per]],
                "num_actions": [len(s.response) for s in samples[i : i + per]],
                **extra,
            }
        )
        for i in range(0, len(samples), per)
    ]


def json_variants(variants: list[str], forms: list[str]) -> dict[str, dict[str, Any]]:
    """The JSON rounds: `plain_json`, then each variant in each form (base64: the top_logprobs ones)."""
    out: dict[str, dict[str, Any]] = {"plain_json": {}}
    for variant in variants:
        for form in forms:
            if form == "base64" and "top_logprobs" not in EXTRAS[variant]:
                continue  # nothing in the base64 form
            suffix = "json" if form == "lists" else form
            extra = EXTRAS[variant] | ({"distribution_format": "base64"} if form == "base64" else {})
            if variant != "plain":
                out[f"{variant}_{suffix}"] = extra
    return out


def json_rounds(
    url: str,
    samples: list[Sample],
    args: argparse.Namespace,
    unique_floor_s: float,
    timeline: Timelines,
) -> dict[str, dict[str, Any]]:
    """The GRPO rounds as JSON from a plain client (json_variants), each over `plain_json` (and its
    last round in `timeline`)."""
    out: dict[str, dict[str, Any]] = {}
    for variant, extra in json_variants(args.variants, args.json_forms).items():
        bodies = json_group_bodies(samples, extra)
        rounds, split = timeline.json_rounds(variant, url, bodies, args.reps, args.json_client)
        ms = statistics.median(rounds) * 1e3
        out[variant] = {
            "ms": ms,
            "rounds_ms": [round(r * 1e3, 1) for r in rounds],
            "unique_floor_fraction": unique_floor_s * 1e3 / ms,
            **split,  # the last round's, with --timeline
        }
        print(f"  grpo-short {variant:>24}: {ms:9.1f} ms{split_text(split)}", flush=True)
    for v in out.values():
        v["cost_over_plain_json"] = v["ms"] / out["plain_json"]["ms"] - 1
    return out


OUTSIDE_SERVER = ("client_before_ms", "server_ms", "client_after_ms", "client_read_ms", "client_join_ms")


def teacher_body(model: str, prompts: list[list[int]]) -> dict[str, Any]:
    """The body of TRL's get_sequence_logprobs call."""
    return {
        "model": model,
        "prompt": prompts,
        "max_tokens": 1,
        "temperature": 1.0,
        "prompt_logprobs": TEACHER_K,
    }


def word_tokenizer(vocab: int, directory: Path) -> Path:
    """A tokenizer of `vocab` words `t<id>` saved in `directory` (transformers' fast tokenizer files),
    so that a server reading it from there shows text: every id decodes to its word."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0").save_pretrained(directory)  # type: ignore[no-untyped-call]
    return directory


def in_process_ms(engine: PackedScorer, body: dict[str, Any], name: str, vocab: int, reps: int) -> float:
    """The teacher call's jobs scored in this process one prompt at a time (as the server's
    micro-batches of stream_batch_tokens hold them), no HTTP and no answer: median ms of `reps`."""
    limits = ModelLimits(vocab_size=vocab, max_sequence_tokens=1 << 20, max_top_logprobs=TEACHER_K)
    plan = plan_completion(CompletionRequest.model_validate(body), limits, name, TEACHER_K)
    times = []
    for _ in range(reps + 1):
        began = time.perf_counter()
        for job in plan.jobs:
            engine.score([job])
        times.append(time.perf_counter() - began)
    return statistics.median(times[1:]) * 1e3


def client_calls(url: str, body: dict[str, Any], reps: int, mode: str) -> dict[str, Any]:
    """benchmarks/client.py's `mode` (teacher, helper) over `body` from a client process: its JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "body.json"
        path.write_text(json.dumps(body))
        cmd = [sys.executable, "-m", "benchmarks.client", url, str(path), str(reps), "--mode", mode]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    made: dict[str, Any] = json.loads(out)
    return made


def helper_calls(url: str, body: dict[str, Any], reps: int, timeline: Timelines) -> dict[str, Any]:
    """client_calls' helper mode, the server's side of its last call into `timeline` as "helper"
    (its requests: the call's share of the arrivals)."""
    timeline.start()
    made = client_calls(url, body, reps, "helper")
    if timeline.path is not None:
        timeline.take("helper", sum(e[0] == "headers" for e in timeline.events) // (reps + 1))
    return made


def teacher_calls(
    url: str, body: dict[str, Any], reps: int, device: torch.device, timeline: Timelines | None = None
) -> dict[str, Any]:
    """The call from a client process, as a TRL trainer makes it (benchmarks/client.py --mode teacher:
    a fresh httpx.Client per call, `client.post`, `reply.content`), a warm-up and `reps` timed calls
    (the server's side of the last one into `timeline` as "teacher"); the device's peak allocation
    over them; then one call from this process for the answer's size, its entries and the client-side
    parse time."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = histogram_totals(url, FORWARD)
    if timeline is not None:
        timeline.start()
    timed = client_calls(url, body, reps, "teacher")
    client_side: dict[str, float] = {}
    if timeline is not None:
        client_side = timeline.outside_server(timed["last"])
        timeline.take("teacher", 1)
    after = histogram_totals(url, FORWARD)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    with httpx.Client(base_url=url, timeout=600) as client:
        reply = client.post("/v1/completions", json=body)
    reply.raise_for_status()
    parsing = time.perf_counter()
    answer = json.loads(reply.content)
    parse_s = time.perf_counter() - parsing
    entries = sum(len(p) for c in answer["choices"] for p in c["prompt_logprobs"] if p is not None)
    return {
        "ms": timed["ms"],
        "calls_ms": timed["calls_ms"],
        "headers_ms": timed["headers_ms"],
        "join_ms": timed["join_ms"],  # the client joining the answer's pieces after its last byte
        "bytes": len(reply.content),
        "entries": entries,
        "client_parse_s": parse_s,
        "peak_gib": peak,
        # the batcher's micro-batches over the warm-up and timed calls: how many a call, and the
        # forward's mean ms each (launch to collection)
        **client_side,
        "micro_batches_per_call": (after[0] - before[0]) / (reps + 1),
        "forward_ms_per_micro_batch": (after[1] - before[1]) / max(1.0, after[0] - before[0]) * 1e3,
    }


def bench_model(name: str, args: argparse.Namespace, device: torch.device, rate: float) -> dict[str, Any]:
    dtype = getattr(torch, args.dtype)
    settings = Settings(
        device=device.type,
        dtype=args.dtype,
        cuda_graphs=args.cuda_graphs,
        max_top_logprobs=max(1000, TEACHER_K),
        prefix_cache=CACHE_IN_ROUNDS,
    )
    backend, _, model = packed_model(dict(SHAPES[name]), dtype, device, args.attention)
    shape = SHAPES[name]
    vocab, params = int(shape["vocab_size"]), active_params(model)
    weights_gib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
    engine = PackedScorer(LoadedModel(model, name, demo=False), device, backend, settings.engine_config())
    engine.warm_up()
    samples = grpo_short(vocab, args.scale)
    unique_floor_s = unique_floor_flops(shape, params, samples) / rate
    prompts = teacher_prompts(vocab, args.teacher_tokens)
    teacher_samples = [Sample(prompt=p[:1], response=p[1:]) for p in prompts]  # the head at every position
    teacher_floor_s = floor_flops(shape, params, teacher_samples) / rate
    out: dict[str, Any] = {
        "grpo-short": {"unique_floor_ms": unique_floor_s * 1e3, "variants": {}},
        "teacher": {},
    }
    timeline = Timelines(args.timeline)
    with timeline.recording(engine), HttpServer(engine, settings) as url:
        for variant in args.variants:
            rounds = http_rounds(url, group_bodies(samples, EXTRAS[variant]), args.reps)
            ms = statistics.median(rounds) * 1e3
            out["grpo-short"]["variants"][variant] = {
                "ms": ms,
                "rounds_ms": [round(r * 1e3, 1) for r in rounds],
                "unique_floor_fraction": unique_floor_s * 1e3 / ms,
            }
            print(f"  {name} grpo-short {variant:>18}: {ms:9.1f} ms", flush=True)
        plain = out["grpo-short"]["variants"].get("plain", {}).get("ms")
        for v in out["grpo-short"]["variants"].values():
            v["cost_over_plain"] = v["ms"] / plain - 1 if plain else float("nan")
        if args.json_forms:
            out["grpo-short"]["json"] = json_rounds(url, samples, args, unique_floor_s, timeline)
    if not args.teacher_budgets:
        return {"attention": engine.info.attention_backend, "decoder": engine.info.decoder, **out}
    body = teacher_body(name, prompts)
    with timeline.recording(engine):  # the first budget's last call
        for i, budget in enumerate(args.teacher_budgets):
            with HttpServer(engine, settings.model_copy(update={"max_batch_tokens": budget})) as url:
                call = teacher_calls(url, body, args.reps, device, timeline if i == 0 else None)
                # the same distribution through logprobd's helper (client.py --mode helper), to TRL's dict
                helper = helper_calls(url, body, args.reps, timeline) if i == 0 else None
                drawing = (
                    teacher_calls(url, {**body, "logprobs": 1}, args.reps, device) if args.drawing else None
                )
            at = {
                "max_batch_tokens": budget,
                "micro_batches_per_call": call["micro_batches_per_call"],
                "forward_ms_per_micro_batch": call["forward_ms_per_micro_batch"],
                "ms": call["ms"],
                "calls_ms": call["calls_ms"],
                "headers_ms": call["headers_ms"],
                "join_ms": call["join_ms"],
                "floor_fraction": teacher_floor_s * 1e3 / call["ms"],
                "peak_gib_over_weights": call["peak_gib"] - weights_gib,
                **{k: call[k] for k in OUTSIDE_SERVER if k in call},  # the last call, with --timeline
            }
            print(f"  {name} teacher at max_batch_tokens {budget}: {at}", flush=True)
            if i:
                out["teacher"]["budgets"].append(at)
                continue
            out["teacher"] = {
                "prompts": len(prompts),
                "tokens_per_prompt": args.teacher_tokens,
                "k": TEACHER_K,
                "floor_ms": teacher_floor_s * 1e3,
                **at,
                "answer_bytes": call["bytes"],
                "entries": call["entries"],
                "client_parse_ms": call["client_parse_s"] * 1e3,
                "weights_gib": weights_gib,
                "peak_gib": call["peak_gib"],
                "budgets": [at],
                "in_process_ms": in_process_ms(engine, body, name, vocab, args.reps),
            }
            if helper is not None:  # the same distribution through logprobd's helper, to TRL's dict
                out["teacher"]["helper"] = helper | {"floor_fraction": teacher_floor_s * 1e3 / helper["ms"]}
            if drawing is not None:
                # the same call with OpenAI's logprobs: 1, whose answer shows the drawn token, so each
                # prompt's job draws one (as it does wherever the checkpoint has a tokenizer)
                out["teacher"]["drawing"] = {
                    "ms": drawing["ms"],
                    "calls_ms": drawing["calls_ms"],
                    "floor_fraction": teacher_floor_s * 1e3 / drawing["ms"],
                    "peak_gib_over_weights": drawing["peak_gib"] - weights_gib,
                }
            print(f"  {name} teacher: {out['teacher']}", flush=True)
    if args.tokenizer:  # TRL's body to a checkpoint with a tokenizer: a token drawn, every entry's text
        with tempfile.TemporaryDirectory() as tmp:
            served = settings.model_copy(update={"model": word_tokenizer(vocab, Path(tmp))})
            with HttpServer(engine, served) as url:
                call = teacher_calls(url, body, args.reps, device)
        out["teacher"]["tokenizer"] = {
            "ms": call["ms"],
            "calls_ms": call["calls_ms"],
            "headers_ms": call["headers_ms"],
            "floor_fraction": teacher_floor_s * 1e3 / call["ms"],
            "answer_bytes": call["bytes"],
            "peak_gib_over_weights": call["peak_gib"] - weights_gib,
        }
        print(f"  {name} teacher with a tokenizer: {out['teacher']['tokenizer']}", flush=True)
    return {"attention": engine.info.attention_backend, "decoder": engine.info.decoder, **out}


def table(results: dict[str, Any]) -> str:
    lines = [
        "| model | grpo-short variant | ms | of the unique-token floor | cost over plain |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for name, m in results["models"].items():
        for variant, v in m["grpo-short"]["variants"].items():
            lines.append(
                f"| {name} | {variant} | {v['ms']:.1f} | {v['unique_floor_fraction']:.1%} | "
                f"{v['cost_over_plain']:+.1%} |"
            )
        for variant, v in m["grpo-short"].get("json", {}).items():  # over plain_json
            lines.append(
                f"| {name} | {variant} | {v['ms']:.1f} | {v['unique_floor_fraction']:.1%} | "
                f"{v['cost_over_plain_json']:+.1%} (over plain_json) |"
            )
    lines += [
        "",
        "| model | teacher call | ms | floor ms | of the floor | answer MB | client parse ms | "
        "peak GiB over weights |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, m in results["models"].items():
        t = m["teacher"]
        if not t:
            continue
        lines.append(
            f"| {name} | {t['prompts']} x {t['tokens_per_prompt']}, K {t['k']} | {t['ms']:.1f} | "
            f"{t['floor_ms']:.1f} | "
            f"{t['floor_fraction']:.1%} | {t['answer_bytes'] / 1e6:.1f} | {t['client_parse_ms']:.0f} | "
            f"{t['peak_gib_over_weights']:.2f} |"
        )
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    """The command line (tests/benchmarks/test_page.py parses each cited command with it)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.distribution", description=__doc__)
    parser.add_argument("--models", nargs="+", default=["qwen2.5-7b"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--attention", default="auto")
    parser.add_argument("--cuda-graphs", default="auto", choices=get_args(CudaGraphs))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--scale", type=float, default=1.0, help="every GRPO length x this (a CPU smoke test)"
    )
    parser.add_argument("--teacher-tokens", type=int, default=4096)
    parser.add_argument("--variants", nargs="*", default=list(EXTRAS), choices=list(EXTRAS))
    parser.add_argument(
        "--json-forms",
        nargs="*",
        default=[],
        choices=["lists", "base64"],
        help="also the GRPO variants as JSON from a plain client, the blocks in these forms",
    )
    parser.add_argument(
        "--json-client",
        default="plain-processes",
        choices=["plain-processes", "plain"],
        help="the JSON rounds' client (benchmarks/client.py's modes)",
    )
    parser.add_argument(
        "--teacher-budgets",
        nargs="*",
        type=int,
        default=[BATCH_TOKENS],
        help="the teacher call once per server max_batch_tokens (none: no teacher call)",
    )
    parser.add_argument(
        "--drawing", action=argparse.BooleanOptionalAction, default=True, help="the logprobs: 1 call too"
    )
    parser.add_argument(
        "--tokenizer",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the call again to a server with a tokenizer (words t<id>): it draws, every entry has text",
    )
    parser.add_argument("--output", type=Path, default=RESULTS / "distribution-latest.json")
    parser.add_argument(
        "--timeline", type=Path, help="the server's side of each JSON round's last round (JSON)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    results = run_models("distribution", args, argv, bench_model)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""CPU time to render and read a /logprobs answer with top_logprobs as a compact frame.

    python -m benchmarks.probes.topk_frames [--rows 64] [--prompt 500] [--actions 250] [--k 1000]
                                     [--candidates 0] [--vocab 151936] [--reps 3]

The GRPO 8 x 8 shape at 7B: 64 rows of `--prompt` tokens followed by `--actions` scored ones, with
`top_logprobs: K` (and `candidate_ids` C when --candidates > 0). Scores are synthetic (distinct ids,
sorted log-probs) as the engine would return them. Prints, best of --reps:

- server: service.answer.layout.answer (the rows scattered into their windows) and
  service.wire.arrays.to_frame as they are now, and `json part` (the [rows][window][K] fields
  written by orjson into the frame's JSON part, the frame before they travelled as arrays, rebuilt here);
- client: service.client.wire.from_frame + Scores.from_body on each of the two frames (the json part
  one: stdlib json.loads of the nested lists, then Scores' numpy blocks from them); and the JSON
  form (response.to_json, then json.loads + Scores.from_body as httpx reads it) for comparison;
- the sizes, and that both frames read back to the same numbers.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson

from benchmarks.workload import host_info
from service.answer.layout import answer, to_json
from service.client.wire import Scores, from_frame
from service.core.jobs import SequenceScores
from service.normalise import ModelLimits, ScoringPlan, normalise
from service.wire.arrays import RESPONSE_ARRAYS, to_frame
from service.wire.frame import ArraySpec, pack
from service.wire.schemas import LogprobsRequest

WIDE = ("top_ids", "top_logprobs", "candidate_logprobs")


def workload(
    *, rows: int, prompt: int, actions: int, k: int, candidates: int, vocab: int
) -> tuple[ScoringPlan, list[SequenceScores]]:
    rng = np.random.default_rng(0)
    body: dict[str, Any] = {
        "input_ids": rng.integers(0, vocab, size=(rows, prompt + actions)).tolist(),
        "num_actions": actions,
        "top_logprobs": k,
    }
    if candidates:
        body["candidate_ids"] = rng.integers(0, vocab, size=candidates).tolist()
    limits = ModelLimits(
        vocab_size=vocab, max_sequence_tokens=prompt + actions, max_top_logprobs=max(k, 1024)
    )
    plan = normalise(LogprobsRequest(**body), limits)
    scores = []
    for _ in range(rows):
        base = rng.integers(0, vocab, size=(actions, 1))
        top_ids = (base + np.arange(k) * 7919) % vocab  # distinct: 7919 is prime, k < vocab
        top_lps = -np.cumsum(rng.exponential(0.02, size=(actions, k)), axis=1).astype(np.float32)
        scores.append(
            SequenceScores(
                logprobs=top_lps[:, 0].copy(),
                entropy=None,
                top_ids=top_ids.astype(np.int64),
                top_logprobs=top_lps,
                ranks=rng.integers(1, 50, size=actions),
                candidate_logprobs=(
                    -rng.exponential(5.0, size=(actions, candidates)).astype(np.float32)
                    if candidates
                    else None
                ),
            )
        )
    return plan, scores


def json_part_frame(body: dict[str, Any]) -> bytes:
    """The frame with the [rows][window][K] fields in its JSON part (arrays.to_frame before they
    travelled as arrays)."""
    fields = {k: v for k, v in body.items() if k not in RESPONSE_ARRAYS or v is None}
    arrays = []
    for name, dtype in RESPONSE_ARRAYS.items():
        rows = body.get(name)
        if rows is None or name in WIDE:
            continue
        spec = ArraySpec(name, dtype, tuple(len(row) for row in rows))
        arrays.append((spec, np.concatenate(rows).astype(np.dtype(dtype).newbyteorder("<")).tobytes()))
    return pack(orjson.dumps(fields, option=orjson.OPT_SERIALIZE_NUMPY), arrays)


def best(reps: int, run: Callable[[], Any]) -> tuple[float, Any]:
    times, out = [], None
    for _ in range(reps):
        del out
        began = time.perf_counter()
        out = run()
        times.append(time.perf_counter() - began)
    return min(times), out


def same(a: Scores, b: Scores) -> bool:
    for name in WIDE:
        x, y = getattr(a, name), getattr(b, name)
        if (x is None) != (y is None):
            return False
        if x is not None and not all(
            np.array_equal(np.asarray(p), np.asarray(q)) for p, q in zip(x, y, strict=True)
        ):
            return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.probes.topk_frames", description=__doc__)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=500)
    parser.add_argument("--actions", type=int, default=250)
    parser.add_argument("--k", type=int, default=1000)
    parser.add_argument("--candidates", type=int, default=0)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--no-json", action="store_true", help="skip the JSON form (slow at K = 1000)")
    args = parser.parse_args(argv)
    plan, scores = workload(
        rows=args.rows,
        prompt=args.prompt,
        actions=args.actions,
        k=args.k,
        candidates=args.candidates,
        vocab=args.vocab,
    )
    engine = host_info(args.vocab)
    versions = {"policy": "v0"}
    print(f"{args.rows} rows x {args.actions} actions, K={args.k}, C={args.candidates}, vocab {args.vocab}")

    t_answer, body = best(args.reps, lambda: answer(plan, scores, engine, versions))
    t_frame, framed = best(args.reps, lambda: to_frame(body))
    t_old, old = best(args.reps, lambda: json_part_frame(body))
    print(f"server answer():                {t_answer:.3f} s")
    print(f"server to_frame, arrays (now):  {t_frame:.3f} s  -> {len(framed) / 1e6:.1f} MB")
    print(f"server to_frame, json part:     {t_old:.3f} s  -> {len(old) / 1e6:.1f} MB")
    print(
        f"server answer + to_frame:       {t_answer + t_frame:.3f} s now, {t_answer + t_old:.3f} s json part"
    )

    t_read, got = best(args.reps, lambda: Scores.from_body(from_frame(framed)))
    t_read_old, got_old = best(args.reps, lambda: Scores.from_body(from_frame(old)))
    print(f"client from_frame + Scores (arrays):    {t_read:.3f} s")
    print(f"client from_frame + Scores (json part): {t_read_old:.3f} s")
    print(f"same numbers from both frames: {same(got, got_old)}")
    if not args.no_json:
        t_json, text = best(1, lambda: to_json(body))
        t_parse, _ = best(1, lambda: Scores.from_body(json.loads(text)))
        print(f"JSON form: server to_json {t_json:.3f} s ({len(text) / 1e6:.1f} MB), client {t_parse:.3f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

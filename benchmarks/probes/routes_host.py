"""What routes cost on the host per request (no GPU): the standard workload's first 8 sequences
(~7,000 positions) with random distinct routes of Qwen3-30B-A3B's shape (48 sparse layers, 128
experts, top-8), in one compact frame.

    python -m benchmarks.probes.routes_host [--reps 5]

- client_frame: the client's wire.to_frame of the body, routes as nested lists, as the base64 strings
  build_body makes of arrays (routes.encode), and as numpy rows;
- normalise: arrays.parse_frame + normalise, plain and with `routed_experts` (u1 in the frame);
- answer: response.answer + arrays.to_frame / to_json with recorded routes (the engine's uint8 rows),
  as a frame, JSON lists and base64 strings;
- round_*: the batcher's and the engine's host work for the whole workload (64 sequences, 56,229
  positions, cut into micro-batches of whole sequences of at most 16,384 tokens), plain and with
  routes: `group` (prefixes.Grouper's cost and add of each sequence, as the batcher takes them),
  `share` (the micro-batches' prefix forests) and `pack` (engine/batch/packing.pack with the routes
  laid out, on the meta device: the host's work alone, device allocations and copies free).

Each figure is the median of `reps` runs, in ms.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import torch

from benchmarks.probes.kernels import micro_batches
from benchmarks.workload import host_info, workload
from service.answer.layout import answer, to_json
from service.client.routed_experts import encode
from service.client.wire import to_frame
from service.core.jobs import GivenRoutes, SequenceJob, SequenceScores
from service.core.prefixes import Forest, Grouper, share
from service.engine.batch.packing import pack
from service.engine.contract import MoeShape
from service.normalise import ModelLimits, ScoringPlan, normalise
from service.wire.arrays import parse_frame
from service.wire.arrays import to_frame as answer_frame

VOCAB = 151936
MOE = MoeShape(layers=48, experts=128, top_k=8)
LIMITS = ModelLimits(vocab_size=VOCAB, max_sequence_tokens=32768, moe=MOE)
INFO = host_info(VOCAB, MOE)


def routes(length: int, rng: np.random.Generator) -> np.ndarray:
    """[length, layers, top_k] uint8: top_k distinct experts at every (position, layer)."""
    keys = rng.random((length, MOE.layers, MOE.experts), dtype=np.float32)
    return np.argpartition(keys, MOE.top_k, axis=-1)[..., : MOE.top_k].astype(np.uint8)


def median_ms(fn: Callable[[], Any], reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def rendered(plan: ScoringPlan, scores: list[SequenceScores], write: Callable[[Any], bytes]) -> bytes:
    return write(answer(plan, scores, INFO, {"policy": "v"}))


BUDGET = 16384  # max_batch_tokens' default
SHARE_MIN = 64  # share_min_tokens' default


def grouped(batches: list[list[SequenceJob]]) -> None:
    for batch in batches:
        grouper = Grouper(SHARE_MIN)
        for job in batch:
            grouper.cost(job.tokens, job.routes)
            grouper.add(job.tokens, job.routes)


def shared(batches: list[list[SequenceJob]]) -> list[Forest]:
    return [share([j.tokens for j in b], SHARE_MIN, [j.routes for j in b]) for b in batches]


def packed(batches: list[list[SequenceJob]], forests: list[Forest]) -> None:
    for batch, forest in zip(batches, forests, strict=True):
        pack(batch, torch.device("meta"), forest=forest if forest.shared else None, moe=MOE)


def round_figures(reps: int) -> dict[str, float]:
    """The batcher's and the engine's host work over the standard workload, plain and with routes."""
    samples = workload(VOCAB, sequences=64)
    rng = np.random.default_rng(1)
    figures = {}
    for name, given in (("plain", False), ("routes", True)):
        jobs = [
            SequenceJob(
                tokens=np.asarray(s.tokens, dtype=np.int64),
                actions=np.arange(len(s.prompt), len(s.tokens), dtype=np.int64),
                temperature=1.0,
                return_entropy=False,
                routes=GivenRoutes(0, routes(len(s.tokens), rng)) if given else None,
            )
            for s in samples
        ]
        batches = micro_batches(jobs, BUDGET)
        figures[f"round_group_{name}"] = median_ms(partial(grouped, batches), reps)
        forests = shared(batches)
        figures[f"round_share_{name}"] = median_ms(partial(shared, batches), reps)
        figures[f"round_pack_{name}"] = median_ms(partial(packed, batches, forests), reps)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    samples = workload(VOCAB, sequences=64)[:8]
    rng = np.random.default_rng(0)
    plain = {"input_ids": [s.tokens for s in samples], "num_actions": [len(s.response) for s in samples]}
    given = [routes(len(s.tokens), rng) for s in samples]
    positions = sum(len(s.tokens) for s in samples)
    print(f"8 rows, {positions} positions x {MOE.layers} layers x top_k {MOE.top_k}")

    lists = {**plain, "routed_experts": [r.tolist() for r in given]}
    figures = {"client_frame_lists": median_ms(lambda: to_frame(lists), max(1, args.reps // 2))}
    strings = {**plain, "routed_experts": encode(given)}  # what build_body makes of arrays
    figures["client_frame_base64"] = median_ms(lambda: to_frame(strings), args.reps)
    arrays = {**plain, "routed_experts": given}
    if to_frame(arrays) is None:
        print("client_frame_arrays: no frame (the client takes routes as lists only)")
    else:
        figures["client_frame_arrays"] = median_ms(lambda: to_frame(arrays), args.reps)
    plain_raw, routed_raw = to_frame(plain), to_frame(lists)
    assert plain_raw is not None
    assert routed_raw is not None
    figures["normalise_plain"] = median_ms(lambda: normalise(parse_frame(plain_raw), LIMITS), args.reps)
    figures["normalise_routes"] = median_ms(lambda: normalise(parse_frame(routed_raw), LIMITS), args.reps)

    for form in ("lists", "base64"):
        raw = to_frame({**plain, "return_routed_experts": True, "routed_experts_format": form})
        assert raw is not None
        plan = normalise(parse_frame(raw), LIMITS)
        scores = [
            SequenceScores(logprobs=np.zeros(job.actions.shape[0], dtype=np.float32), entropy=None, routes=r)
            for job, r in zip(plan.jobs, given, strict=True)
        ]
        if form == "lists":
            figures["answer_frame"] = median_ms(partial(rendered, plan, scores, answer_frame), args.reps)
        figures[f"answer_json_{form}"] = median_ms(partial(rendered, plan, scores, to_json), args.reps)
    figures.update(round_figures(args.reps))
    for name, ms in figures.items():
        print(f"{name:22s} {ms:9.1f} ms")


if __name__ == "__main__":
    main()

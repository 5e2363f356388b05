"""The host side of POST /logprobs on the CPU, the engine's compute taken away: where a round goes.

    python -m benchmarks.host_path [--workloads grpo-short grpo-long standard] [--reps 5]

A round is benchmarks.grpo's: the workload's 64 sequences in 8 requests of 8 (one GRPO group each),
all sent at once. Per workload, in milliseconds summed over the round's 8 requests (median of
--reps), the stages a plain JSON client and the server go through, each timed alone in this process:

- client_encode: the client's json.dumps of the bodies (what httpx's `json=` does);
- parse: jsonrows.parse_json of the JSON bodies, as the route does (frames: arrays.parse_frame);
- normalise: service.normalise of the parsed requests;
- share: the prefix forest of the 64 sequences (prefixes.share, share_min_tokens 64);
- answer: response.answer of scores as long as the actions (random float32 log-probs);
- encode: response.to_json of the answers (frames: arrays.to_frame);
- client_decode: the client's json.loads of the answers (response.json()).

Then the same round over HTTP, the real app under uvicorn on loopback serving `InstantEngine` (its
scores are ready at once), from benchmarks/client.py in another process: `plain` (httpx defaults,
`json=`, `response.json()`) and `frames` (compact frames, logprobd's transport). Its wall time is
the host's alone: on a GPU the engine's time comes on top, and host work that holds the GIL delays
the engine thread's launches.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from benchmarks.run import HttpServer, http_bodies, http_rounds
from benchmarks.workload import Sample, grpo_long, grpo_short, workload
from service.arrays import parse_frame, to_frame
from service.engine.contract import EngineInfo, ReloadOrder, StagedWeights, WeightsState
from service.jobs import Chunk, SequenceJob, SequenceScores
from service.jsonrows import parse_json
from service.normalise import ModelLimits, normalise
from service.prefixes import Forest, share
from service.response import answer, to_json
from service.settings import Settings

VOCAB = 151_936  # Qwen2.5's
WORKLOADS: dict[str, Callable[[], list[Sample]]] = {
    "grpo-short": lambda: grpo_short(VOCAB),
    "grpo-long": lambda: grpo_long(VOCAB),
    "standard": lambda: workload(VOCAB),
}


@dataclass(frozen=True, slots=True)
class _Ready:
    scores: list[SequenceScores]

    def result(self) -> list[SequenceScores]:
        return self.scores

    def expert_load(self) -> None:
        return None


class InstantEngine:
    """Scores at once: log-probs drawn once (float32, like a model's: -Exp(2)), sliced per job."""

    def __init__(self) -> None:
        self._pool = -np.random.default_rng(0).exponential(2.0, size=1 << 20).astype(np.float32)
        self._weights = {"policy": WeightsState("policy", "initial", "instant", "initial", time.time())}
        self.info = EngineInfo(
            model="instant",
            demo=False,
            architecture="Instant",
            dtype="bfloat16",
            device="cpu",
            attention_backend="none",
            decoder="fused",
            kernels="none",
            vocab_size=VOCAB,
            max_positions=32_768,
            versions={},
        )

    def _scores(self, job: SequenceJob, actions: int) -> SequenceScores:
        values = self._pool[:actions].copy()
        return SequenceScores(logprobs=values, entropy=values if job.return_entropy else None)

    def launch(
        self, jobs: Sequence[SequenceJob], chunk: Chunk | None = None, forest: Forest | None = None
    ) -> _Ready:
        scores = [self._scores(j, int(j.actions.shape[0])) for j in jobs]
        if chunk is not None:
            scores.append(self._scores(chunk.job, int(chunk.actions.shape[0])))
        return _Ready(scores)

    def release(self, sequence: int) -> None:
        pass

    def warm_up(self) -> None:
        pass

    @property
    def weights(self) -> Mapping[str, WeightsState]:
        return self._weights

    def stage(self, order: ReloadOrder) -> StagedWeights:
        raise NotImplementedError("no weights to reload")

    def apply(self, staged: StagedWeights) -> WeightsState:
        raise NotImplementedError("no weights to reload")


def _median_ms(fn: Callable[[], object], reps: int) -> float:
    seconds = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds) * 1e3


def stages(samples: list[Sample], reps: int) -> dict[str, dict[str, float]]:
    """Per client form (plain JSON, frames), each stage's milliseconds over the round's 8 requests."""
    engine = InstantEngine()
    limits = ModelLimits(vocab_size=VOCAB, max_sequence_tokens=32_768)
    objects = [json.loads(b) for b in http_bodies(samples, frames=False)]
    out: dict[str, dict[str, float]] = {}
    for form in ("plain", "frames"):
        bodies = http_bodies(samples, frames=form == "frames")
        read = parse_frame if form == "frames" else parse_json
        write = to_frame if form == "frames" else to_json
        requests = [read(b) for b in bodies]
        plans = [normalise(r, limits) for r in requests]
        tokens = [j.tokens for p in plans for j in p.jobs]
        scores = [engine.launch(p.jobs).result() for p in plans]
        answers = [
            answer(p, s, engine.info, {"policy": "initial"}) for p, s in zip(plans, scores, strict=True)
        ]
        written = [write(a) for a in answers]
        figures = {
            "parse": _median_ms(lambda: [read(b) for b in bodies], reps),  # noqa: B023 (called at once)
            "normalise": _median_ms(lambda: [normalise(r, limits) for r in requests], reps),  # noqa: B023
            "share": _median_ms(lambda: share(tokens, 64), reps),  # noqa: B023
            "answer": _median_ms(
                lambda: [
                    answer(p, s, engine.info, {"policy": "initial"})
                    for p, s in zip(plans, scores, strict=True)  # noqa: B023
                ],
                reps,
            ),
            "encode": _median_ms(lambda: [write(a) for a in answers], reps),  # noqa: B023
        }
        if form == "plain":
            figures["client_encode"] = _median_ms(lambda: [json.dumps(o) for o in objects], reps)
            figures["client_decode"] = _median_ms(lambda: [json.loads(w) for w in written], reps)  # noqa: B023
        figures["server_total"] = sum(figures[k] for k in ("parse", "normalise", "share", "answer", "encode"))
        out[form] = figures
    return out


def rounds(samples: list[Sample], reps: int) -> dict[str, float]:
    """Median wall ms of the round over HTTP against InstantEngine, per client."""
    settings = Settings(device="cpu", share_min_tokens=64)
    with HttpServer(InstantEngine(), settings) as url:  # type: ignore[arg-type]
        plain = statistics.median(http_rounds(url, http_bodies(samples, frames=False), reps, "plain", False))
        frames = statistics.median(http_rounds(url, http_bodies(samples), reps, "asyncio", True))
    return {"plain": plain * 1e3, "frames": frames * 1e3}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.host_path", description=__doc__)
    parser.add_argument(
        "--workloads", nargs="+", choices=list(WORKLOADS), default=["grpo-short", "grpo-long"]
    )
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--no-http", action="store_true", help="the in-process stages only")
    args = parser.parse_args(argv)
    results: dict[str, Any] = {}
    for name in args.workloads:
        samples = WORKLOADS[name]()
        results[name] = {"stages_ms": stages(samples, args.reps)}
        if not args.no_http:
            results[name]["http_round_ms"] = rounds(samples, args.reps)
        print(name, orjson.dumps(results[name], option=orjson.OPT_INDENT_2).decode(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

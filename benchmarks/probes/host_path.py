"""The host side of POST /logprobs on the CPU, the engine's compute taken away: where a round goes.

    python -m benchmarks.probes.host_path [--workloads grpo-short grpo-long standard] [--reps 5]
    python -m benchmarks.probes.host_path --workloads grpo-short --top-logprobs 100 1000 --forms frames

A round is benchmarks.grpo's: the workload's 64 sequences in 8 requests of 8 (one GRPO group each),
all sent at once. Per workload, in milliseconds summed over the round's 8 requests (median of
--reps), the stages a plain JSON client and the server go through, each timed alone in this process:

- client_encode: the client's json.dumps of the bodies (what httpx's `json=` does);
- parse: jsonrows.parse_json of the JSON bodies, as the route does (frames: arrays.parse_frame);
- normalise: service.normalise of the parsed requests;
- share: the prefix forest of the 64 sequences (prefixes.share, share_min_tokens 64);
- answer: response.answer of scores as long as the actions (random float32 log-probs);
- encode: response.to_json of the answers (frames: arrays.to_frame);
- client_decode: the client's json.loads of the answers (response.json()); frames: logprobd's
  client's read (wire.from_frame, then Scores.from_body: numpy [window, K] blocks, int64 ids).

With `--top-logprobs K` every request asks `top_logprobs: K`, and InstantEngine answers as the
engine does: one micro-batch per request, its [A, K] top ids and log-probs and [A] ranks host
tensors in the dtypes the engine's host copy has (inflight.extra_host), split per job by the engine's
own collect (InFlight.result), timed as the stage `collect`.

Then the same round over HTTP, the real app under uvicorn on loopback serving `InstantEngine` (its
scores are ready at once), from benchmarks/client.py in another process: `plain` (httpx defaults,
`json=`, `response.json()`) and `frames` (compact frames, logprobd's transport). Its wall time is
the host's alone: on a GPU the engine's time comes on top, and host work that holds the GIL delays
the engine thread's launches. `<form>_server_cpu_ms` is the server's CPU time per round, steadier
than the wall time on a shared machine (the client's CPU competes there); `--server-profile PREFIX`
writes py-spy's collapsed stacks of the server per form.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import torch

from benchmarks.server import HttpServer, http_bodies, http_rounds
from benchmarks.workload import Sample, grpo_long, grpo_short, host_info, workload
from service.answer.layout import answer, to_json
from service.client.wire import Scores, from_frame
from service.client.wire import to_frame as client_frame
from service.core.cache_plan import CachePlan
from service.core.jobs import Chunk, SequenceJob, SequenceScores
from service.core.prefix_cache import PrefixIndex
from service.core.prefixes import Forest, share
from service.engine.contract import ReloadOrder, StagedWeights, WeightsState
from service.engine.scorer.inflight import HOST_ID_DTYPE, HostExtras, InFlight
from service.normalise import ModelLimits, normalise
from service.settings import Settings
from service.wire.arrays import parse_frame, to_frame
from service.wire.jsonrows import parse_json

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


@dataclass(frozen=True, slots=True)
class _Timed:
    """A micro-batch whose scores are ready at `ready_at` (time.perf_counter()), not before."""

    launched: _Ready | InFlight
    ready_at: float

    def result(self) -> list[SequenceScores]:
        time.sleep(max(self.ready_at - time.perf_counter(), 0.0))
        return self.launched.result()

    def expert_load(self) -> None:
        return None


class InstantEngine:
    """Scores at once (with `device_ms`: each micro-batch's that many ms after the device, which
    runs one at a time, is free): log-probs drawn once (float32, like a model's: -Exp(2)), sliced
    per job; with top_logprobs (or a draw), one micro-batch's host extras as PackedScorer's host
    copy holds them (inflight.extra_host: [A, K] HOST_ID_DTYPE ids and float32 log-probs, [A] int64
    ranks and draws), split per job by the engine's own collect (InFlight.result). The K ids of a
    row are distinct, the log-probs sorted, and the action's token is among them six times in ten
    with the rank and log-prob of its slot (else a rank past K and a log-prob below the K-th): what
    the completions writer reads."""

    def __init__(self, vocab: int = VOCAB, device_ms: float = 0.0) -> None:
        self.vocab = vocab
        self.device_s = device_ms / 1e3
        self._device_free = 0.0  # time.perf_counter() at which the simulated device is idle
        self._pool = -np.random.default_rng(0).exponential(2.0, size=1 << 20).astype(np.float32)
        self._tops: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._extras: dict[tuple[bytes, int], HostExtras] = {}  # by a micro-batch's tokens: built once
        self._weights = {"policy": WeightsState("policy", "initial", "instant", "initial", time.time())}
        self.info = host_info(vocab)

    def _scores(self, job: SequenceJob, actions: int) -> SequenceScores:
        values = self._pool[:actions].copy()
        return SequenceScores(logprobs=values, entropy=values if job.return_entropy else None)

    def _top(self, rows: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """[rows, K] int64 first ids (each row's K distinct) and sorted float32 log-probs, drawn once."""
        base, logprobs = self._tops.get(k, (np.empty(0), np.empty((0, k))))
        if base.shape[0] < rows:
            rng = np.random.default_rng(k)
            size = max(rows, 4096)
            base = rng.integers(0, self.vocab, size=size)
            logprobs = -np.cumsum(rng.exponential(0.15, size=(size, k)), axis=1).astype(np.float32)
            self._tops[k] = base, logprobs
        stride = 7919  # a prime that divides no vocabulary here: K < vocab ids a row, all distinct
        ids = (base[:rows, None] + np.arange(k) * stride) % self.vocab
        return ids, logprobs[:rows]

    def _host_extras(self, tokens: np.ndarray, k: int, draw: bool) -> HostExtras:
        """Extras of rows whose action tokens are `tokens` [A]."""
        key = (tokens.tobytes(), k)
        if key not in self._extras:
            rows = tokens.shape[0]
            ids, top = self._top(rows, k)
            rng = np.random.default_rng(rows)
            hit = ids == tokens[:, None]
            has = hit.any(axis=1)
            place = ~has & (rng.random(rows) < 0.6)
            slot = rng.integers(0, k, size=(rows,))
            ids[place, slot[place]] = tokens[place]
            rank = np.where(
                has, hit.argmax(axis=1) + 1, np.where(place, slot + 1, rng.integers(k + 1, self.vocab, rows))
            )
            if len(self._extras) >= 64:  # the benchmarks repeat a few rounds' micro-batches
                del self._extras[next(iter(self._extras))]
            self._extras[key] = HostExtras(
                rows=np.arange(rows),
                top_ids=torch.from_numpy(ids.astype(np.int32)).to(HOST_ID_DTYPE),
                top_logprobs=torch.from_numpy(np.ascontiguousarray(top)),
                ranks=torch.from_numpy(rank.astype(np.int64)),
                candidate_logprobs=None,
                processed=None,
                drawn=torch.from_numpy(ids[:, 0].astype(np.int64)) if draw else None,
            )
        return self._extras[key]

    def _logprobs(self, extras: HostExtras, k: int) -> torch.Tensor:
        """[A] the actions' log-probs: their slot's where among the K, else below the K-th."""
        assert extras.top_logprobs is not None
        rank = extras.ranks.numpy()
        top = extras.top_logprobs.numpy()
        rows = np.arange(rank.shape[0])
        return torch.from_numpy(
            np.where(rank <= k, top[rows, np.minimum(rank, k) - 1], top[:, -1] - 1.0).astype(np.float32)
        )

    prefix_cache: PrefixIndex | None = None  # no prefix cache: every launch computes all it is given

    def flush_cache(self) -> None:
        pass

    def launch(
        self,
        jobs: Sequence[SequenceJob],
        chunk: Chunk | None = None,
        forest: Forest | None = None,
        cache: CachePlan | None = None,
    ) -> _Ready | InFlight | _Timed:
        launched = self._launch(jobs, chunk)
        if not self.device_s:
            return launched
        self._device_free = max(time.perf_counter(), self._device_free) + self.device_s
        return _Timed(launched, self._device_free)

    def _launch(self, jobs: Sequence[SequenceJob], chunk: Chunk | None) -> _Ready | InFlight:
        parts = [(j, j.actions, j.targets) for j in jobs]
        if chunk is not None:
            parts.append((chunk.job, chunk.actions, chunk.targets))
        k = max((j.top_logprobs for j, _, _ in parts), default=0)
        draw = any(j.draw_seed is not None for j, _, _ in parts)
        if not k and not draw:
            return _Ready([self._scores(j, int(a.shape[0])) for j, a, _ in parts])
        counts = [int(a.shape[0]) for _, a, _ in parts]
        tokens = np.concatenate([t for _, _, t in parts]).astype(np.int64)
        extras = self._host_extras(tokens, max(k, 1), draw)
        logprobs = self._logprobs(extras, max(k, 1))
        return InFlight(
            jobs=[j for j, _, _ in parts],
            actions_per_sequence=counts,
            logprobs=logprobs,
            entropy=logprobs,
            ref_logprobs=None,
            values=None,
            done=None,
            extras=extras,
        )

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


def median_ms(fn: Callable[[], object], reps: int) -> float:
    """Median milliseconds of `reps` calls of fn."""
    seconds = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds) * 1e3


def bodies_of(samples: list[Sample], frames: bool, top_logprobs: int = 0) -> list[bytes]:
    """http_bodies, each asking `top_logprobs` K when K > 0."""
    if not top_logprobs:
        return http_bodies(samples, frames=frames)
    objects = [json.loads(b) | {"top_logprobs": top_logprobs} for b in http_bodies(samples, frames=False)]
    if not frames:
        return [orjson.dumps(o) for o in objects]
    framed = [client_frame(o) for o in objects]
    return [f for f in framed if f is not None]


def client_read(raw: bytes) -> Scores:
    """What logprobd's client does with a framed answer (_common.reply_body, then finish)."""
    return Scores.from_body(from_frame(raw))


def stages(
    samples: list[Sample], reps: int, top_logprobs: int = 0, forms: Sequence[str] = ("plain", "frames")
) -> dict[str, dict[str, float]]:
    """Per client form (plain JSON, frames), each stage's milliseconds over the round's 8 requests."""
    engine = InstantEngine()
    limits = ModelLimits(vocab_size=VOCAB, max_sequence_tokens=32_768)
    objects = [json.loads(b) for b in bodies_of(samples, False, top_logprobs)]
    out: dict[str, dict[str, float]] = {}
    for form in forms:
        bodies = bodies_of(samples, form == "frames", top_logprobs)
        read = parse_frame if form == "frames" else parse_json
        write = to_frame if form == "frames" else to_json
        requests = [read(b) for b in bodies]
        plans = [normalise(r, limits) for r in requests]
        tokens = [j.tokens for p in plans for j in p.jobs]
        launched = [engine.launch(p.jobs) for p in plans]
        scores = [f.result() for f in launched]
        answers = [
            answer(p, s, engine.info, {"policy": "initial"}) for p, s in zip(plans, scores, strict=True)
        ]
        written = [write(a) for a in answers]
        figures = {
            "parse": median_ms(lambda: [read(b) for b in bodies], reps),  # noqa: B023 (called at once)
            "normalise": median_ms(lambda: [normalise(r, limits) for r in requests], reps),  # noqa: B023
            "share": median_ms(lambda: share(tokens, 64), reps),  # noqa: B023
            "answer": median_ms(
                lambda: [
                    answer(p, s, engine.info, {"policy": "initial"})
                    for p, s in zip(plans, scores, strict=True)  # noqa: B023
                ],
                reps,
            ),
            "encode": median_ms(lambda: [write(a) for a in answers], reps),  # noqa: B023
        }
        if top_logprobs:
            figures["collect"] = median_ms(lambda: [f.result() for f in launched], reps)  # noqa: B023
        if form == "plain":
            figures["client_encode"] = median_ms(lambda: [json.dumps(o) for o in objects], reps)
            figures["client_decode"] = median_ms(lambda: [json.loads(w) for w in written], reps)  # noqa: B023
        else:
            figures["client_decode"] = median_ms(lambda: [client_read(w) for w in written], reps)  # noqa: B023
        figures["answer_mb"] = sum(len(w) for w in written) / 1e6
        server = ("parse", "normalise", "share", "collect", "answer", "encode")
        figures["server_total"] = sum(figures.get(k, 0.0) for k in server)
        out[form] = figures
    return out


def rounds(
    samples: list[Sample],
    reps: int,
    top_logprobs: int = 0,
    forms: Sequence[str] = ("plain", "frames"),
    profile: str | None = None,
) -> dict[str, float]:
    """Per client form: the median wall ms of the round over HTTP against InstantEngine, and as
    `<form>_server_cpu_ms` the CPU time of this process (the server's threads: uvicorn's loop, the
    batcher's executor) per round, warm-up included; the client runs in another process. With
    `profile`, py-spy samples this process during each form's rounds (`<profile>-<form>.txt`:
    collapsed stacks, one line per stack and its sample count)."""
    settings = Settings(device="cpu", share_min_tokens=64)
    out: dict[str, float] = {}
    with HttpServer(InstantEngine(), settings) as url:  # type: ignore[arg-type]
        for form in ("plain", "frames"):
            if form not in forms:
                continue
            bodies = bodies_of(samples, form == "frames", top_logprobs)
            mode = "plain" if form == "plain" else "asyncio"
            with _sampled(f"{profile}-{form}.txt" if profile else None):
                cpu = time.process_time()
                seconds = http_rounds(url, bodies, reps, mode, form == "frames")
                cpu = time.process_time() - cpu
            out[form] = statistics.median(seconds) * 1e3
            out[f"{form}_server_cpu_ms"] = cpu / (reps + 1) * 1e3
    return out


@contextmanager
def _sampled(path: str | None) -> Iterator[None]:
    """py-spy (the dev install's) recording this process into `path` while the block runs."""
    if path is None:
        yield
        return
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    cmd = [spy, "record", "--pid", str(os.getpid()), "--format", "raw", "--rate", "1000", "--nonblocking"]
    recorder = subprocess.Popen([*cmd, "-o", path], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # attached before the round starts
    try:
        yield
    finally:
        recorder.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        recorder.wait(timeout=60)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.probes.host_path", description=__doc__)
    parser.add_argument(
        "--workloads", nargs="+", choices=list(WORKLOADS), default=["grpo-short", "grpo-long"]
    )
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--no-http", action="store_true", help="the in-process stages only")
    parser.add_argument(
        "--top-logprobs", type=int, nargs="+", default=[0], help="K per run (0: plain scoring)"
    )
    parser.add_argument("--forms", nargs="+", choices=["plain", "frames"], default=["plain", "frames"])
    parser.add_argument(
        "--server-profile",
        metavar="PREFIX",
        help="py-spy the server during the HTTP rounds: PREFIX-<workload>-<form>.txt (collapsed stacks)",
    )
    args = parser.parse_args(argv)
    results: dict[str, Any] = {}
    for name in args.workloads:
        samples = WORKLOADS[name]()
        for k in args.top_logprobs:
            key = f"{name} top_logprobs {k}" if k else name
            results[key] = {"stages_ms": stages(samples, args.reps, k, args.forms)}
            if not args.no_http:
                profile = f"{args.server_profile}-{key.replace(' ', '-')}" if args.server_profile else None
                results[key]["http_round_ms"] = rounds(samples, args.reps, k, args.forms, profile)
            print(key, orjson.dumps(results[key], option=orjson.OPT_INDENT_2).decode(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

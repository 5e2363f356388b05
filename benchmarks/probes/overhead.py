"""Where the HTTP overhead goes: a timeline of the server's side of the benchmark's HTTP rounds.

    python -m benchmarks.probes.overhead --model qwen2.5-0.5b [--switch-interval 0.0005] \\
        [--launch-hold-ms 0 25]
    python -m benchmarks.probes.overhead --model qwen2.5-1.5b --workload grpo-short --clients plain frames

Runs the engine in-process and then over HTTP (the real app on loopback, clients in another
process, as benchmarks.run does) and records, in the server's process, when each request is parsed,
normalised and rendered, when each micro-batch is launched in the engine thread and when its scores
were collected. Prints, per variant: how long after the first request arrived the first micro-batch
was launched, the host time of the launches (longer over HTTP when the event loop holds the GIL the
engine thread needs), how long the engine thread sat idle between the end of one launch and the
next while the results were not all in (the accelerator may run dry then), how long after the last
collection the last answer was rendered, the span, and when each micro-batch's scores were
collected (from the first request's arrival); on CUDA, from events recorded on the engine's stream
around each launch, the device's time on each micro-batch (longer than in-process when the host
launches its kernels slower than the device runs them) and its idle time before each one.
`--switch-interval` sets sys.setswitchinterval in the server's process; `--launch-hold-ms`,
`--batch-wait-ms` and `--max-batch-tokens` run the HTTP variants once per combination of the settings'
values, on the same engine (built for the largest budget); several budgets run in-process once each.

`--workload`: the standard workload (8 requests of an eighth of its sequences) or a GRPO one
(benchmarks.grpo's: one request per group; in-process, the 8 groups as 8 requests at once too).
`--clients`: the HTTP variants (benchmarks/client.py's modes): `frames` (asyncio), `frames-httpcore`,
`json` (JSON bodies on the asyncio client), `plain` (httpx defaults, `json=`, `response.json()`),
`processes` (frames, one process per body). The medians also go to `--output` (JSON, in ms).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import itertools
import json
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args

import orjson
import torch

from benchmarks import server
from benchmarks.harness import CACHE_IN_ROUNDS, RESULTS, packed_model, provenance, write_result
from benchmarks.server import HttpServer, http_bodies, http_rounds
from benchmarks.shapes import SHAPES
from benchmarks.workload import Sample, grpo_long, grpo_short, jobs, workload
from service.answer import layout as answer_layout
from service.batcher import Batcher
from service.core.jobs import IntArray, SequenceJob, SequenceScores
from service.engine.config import BATCH_TOKENS
from service.engine.contract import Launched
from service.engine.decoder.graphs import GraphedDecoder
from service.engine.loading.pretrained import LoadedModel
from service.engine.scorer.engine import PackedScorer
from service.http import router as api
from service.http.completions import response as completions_response
from service.metrics import Metrics
from service.settings import CudaGraphs, Settings

Event = tuple[str, float, float]  # what, start, end (time.perf_counter)
WORKLOADS: dict[str, Callable[[int, float], list[Sample]]] = {
    "standard": lambda vocab, scale: workload(
        vocab,
        prompt_range=(round(256 * scale), round(1024 * scale)),
        response_mean=250.0 * scale,
        response_clip=(max(1, round(16 * scale)), round(1024 * scale)),
    ),
    "grpo-short": grpo_short,
    "grpo-long": grpo_long,
}
CLIENTS = {  # --clients -> (frames, benchmarks/client.py's mode)
    "frames": (True, "asyncio"),
    "frames-httpcore": (True, "httpcore"),
    "json": (False, "asyncio"),
    "plain": (False, "plain"),
    "processes": (True, "processes"),
}


class RecordedLaunch:
    """A launched micro-batch whose `result` records ("collected", wait start, wait end)."""

    def __init__(self, events: list[Event], launched: Launched) -> None:
        self.events, self.launched = events, launched

    def result(self) -> list[SequenceScores]:
        start = time.perf_counter()
        try:
            return self.launched.result()
        finally:
            self.events.append(("collected", start, time.perf_counter()))

    def expert_load(self) -> IntArray | None:
        return self.launched.expert_load()


GpuMarks = dict[float, tuple[Any, Any]]  # a launch's host start -> CUDA events around its work
TOKENS: dict[float, int] = {}  # a launch's host start -> the real tokens of its micro-batch
EVENTS: list[Event] = []  # what the server's process did, as it did it


def recorded_launches(
    events: list[Event], launch: Callable[..., Launched], marks: GpuMarks | None = None
) -> Callable[..., Launched]:
    """Record each launch's host time; with `marks`, also CUDA events on the engine's stream before
    and after its work, so the device's own timeline shows when it ran each micro-batch."""

    def wrapper(the_jobs: Any, chunk: Any = None, forest: Any = None, cache: Any = None) -> Launched:
        start = time.perf_counter()
        whole = forest.computed_tokens if forest is not None else sum(job.num_tokens for job in the_jobs)
        TOKENS[start] = whole + (chunk.num_tokens if chunk else 0)
        before = after = None
        if marks is not None:
            before = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            before.record()
        try:
            return RecordedLaunch(events, launch(the_jobs, chunk, forest, cache))
        finally:
            if marks is not None:
                after = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                after.record()
                marks[start] = (before, after)
            events.append(("launch", start, time.perf_counter()))

    return wrapper


def recorded(events: list[Event], what: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            events.append((what, start, time.perf_counter()))

    return wrapper


def rounds(events: list[Event], per_round: int) -> list[list[Event]]:
    """Split the events into rounds: a round starts with every `per_round`-th "start" event. The
    requests' arrivals at the app ("headers", "body": `received`) are left out."""
    ordered = sorted((e for e in events if e[0] not in ("headers", "body")), key=lambda e: e[1])
    starts = [e[1] for e in ordered if e[0] in ("start", "parse")][::per_round]
    out: list[list[Event]] = [[] for _ in starts]
    for event in ordered:
        index = max((i for i, t in enumerate(starts) if t <= event[1]), default=0)
        out[index].append(event)
    return out


SCORING_PATHS = ("/logprobs", "/v1/completions")


def received(events: list[Event], create_app: Callable[..., Any]) -> Callable[..., Any]:
    """create_app whose app records, per POST /logprobs or /v1/completions, when uvicorn handed it
    over (its headers parsed: "headers"), when its body's last part was read ("body") and each part
    of the answer handed back to uvicorn ("sent": the await, which waits while the client has not
    read what went before)."""

    def create(*args: Any, **kwargs: Any) -> Any:
        app = create_app(*args, **kwargs)

        async def recorded_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            if scope["type"] != "http" or scope["path"] not in SCORING_PATHS:
                await app(scope, receive, send)
                return
            now = time.perf_counter()
            events.append(("headers", now, now))

            async def receive_recorded() -> dict[str, Any]:
                message: dict[str, Any] = await receive()
                if message["type"] == "http.request" and not message.get("more_body", False):
                    at = time.perf_counter()
                    events.append(("body", at, at))
                return message

            async def send_recorded(message: dict[str, Any]) -> None:
                start = time.perf_counter()
                try:
                    await send(message)
                finally:
                    if message["type"] == "http.response.body":
                        events.append(("sent", start, time.perf_counter()))

            await app(scope, receive_recorded, send_recorded)

        return recorded_app

    return create


def round_begin(events: list[Event], requests: int) -> float:
    """When the last round of `requests` requests began: its first arrival (time.perf_counter)."""
    return sorted(e[1] for e in events if e[0] == "headers")[-requests]


def last_round(events: list[Event], requests: int) -> list[list[Any]]:
    """The events of the last round (its `requests` arrivals on), as [what, start ms, end ms] from
    its first arrival; none when nothing was recorded."""
    if sum(e[0] == "headers" for e in events) < requests:
        return []
    begin = round_begin(events, requests)
    return [
        [what, round((a - begin) * 1e3, 2), round((b - begin) * 1e3, 2)]
        for what, a, b in sorted(events, key=lambda e: e[1])
        if a >= begin
    ]


ALLOCATOR_COUNTS = ("num_device_alloc", "num_device_free", "num_alloc_retries")


@contextlib.contextmanager
def recording_stalls(events: list[Event]) -> Iterator[None]:
    """Within: what can hold a launch or the event loop up goes into `events` too: each garbage
    collection ("gc<generation>"), each CUDA graph captured as met ("capture", "capture checked": the
    first of a routed mode, checked against the eager forward), on CUDA each launch that allocated or
    freed device memory ("cudaMalloc <n> cudaFree <n> retries <n>", over the launch) and each
    synchronising CUDA call torch reports (`torch.cuda.set_sync_debug_mode`: "sync <file:line>", the
    innermost frame of the service). The originals are back after."""
    collecting: dict[str, float] = {}

    def collected(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            collecting["at"] = time.perf_counter()
        elif "at" in collecting:
            events.append((f"gc{info['generation']}", collecting.pop("at"), time.perf_counter()))

    def showwarning(message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
        if "synchronizing CUDA operation" not in str(message):
            shown(message, category, *args, **kwargs)
            return
        now = time.perf_counter()
        frames = [f for f in traceback.extract_stack() if "/service/" in f.filename]
        where = f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "?"
        events.append((f"sync {where}", now, now))

    saved = {name: getattr(GraphedDecoder, name) for name in ("_record", "_record_checked")}
    GraphedDecoder._record = recorded(events, "capture", saved["_record"])  # type: ignore[method-assign]
    GraphedDecoder._record_checked = recorded(events, "capture checked", saved["_record_checked"])  # type: ignore[method-assign]
    gc.callbacks.append(collected)
    shown, cuda = warnings.showwarning, torch.cuda.is_available()
    warnings.showwarning = showwarning
    if cuda:
        torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("always", message=".*synchronizing CUDA operation")
            yield
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = shown
        gc.callbacks.remove(collected)
        for name, fn in saved.items():
            setattr(GraphedDecoder, name, fn)


def allocating_launches(events: list[Event], launch: Callable[..., Launched]) -> Callable[..., Launched]:
    """`launch`, recording ("cudaMalloc <n> cudaFree <n> retries <n>", start, end) over a launch
    that allocated or freed device memory (the caching allocator's counts; CUDA only)."""

    def counts() -> list[int]:
        stats = torch.cuda.memory_stats()
        return [int(stats.get(name, 0)) for name in ALLOCATOR_COUNTS]

    def wrapper(*args: Any, **kwargs: Any) -> Launched:
        before, start = counts(), time.perf_counter()
        try:
            return launch(*args, **kwargs)
        finally:
            moved = [b - a for a, b in zip(before, counts(), strict=True)]
            if any(moved):
                what = "cudaMalloc {} cudaFree {} retries {}".format(*moved)
                events.append((what, start, time.perf_counter()))

    return wrapper


@dataclass
class Timelines:
    """A benchmark's `--timeline PATH`: while `recording`, the server's side of its rounds (the app's
    arrivals, parse, normalise and render, the engine's launches and collections, and what may stall
    them: `recording_stalls`, `allocating_launches`); `take` keeps a
    variant's last round, and PATH gets every variant's (JSON) when recording ends. Without a path,
    nothing is recorded."""

    path: Path | None
    events: list[Event] = field(default_factory=list)
    rounds: dict[str, list[list[Any]]] = field(default_factory=dict)

    @contextlib.contextmanager
    def recording(self, engine: PackedScorer) -> Iterator[None]:
        if self.path is None:
            yield
            return
        launch = engine.launch
        counted = allocating_launches(self.events, launch) if torch.cuda.is_available() else launch
        engine.launch = recorded_launches(self.events, counted)  # type: ignore[method-assign,assignment]
        try:
            with recording_server(self.events), recording_stalls(self.events):
                yield
        finally:
            engine.launch = launch  # type: ignore[method-assign]
        self.path.write_bytes(orjson.dumps(self.rounds))

    def start(self) -> None:
        """A variant's rounds begin."""
        self.events.clear()

    def outside_server(self, call: dict[str, float]) -> dict[str, float]:
        """Of one call whose `started` and `ended` (a client process's time.perf_counter, the same
        clock) hold the last request recorded: ms before its headers reached the app
        (`client_before_ms`: the client's encoding and connection), from them to the answer's last
        part handed to uvicorn (`server_ms`), and after that to the client's last byte read
        (`client_after_ms`: what the client still had to read, and its own copies); where the call
        says when its last byte came (`received`), that last part split into `client_read_ms` and
        `client_join_ms` (the client joining the answer's pieces). Empty without a path, as `take`."""
        if self.path is None:
            return {}
        arrived = max(e[1] for e in self.events if e[0] == "headers")
        sent = max(e[2] for e in self.events if e[0] == "sent")
        split = {
            "client_before_ms": (arrived - call["started"]) * 1e3,
            "server_ms": (sent - arrived) * 1e3,
            "client_after_ms": (call["ended"] - sent) * 1e3,
        }
        if "received" in call:
            split["client_read_ms"] = (call["received"] - sent) * 1e3
            split["client_join_ms"] = (call["ended"] - call["received"]) * 1e3
        return split

    def take(
        self,
        variant: str,
        requests: int,
        round_s: float | None = None,
        client: dict[str, Any] | None = None,
    ) -> dict[str, float]:
        """The variant's rounds of `requests` requests each are over: keep its last. With the last
        round's seconds (`round_s`, as its client timed it), that round's split: `server_span_ms`, its
        first request's headers at the app to its last answer's last part handed to uvicorn, and
        `outside_server_ms`, the rest of the round (the clients' encoding before, their reading and
        parsing after). With the client's own times of that round (`client`: a round of
        benchmarks.client's timeline), the rest split further (client_split). Empty without a path."""
        if self.path is None:
            return {}
        kept = last_round(self.events, requests)
        self.rounds[variant] = kept
        sent = [end for what, _, end in kept if what == "sent"]
        if round_s is None or not sent:
            return {}
        split = {"server_span_ms": max(sent), "outside_server_ms": round_s * 1e3 - max(sent)}
        if client is not None:
            split |= client_split(client, round_begin(self.events, requests), max(sent) / 1e3)
        return split

    def json_rounds(
        self, variant: str, url: str, bodies: list[bytes], reps: int, mode: str
    ) -> tuple[list[float], dict[str, float]]:
        """A variant's rounds of JSON `bodies` from a client in another process (http_rounds, its
        `mode`), and `take`'s split of the last one (with the client's own times where recording)."""
        self.start()
        client: list[dict[str, Any]] | None = [] if self.path is not None else None
        rounds = http_rounds(url, bodies, reps, mode, frames=False, client_rounds=client)
        return rounds, self.take(variant, len(bodies), rounds[-1], client[-1] if client else None)


def client_split(client: dict[str, Any], begin: float, span_s: float) -> dict[str, float]:
    """Where the plain clients' part of a round goes (`client`: benchmarks.client's timeline entry of
    the round; the server's span: from `begin`, its first request's headers at the app, `span_s`
    seconds to its last part handed to uvicorn; one clock), ms: the round's start to `begin`
    (`to_first_arrival_ms`), and of the request that ended the round, its answer's last byte read
    after the server's last part (`last_read_after_sent_ms`: a little under 0 where the client read it
    before the server's loop came back from the send that handed it over) and its parse (`last_parse_ms`:
    response.json() and, for base64 blocks, their decoding); the three add up to the round less the
    server's span (in the process modes; the plain mode's round ends a little later, when its
    asyncio.gather returns). Where the client timed its encoding (the process modes), the longest any client
    took to encode its body (`encode_ms_max`, json= before its first byte)."""
    _, read, parsed = max(client["requests"], key=lambda q: q[2])
    split = {
        "to_first_arrival_ms": (begin - client["start"]) * 1e3,
        "last_read_after_sent_ms": (read - begin - span_s) * 1e3,
        "last_parse_ms": (parsed - read) * 1e3,
    }
    if "encoded" in client:
        starts = [q[0] for q in client["requests"]]
        split["encode_ms_max"] = max((e - p) * 1e3 for p, e in zip(starts, client["encoded"], strict=True))
    return split


def split_text(split: dict[str, float]) -> str:
    """Timelines.take's split of a last round, as a printed line ends ("" without one)."""
    if not split:
        return ""
    client = ""
    if "last_parse_ms" in split:
        client = (
            f": {split['to_first_arrival_ms']:.1f} before the first arrival; the last answer read "
            f"{split['last_read_after_sent_ms']:.1f} after the server's last part, parsed in "
            f"{split['last_parse_ms']:.1f}"
        )
    if "encode_ms_max" in split:
        client += f"; bodies encoded in up to {split['encode_ms_max']:.1f}"
    rest = f"the rest {split['outside_server_ms']:.1f}{client}"
    return f" (last round: server {split['server_span_ms']:.1f} ms, {rest})"


def summary(label: str, events: list[Event], per_round: int, marks: GpuMarks | None = None) -> dict[str, Any]:
    """Print the rounds' medians (after the first, a warm-up) under `label`, and return them (ms)."""
    rows: list[tuple[float, ...]] = []
    dones: list[list[float]] = []
    spans: list[list[float]] = []  # the device's time on each micro-batch (its first kernel to its last)
    idles: list[list[float]] = []  # the device idle before each micro-batch, waiting for its launch
    sizes: list[list[int]] = []  # the real tokens of each micro-batch
    for r in rounds(events, per_round):
        launches = [e for e in r if e[0] == "launch"]
        last_collected = max(e[2] for e in r if e[0] == "collected")
        first = min(e[1] for e in r)
        busy = sum(e[2] - e[1] for e in launches)
        # the engine thread idle between launches before the last collection: nothing new was queued
        idle = sum(min(b[1], last_collected) - a[2] for a, b in itertools.pairwise(launches))
        renders = [e for e in r if e[0] == "render"]
        tail = max(e[2] for e in renders) - last_collected if renders else 0.0
        host = sum(e[2] - e[1] for e in r if e[0] in ("parse", "normalise", "render"))
        done = sorted(e[2] - first for e in r if e[0] == "collected")
        span = max(e[2] for e in r) - first
        rows.append((launches[0][1] - first, busy, idle, tail, host, span, len(launches)))
        dones.append(done)
        sizes.append([TOKENS[e[1]] for e in launches if e[1] in TOKENS])
        if marks:
            pairs = [marks[e[1]] for e in launches if e[1] in marks]
            for _, after in pairs:
                after.synchronize()
            spans.append([b.elapsed_time(a) for b, a in pairs])
            idles.append([0.0] + [a0.elapsed_time(b1) for (_, a0), (b1, _) in itertools.pairwise(pairs)])
    keep = rows[1:] or rows  # the first round warms up
    med = [statistics.median(x[i] for x in keep) * 1e3 for i in range(6)]
    out: dict[str, Any] = dict(
        zip(
            ("first_launch_ms", "launches_ms", "between_launches_ms", "tail_ms", "host_ms", "span_ms"),
            med,
            strict=True,
        )
    )
    out["micro_batches"] = keep[0][6]
    print(
        f"{label:28s} first launch after {med[0]:6.2f} ms | launches {med[1]:7.2f} ms ({keep[0][6]}) | "
        f"between launches {med[2]:6.2f} ms | tail {med[3]:5.2f} ms | parse+normalise+render "
        f"{med[4]:5.2f} ms | span {med[5]:7.2f} ms",
        flush=True,
    )
    done_keep = dones[1:] or dones
    if len({len(d) for d in done_keep}) == 1:  # when each micro-batch's scores were in
        done = [statistics.median(d[i] for d in done_keep) * 1e3 for i in range(len(done_keep[0]))]
        out["collected_at_ms"] = done
        print(f"{'':28s} micro-batches collected at {' / '.join(f'{t:.1f}' for t in done)} ms", flush=True)
    keep_sizes = sizes[1:] or sizes
    if keep_sizes and len({len(x) for x in keep_sizes}) == 1:
        tokens = [statistics.median(x[i] for x in keep_sizes) for i in range(len(keep_sizes[0]))]
        out["micro_batch_tokens"] = tokens
        print(f"{'':28s} micro-batch tokens {' / '.join(f'{t:.0f}' for t in tokens)}", flush=True)
    keep_spans, keep_idles = spans[1:] or spans, idles[1:] or idles
    if keep_spans and len({len(x) for x in keep_spans}) == 1:
        on = [statistics.median(x[i] for x in keep_spans) for i in range(len(keep_spans[0]))]
        waits = [statistics.median(x[i] for x in keep_idles) for i in range(len(keep_idles[0]))]
        out["device_ms"], out["device_idle_before_ms"] = on, waits
        print(
            f"{'':28s} device: micro-batches {' / '.join(f'{t:.1f}' for t in on)} ms, idle before each "
            f"{' / '.join(f'{t:.1f}' for t in waits)} ms",
            flush=True,
        )
    return out


def client_side(timeline: list[dict[str, Any]], events: list[Event]) -> dict[str, Any]:
    """Where the plain client's rounds (client.py's --timeline) go outside the server's span: from the
    round's start to the first body parsed at the server, and from the last answer rendered to the
    round's end, with the client's own steps (posting the bodies: json.dumps; parsing the last
    answer: json.loads). Medians, ms; printed under the variant's lines."""
    rows = []
    for r in timeline:
        inside = [e for e in events if r["start"] <= e[1] <= r["end"]]
        parses = [e[1] for e in inside if e[0] == "parse"]
        renders = [e[2] for e in inside if e[0] == "render"]
        if not parses or not renders:
            continue
        posted = [q[0] for q in r["requests"]]
        last = max(r["requests"], key=lambda q: q[2])
        rows.append(
            (
                (min(parses) - r["start"]) * 1e3,
                (max(posted) - min(posted)) * 1e3,
                (r["end"] - max(renders)) * 1e3,
                (last[1] - max(renders)) * 1e3,
                (last[2] - last[1]) * 1e3,
            )
        )
    names = (
        "to_first_parse_ms",
        "posting_ms",
        "after_last_render_ms",
        "last_read_after_render_ms",
        "last_parse_ms",
    )
    if not rows:
        return {}
    med: dict[str, Any] = dict(
        zip(names, (statistics.median(x[i] for x in rows) for i in range(len(names))), strict=True)
    )
    med |= arrivals(timeline, events)
    print(
        f"{'':28s} client: round start to the first body parsed {med['to_first_parse_ms']:.2f} ms "
        f"(posting all {med['posting_ms']:.2f} ms) | last answer rendered to round end "
        f"{med['after_last_render_ms']:.2f} ms (read after {med['last_read_after_render_ms']:.2f}, "
        f"parsed in {med['last_parse_ms']:.2f})",
        flush=True,
    )
    return med


def arrivals(timeline: list[dict[str, Any]], events: list[Event]) -> dict[str, list[float]]:
    """When, from the round's start, the k-th request was posted by the client (`posted_ms`: its task
    called post), was first written to its socket (`sent_ms`), reached the app (`headers_ms`), had
    its whole body read (`body_ms`), began to be parsed (`parse_start_ms`) and was normalised
    (`normalised_ms`), and when the k-th micro-batch's launch began (`launch_ms`): per k, the median
    over the rounds after the first."""
    per: dict[str, list[list[float]]] = {}
    for r in timeline[1:] or timeline:
        inside = [e for e in events if r["start"] <= e[1] <= r["end"]]
        times = {
            "posted_ms": [q[0] for q in r["requests"]],
            "sent_ms": list(r.get("sent", [])),
            "headers_ms": [e[1] for e in inside if e[0] == "headers"],
            "body_ms": [e[1] for e in inside if e[0] == "body"],
            "parse_start_ms": [e[1] for e in inside if e[0] == "parse"],
            "normalised_ms": [e[2] for e in inside if e[0] == "normalise"],
            "launch_ms": [e[1] for e in inside if e[0] == "launch"],
        }
        for name, values in times.items():
            per.setdefault(name, []).append(sorted((t - r["start"]) * 1e3 for t in values))
    out: dict[str, list[float]] = {}
    for name, rows in per.items():
        if rows and len({len(x) for x in rows}) == 1:
            out[name] = [round(statistics.median(x[i] for x in rows), 2) for i in range(len(rows[0]))]
    if out:
        print(f"{'':28s} arrivals: {out}", flush=True)
    return out


def in_process(
    engine: PackedScorer, settings: Settings, requests: list[list[SequenceJob]], reps: int
) -> None:
    """`reps` rounds (after a warm-up) of `requests` submitted at once to a batcher of `settings`."""
    loop = asyncio.new_event_loop()
    batcher = Batcher.from_settings(engine, settings, Metrics())

    async def round_of_requests() -> None:
        await asyncio.gather(*(batcher.score(r) for r in requests))

    loop.call_soon(batcher.start)
    for _ in range(reps + 1):
        start = time.perf_counter()
        loop.run_until_complete(round_of_requests())
        EVENTS.append(("start", start, start))
        time.sleep(0.1)
    loop.run_until_complete(batcher.stop())
    loop.close()


def in_process_budgets(
    engine: PackedScorer,
    settings: Settings,
    requests: list[list[SequenceJob]],
    budgets: list[int],
    *,
    reps: int,
    marks: GpuMarks | None,
) -> dict[str, Any]:
    """`in_process` under each budget: its summary, or with several budgets one per
    "max_batch_tokens=N"."""
    out: dict[str, Any] = {}
    for budget in budgets:
        EVENTS.clear()
        in_process(engine, settings.model_copy(update={"max_batch_tokens": budget}), requests, reps)
        label = "engine in-process" + ("" if len(budgets) == 1 else f", max_batch_tokens={budget}")
        measured = summary(label, EVENTS, 1, marks)
        if len(budgets) == 1:
            return measured
        out[f"max_batch_tokens={budget}"] = measured
    return out


@contextlib.contextmanager
def recording_server(events: list[Event]) -> Iterator[None]:
    """Within: the app records each request's arrival (`received`) and the route its parse,
    normalise and render (`recorded`), within a render each block written as nested lists ("lists
    <field>"), and a streamed completions answer's choices (`recorded_choices`) into `events`; the
    originals are back after."""
    steps = {"parse_json": "parse", "parse_frame": "parse", "normalise": "normalise"}
    steps |= {"json_parts": "render", "to_frame": "render"}
    saved = {name: getattr(api, name) for name in steps}
    choice_stream = completions_response.choice_stream
    lists = dict(answer_layout.LISTS)
    create_app = server.create_app  # type: ignore[attr-defined]
    server.create_app = received(events, create_app)  # type: ignore[attr-defined]
    for name, what in steps.items():
        setattr(api, name, recorded(events, what, saved[name]))
    completions_response.choice_stream = recorded_choices(events, choice_stream)
    answer_layout.LISTS.update({name: recorded(events, f"lists {name}", fn) for name, fn in lists.items()})
    try:
        yield
    finally:
        server.create_app = create_app  # type: ignore[attr-defined]
        completions_response.choice_stream = choice_stream
        answer_layout.LISTS.update(lists)
        for name, fn in saved.items():
            setattr(api, name, fn)


def recorded_choices(
    events: list[Event], choice_stream: Callable[..., Iterator[bytes]]
) -> Callable[..., Iterator[bytes]]:
    """A streamed completions answer's choice_stream recording its check and submission ("choice
    <i>") and each chunk taken from it ("chunk <i>": the wait for its block's render)."""

    def wrapper(plan: Any, i: int, *args: Any, **kwargs: Any) -> Iterator[bytes]:
        start = time.perf_counter()
        chunks = choice_stream(plan, i, *args, **kwargs)
        events.append((f"choice {i}", start, time.perf_counter()))

        def taken() -> Iterator[bytes]:
            while True:
                began = time.perf_counter()
                chunk = next(chunks, None)
                if chunk is None:
                    return
                events.append((f"chunk {i}", began, time.perf_counter()))
                yield chunk

        return taken()

    return wrapper


def over_http(
    engine: PackedScorer,
    settings: Settings,
    samples: list[Sample],
    args: argparse.Namespace,
    marks: GpuMarks | None,
) -> dict[str, Any]:
    """The rounds of each of `args.clients` against the real app of `settings` on loopback: each
    one's `summary`, its client round and (plain) `client_side`."""
    out: dict[str, Any] = {}
    with HttpServer(engine, settings) as url:
        for name in args.clients:
            frames, mode = CLIENTS[name]
            bodies = http_bodies(samples, frames=frames)
            EVENTS.clear()
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / "timeline.json" if mode == "plain" else None
                rounds_s = http_rounds(url, bodies, args.reps, mode, frames, timeline=path)
                seconds = statistics.median(rounds_s)
                timeline = json.loads(path.read_text()) if path is not None else []
            label = f"http {'frames' if frames else 'JSON'}, client {mode}"
            out[name] = summary(label, EVENTS, len(bodies), marks) | {"client_round_ms": seconds * 1e3}
            print(f"{'':28s} client round {seconds * 1e3:.1f} ms", flush=True)
            out[name] |= client_side(timeline, EVENTS)
    return out


def arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen2.5-0.5b")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--switch-interval", type=float, default=None)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--cuda-graphs", default="auto", choices=get_args(CudaGraphs))
    parser.add_argument("--launch-hold-ms", type=float, nargs="+", default=[Settings().launch_hold_ms])
    parser.add_argument("--batch-wait-ms", type=float, nargs="+", default=[Settings().batch_wait_ms])
    parser.add_argument("--max-batch-tokens", type=int, nargs="+", default=[BATCH_TOKENS])
    parser.add_argument("--workload", choices=list(WORKLOADS), default="standard")
    parser.add_argument("--scale", type=float, default=1.0, help="every length x this (a CPU smoke test)")
    every = ["frames", "frames-httpcore", "json", "processes"]
    parser.add_argument("--clients", nargs="+", choices=list(CLIENTS), default=every)
    parser.add_argument("--output", type=Path, default=RESULTS / "overhead-latest.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    device = torch.device(args.device)
    settings = Settings(
        device=device.type,
        dtype="bfloat16" if device.type == "cuda" else "float32",
        cuda_graphs=args.cuda_graphs,
        max_batch_tokens=max(args.max_batch_tokens),
        prefix_cache=CACHE_IN_ROUNDS,
    )
    backend, _, model = packed_model(dict(SHAPES[args.model]), getattr(torch, settings.dtype), device)
    engine = PackedScorer(
        LoadedModel(model, args.model, demo=False), device, backend, settings.engine_config()
    )
    engine.warm_up()
    marks: GpuMarks | None = {} if device.type == "cuda" else None
    engine.launch = recorded_launches(EVENTS, engine.launch, marks)  # type: ignore[method-assign,assignment]
    samples = WORKLOADS[args.workload](int(SHAPES[args.model]["vocab_size"]), args.scale)
    the_jobs = jobs(samples)
    per = len(the_jobs) // 8 or 1
    requests = [the_jobs[i : i + per] for i in range(0, len(the_jobs), per)]
    budgets = args.max_batch_tokens
    results: dict[str, Any] = {
        **provenance("probes.overhead", device, argv),
        "settings": {k: str(v) for k, v in vars(args).items()},
        "in_process": in_process_budgets(engine, settings, requests, budgets, reps=args.reps, marks=marks),
        "http": {},
    }

    with recording_server(EVENTS):
        for hold, wait, budget in itertools.product(args.launch_hold_ms, args.batch_wait_ms, budgets):
            named = (
                f"launch_hold_ms={hold:g}"
                + ("" if len(args.batch_wait_ms) == 1 else f",batch_wait_ms={wait:g}")
                + ("" if len(budgets) == 1 else f",max_batch_tokens={budget}")
            )
            print(f"== {named}", flush=True)
            held = settings.model_copy(
                update={"launch_hold_ms": hold, "batch_wait_ms": wait, "max_batch_tokens": budget}
            )
            results["http"][named] = over_http(engine, held, samples, args, marks)
    write_result(args.output, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The weight-push soak: scoring goes on, concurrently, while a trainer pushes new weights every few
seconds, and no answer is wrong for the version it names.

    python -m benchmarks.push_soak --model qwen2.5-1.5b --seconds 150 --every-s 5
                                    # a host of 2 GPUs: trainer on GPU 0 (this process), server on 1
    python -m benchmarks.push_soak --model tiny --device cpu --dtype float32 --backend gloo \\
        --seconds 6 --every-s 2 --clients 3 --probe-tokens 32 256    # CPU smoke test (tests/benchmarks)
    python -m benchmarks.push_soak --model qwen2.5-1.5b --backend gloo --trainer-gpu 0 --server-gpu 0 \\
        --stages 2 --seconds 25                      # one GPU; two pipeline stages, a group each

A real `python -m service serve --batch-invariant` (benchmarks/push.py's `server`) serves version
soak-0 of this process's model (random weights of --model's shape). --clients threads post, for the
whole soak, a fixed set of --probes requests (1-4 rows each of --probe-tokens lengths, as compact
frames), each answer's rows kept as digests of their float32 log-prob bytes. Every --every-s seconds
the trainer perturbs its weights and pushes them with the client's `WeightPusher` (--mode swap: the
default; or copy) as version soak-<n>; with --stages N, as a pipeline-parallel trainer's N stages
push: N pushers, a group each, each pushing its layers (commit=False) at the same time, and the
version serves when the last of them is in. Once it serves, each probe request is asked once pinned to
it (`weights_version`): its canonical scores. Batch-invariant mode makes scores independent of the
batch, so each answer must equal its version's canonical scores bit for bit (benchmarks/soak_check.py:
what fails the soak). Exit status 1 on any failure.

Reported (--output, with the harness's provenance): the pushes (seconds; the server's scoring pause
of each, logprobd_weights_pause_seconds, against the 50 ms target), the answers checked per version,
the failures, and the clients' view during pushes against between them: answers and tokens per
second, answer latency, the longest stretch without an answer.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from benchmarks import push
from benchmarks.client import FRAME_HEADERS
from benchmarks.harness import provenance, write_result
from benchmarks.soak_check import Answer, Checker, PushWindow, Rows, summary, timeline
from service.client import LogprobdError, WeightPusher
from service.client.wire import to_frame
from service.wire.frame import unpack

PAUSE_TARGET_MS = 50.0  # issue 51: scoring pauses at most this long for a swap push
HEADERS = {**push.HEADERS, **FRAME_HEADERS}


@dataclass(frozen=True, slots=True)
class Probe:
    """One request the scorers send: rows of random token ids, each scoring its last num_actions."""

    fields: dict[str, Any]  # input_ids, num_actions
    frame: bytes
    tokens: int

    def pinned(self, version: str) -> bytes:
        frame = to_frame({**self.fields, "weights_version": version})
        assert frame is not None
        return frame


def probes(count: int, low: int, high: int, vocab: int, seed: int = 0) -> list[Probe]:
    """`count` requests of 1-4 rows, each of a length drawn log-uniformly from [low, high]."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        lengths = [round(low * (high / low) ** rng.random()) for _ in range(rng.randint(1, 4))]
        rows = [[rng.randrange(vocab) for _ in range(n)] for n in lengths]
        fields = {"input_ids": rows, "num_actions": [rng.randint(max(1, n // 8), n // 2) for n in lengths]}
        frame = to_frame(fields)
        assert frame is not None
        out.append(Probe(fields, frame, sum(lengths)))
    return out


def ask(http: httpx.Client, url: str, body: bytes) -> tuple[int, str | None, Rows, str | None]:
    """POST /logprobs of a frame: the status (0: no answer, or one that does not read), the answer's
    weights_version, a digest of each row's float32 log-probs, and the error's text."""
    try:
        reply = http.post(f"{url}/logprobs", content=body)
        if reply.status_code != 200:
            return reply.status_code, None, (), reply.text[:300]
        frame = unpack(reply.content)
        version = json.loads(frame.fields).get("weights_version")
        spec, data = frame.arrays["logprobs"]
        if spec.dtype != "f4":
            raise ValueError(f"logprobs in {spec.dtype}, not f4")
    except Exception as exc:  # an error of the soak, reported with the others
        return 0, None, (), f"{type(exc).__name__}: {exc}"
    rows, at = [], 0
    for n in spec.lengths:
        rows.append(hashlib.blake2b(data[at : at + 4 * n], digest_size=16).digest())
        at += 4 * n
    return 200, version, tuple(rows), None


class Scorers:
    """`clients` threads, each with its own connection, posting the probes in a random order of its
    own until stopped; every answer goes to `checker` and `answers`."""

    def __init__(
        self, url: str, probes: list[Probe], clients: int, checker: Checker, timeout_s: float
    ) -> None:
        self.answers: list[Answer] = []
        self._url, self._probes, self._checker, self._timeout_s = url, probes, checker, timeout_s
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> float:
        """Stop them (the requests in flight are answered and kept); when they were told to stop."""
        told = time.perf_counter()
        self._stop.set()
        for thread in self._threads:
            thread.join()
        return told

    def _run(self, client: int) -> None:
        rng = random.Random(1000 + client)
        with httpx.Client(headers=HEADERS, timeout=self._timeout_s) as http:
            while not self._stop.is_set():
                index = rng.randrange(len(self._probes))
                sent = time.perf_counter()
                status, version, rows, error = ask(http, self._url, self._probes[index].frame)
                answer = Answer(
                    index, sent, time.perf_counter(), status, version, rows, self._probes[index].tokens, error
                )
                self.answers.append(answer)
                self._checker.add(answer)


def canonical(http: httpx.Client, url: str, probes: list[Probe], version: str, checker: Checker) -> None:
    """Each probe once, pinned to `version` (the version just served): its canonical rows."""
    rows = []
    for index, probe in enumerate(probes):
        status, got, digests, error = ask(http, url, probe.pinned(version))
        if status != 200 or got != version:
            checker.fail(f"canonical probe {index} pinned to {version!r}: {status} {got!r} {error}")
            return
        rows.append(digests)
    checker.know(version, rows)


def stage_tensors(model: Any, stages: int) -> list[list[tuple[str, Any]]]:
    """`model`'s named parameters as `stages` pipeline stages hold them: decoder layer k on stage
    k * stages // layers, what comes before the layers (the embeddings) on the first, what comes after
    (the final norm, the head) on the last."""
    named = list(model.named_parameters())
    layer = re.compile(r"\.layers\.(\d+)\.")
    indices = [int(m.group(1)) if (m := layer.search(name)) else None for name, _ in named]
    layers = 1 + max(i for i in indices if i is not None)
    parts: list[list[tuple[str, Any]]] = [[] for _ in range(stages)]
    seen_layer = False
    for (name, tensor), index in zip(named, indices, strict=True):
        seen_layer = seen_layer or index is not None
        stage = index * stages // layers if index is not None else (stages - 1 if seen_layer else 0)
        parts[stage].append((name, tensor))
    return parts


def push_stages(pushers: Sequence[WeightPusher], model: Any, version: str, mode: str) -> float:
    """Push `model` as `version`: with one pusher, a plain push; with several, each its stage's
    tensors at the same time, uncommitted (the version serves when every stage's are in). Its
    seconds (the slowest stage's); LogprobdError: a stage failed."""
    if len(pushers) == 1:
        return pushers[0].push(model, version=version, mode=mode).seconds
    parts = stage_tensors(model, len(pushers))
    with ThreadPoolExecutor(len(pushers), thread_name_prefix="soak-stage") as stages:
        futures = [
            stages.submit(p.push, part, version=version, mode=mode, commit=False)
            for p, part in zip(pushers, parts, strict=True)
        ]
        results = [f.result() for f in futures]
    return max(r.seconds for r in results)


def pushes(
    args: argparse.Namespace,
    http: httpx.Client,
    url: str,
    *,
    pushers: Sequence[WeightPusher],
    model: Any,
    probes: list[Probe],
    checker: Checker,
    began: float,
) -> list[PushWindow]:
    """A push at every --every-s from `began` before --seconds pass, each then made canonical; returns
    once --seconds passed."""
    windows = []
    step = 1
    while step * args.every_s < args.seconds:
        version = f"soak-{step}"
        push.perturb(model, step)
        time.sleep(max(0.0, began + step * args.every_s - time.perf_counter()))
        checker.pushed(version)
        paused, applies = push.pauses(http, url)
        started = time.perf_counter()
        try:
            seconds, error = push_stages(pushers, model, version, args.mode), None
        except LogprobdError as exc:
            seconds, error = float("nan"), str(exc)
        ended = time.perf_counter()
        paused_after, applies_after = push.pauses(http, url)
        window = PushWindow(
            version, started, ended, seconds, paused_after - paused, applies_after - applies, error
        )
        windows.append(window)
        if error is None:
            canonical(http, url, probes, version, checker)
        else:
            checker.fail(f"push {version}: {error}")
        step += 1
    time.sleep(max(0.0, began + args.seconds - time.perf_counter()))
    return windows


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.push_soak", description=__doc__.split("\n")[0]
    )
    push.common_arguments(parser, model="qwen2.5-1.5b", output="push-soak-latest.json")
    parser.add_argument("--seconds", type=float, default=150, help="how long the scorers run")
    parser.add_argument("--every-s", type=float, default=5, help="a push every this many seconds")
    parser.add_argument("--mode", default="swap", choices=["swap", "copy"])
    parser.add_argument("--load-format", default="flattened", choices=["flattened", "per-tensor"])
    parser.add_argument(
        "--stages", type=int, default=1,
        help="push as a trainer of this many pipeline stages: a pusher and group each, at once",
    )  # fmt: skip
    parser.add_argument("--clients", type=int, default=6, help="concurrent scoring threads")
    parser.add_argument("--probes", type=int, default=16, help="distinct requests the clients send")
    parser.add_argument(
        "--probe-tokens", type=int, nargs=2, default=[256, 4096], metavar=("MIN", "MAX"),
        help="each row's length, drawn log-uniformly",
    )  # fmt: skip
    parser.add_argument("--answer-timeout-s", type=float, default=120)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    device, model = push.trainer(args)
    low, high = args.probe_tokens
    asked = probes(args.probes, low, high, int(model.config.vocab_size))
    checker = Checker()
    with tempfile.TemporaryDirectory(dir=args.save_dir) as tmp:
        model.save_pretrained(Path(tmp) / "soak-0")
        served = push.server(Path(tmp) / "soak-0", args, version="soak-0", extra=["--batch-invariant"])
        with (
            served as url,
            httpx.Client(headers=HEADERS, timeout=args.answer_timeout_s) as http,
            ExitStack() as held,
        ):
            pushers = [held.enter_context(stage_pusher(url, args, stage)) for stage in range(args.stages)]
            assert http.get(f"{url}/info").json()["batch_invariant"] is True
            checker.pushed("soak-0")
            canonical(http, url, asked, "soak-0", checker)  # also the warm-up of every shape
            for pusher in pushers:
                pusher.connect()
            scorers = Scorers(url, asked, args.clients, checker, args.answer_timeout_s)
            began = time.perf_counter()
            scorers.start()
            try:
                windows = pushes(
                    args, http, url, pushers=pushers, model=model, probes=asked, checker=checker, began=began
                )
            finally:
                ended = scorers.stop()
    verdict = checker.finish()
    result = {**provenance("push_soak", device, argv, gpus=push.gpus(args)), "settings": settings(args)}
    scoring = timeline(scorers.answers, windows, began, ended)
    result.update(summary(verdict, windows, scoring, ended - began, PAUSE_TARGET_MS))
    write_result(args.output, result)
    report(args, result)
    return 0 if result["ok"] else 1


def stage_pusher(url: str, args: argparse.Namespace, stage: int) -> WeightPusher:
    """The pusher of pipeline stage `stage` (of --stages), over a group of its own (one stage: the
    client's default group)."""
    named: dict[str, Any] = {"group_name": f"soak-pp_{stage}"} if args.stages > 1 else {}
    return WeightPusher(
        url,
        admin_key=push.ADMIN,
        backend=args.backend,
        bucket_bytes=int(args.bucket_mib * 2**20),
        load_format="flattened_bucket" if args.load_format == "flattened" else None,
        timeout_s=args.push_timeout_s,
        **named,
    )


def settings(args: argparse.Namespace) -> dict[str, Any]:
    keys = "model dtype backend bucket_mib mode load_format stages seconds every_s clients probes"
    return {key: getattr(args, key) for key in [*keys.split(), "probe_tokens", "push_timeout_s"]}


def report(args: argparse.Namespace, result: dict[str, Any]) -> None:
    answers, pause, done = result["answers"], result["pause"], result["pushes"]
    for failure in result["failures"]:
        print(f"FAILED: {failure}")
    print(
        f"{args.model} {args.dtype}, batch-invariant, {args.clients} clients, a {args.mode} push "
        f"({args.stages} stage{'s' if args.stages > 1 else ''}) every "
        f"{args.every_s:g} s for {result['soak_s']:.0f} s: {'ok' if result['ok'] else 'FAILED'}"
    )
    during, between = result["scoring"]["during_pushes"], result["scoring"]["between_pushes"]

    def cell(value: float | None, digits: int = 1) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    print("| soak | |\n| --- | ---: |")
    print(f"| pushes done (failed) | {done['done']} ({done['failed']}) |")
    print(f"| push s, p50 / max | {cell(done['push_s_p50'], 2)} / {cell(done['push_s_max'], 2)} |")
    print(f"| scoring pause ms, p50 / max (target {pause['target_ms']:g}) | {cell(pause['p50_ms'], 2)} / "
          f"{cell(pause['max_ms'], 2)} |")  # fmt: skip
    print(f"| answers checked bitwise (versions) | {answers['checked']} ({len(answers['per_version'])}) |")
    print(
        f"| errors / mismatched / unknown version / unchecked | {answers['errors']} / "
        f"{answers['mismatched']} / {answers['unknown_version']} / {answers['unchecked']} |"
    )
    print("\n| scoring | during pushes | between pushes |\n| --- | ---: | ---: |")
    for label, key, digits in (
        ("answers/s", "answers_per_s", 1),
        ("tokens/s", "tokens_per_s", 0),
        ("latency ms, p50", "latency_ms_p50", 1),
        ("latency ms, max", "latency_ms_max", 1),
        ("longest gap between answers, ms", "longest_gap_ms", 1),
    ):
        print(f"| {label} | {cell(during[key], digits)} | {cell(between[key], digits)} |")


if __name__ == "__main__":
    raise SystemExit(main())

"""The host's cost of the JSON forms of routes and distributions against frames, stage by stage (no GPU).

    python -m benchmarks.probes.json_forms [--parts routes distributions] [--k 100 1000] [--reps 3]

A round is 8 requests of 8 rows sent at once (benchmarks.replay's and benchmarks.distribution's);
each figure is the least CPU time of --reps, in ms, summed over the round's 8 requests, each stage timed
alone in this process:

- routes: the standard workload (64 sequences, 56,229 positions) with random distinct routes of
  Qwen3-30B-A3B's shape (48 sparse layers, 128 experts, top-8) at every position. `live` is the
  plain request; `replay_<form>` sends the routes (`routed_experts`), `record_<form>` asks them back
  (`return_routed_experts`, `routed_experts_format` <form>), in the forms `base64` (SGLang's
  strings), `lists` (nested lists) and `frames` (logprobd's client, u1 arrays). Stages:
  client_encode (a plain client's `json=`: json.dumps as httpx 0.28 does it; frames: the client's
  wire.to_frame of numpy rows), parse (jsonrows.parse_json / arrays.parse_frame), normalise, answer
  (layout.answer + json_parts, the parts the server sends unjoined / to_frame), client_decode (a
  plain client's `response.json()` of the joined parts, json.loads;
  frames: from_frame + Scores) and client_arrays (logprobd's client: Scores.from_body and
  Scores.routed_experts, int64 arrays).
- distributions: GRPO 8 x 8 (grpo_short, 14,737 actions, vocabulary 151,936), every action asking
  `top_logprobs` K: `plain` (no K), and K in the forms `lists` (nested JSON lists), `base64`
  (`distribution_format: "base64"`) and `frames`. Stages: answer, encode, client_decode (lists:
  json.loads; base64: json.loads and every row decoded as docs/api.md shows; frames: from_frame +
  Scores), client_arrays (JSON: logprobd's Scores.from_body of the parsed body).

`extra_server` / `extra_client`: the form's server stages (parse + normalise + answer) and client
stages (client_encode + client_decode) over the plain request's. Figures go to stdout as JSON.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, TypeVar

import numpy as np
import orjson

from benchmarks.probes.routes_host import MOE, routes
from benchmarks.workload import Sample, grpo_short, host_info, workload
from service.answer.layout import answer, json_parts
from service.client.wire import Scores, from_frame
from service.client.wire import to_frame as client_frame
from service.core.jobs import SequenceScores
from service.normalise import ModelLimits, ScoringPlan, normalise
from service.wire.arrays import parse_frame, to_frame
from service.wire.jsonrows import parse_json
from service.wire.schemas import LogprobsRequest

VOCAB = 151_936
ROWS_PER_REQUEST = 8
VERSIONS = {"policy": "v"}
ROUTE_LIMITS = ModelLimits(vocab_size=VOCAB, max_sequence_tokens=32_768, moe=MOE)
INFO = host_info(VOCAB, MOE)


def best_ms(fn: Callable[[], object], reps: int) -> float:
    """The least CPU time of this process over `reps` calls, ms (CPU time, not wall: steadier on a
    shared machine, where other work takes the cores; every stage here runs on one thread)."""
    times = []
    for _ in range(reps):
        began = time.process_time()
        fn()
        times.append(time.process_time() - began)
    return min(times) * 1e3


def httpx_json(body: Any) -> bytes:
    """httpx 0.28's `json=` encoding."""
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8")


def groups(samples: list[Sample]) -> list[list[Sample]]:
    return [samples[i : i + ROWS_PER_REQUEST] for i in range(0, len(samples), ROWS_PER_REQUEST)]


def plain_body(group: list[Sample]) -> dict[str, Any]:
    return {"input_ids": [s.tokens for s in group], "num_actions": [len(s.response) for s in group]}


def b64(array: np.ndarray, dtype: str) -> str:
    return base64.b64encode(np.ascontiguousarray(array, dtype=dtype).tobytes()).decode("ascii")


T = TypeVar("T")


class Stages:
    """Each stage's ms summed over a round's requests."""

    def __init__(self, reps: int) -> None:
        self.reps = reps
        self.figures: dict[str, dict[str, float]] = {}

    def time(self, variant: str, stage: str, fn: Callable[[T], object], items: Sequence[T]) -> None:
        """fn of each request's item, timed alone: the sum of their best."""
        total = sum(best_ms(partial(fn, item), self.reps) for item in items)
        self.figures.setdefault(variant, {})[stage] = round(total, 2)


SERVER = ("parse", "normalise", "answer")
CLIENT = ("client_encode", "client_decode")


def extras(figures: dict[str, dict[str, float]], baseline: str) -> None:
    """extra_server / extra_client of every variant over `baseline`'s."""
    base = figures[baseline]
    for name, f in figures.items():
        if name == baseline:
            continue
        for key, stages in (("extra_server", SERVER), ("extra_client", CLIENT)):
            f[key] = round(sum(f.get(s, 0.0) - base.get(s, 0.0) for s in stages if s in f), 2)


def _route_scores(plan: ScoringPlan, given: Sequence[np.ndarray | None]) -> list[SequenceScores]:
    return [
        SequenceScores(logprobs=np.zeros(job.actions.shape[0], dtype=np.float32), entropy=None, routes=r)
        for job, r in zip(plan.jobs, given, strict=True)
    ]


Answered = tuple[ScoringPlan, list[SequenceScores]]


def _json_write(routes: str, distribution: str) -> Callable[[Answered], list[bytes]]:
    """The server's write of a JSON answer: its parts, sent unjoined (router.py)."""

    def write(scored: Answered) -> list[bytes]:
        return json_parts(answer(*scored, INFO, VERSIONS), routes=routes, distribution=distribution)

    return write


def _json_answer(routes: str, distribution: str) -> Callable[[Answered], bytes]:
    """The JSON answer a client receives: the server's parts, joined."""
    write = _json_write(routes, distribution)
    return lambda scored: b"".join(write(scored))


def _frame_answer(scored: Answered) -> bytes:
    return to_frame(answer(*scored, INFO, VERSIONS))


def _frame_scores(raw: bytes) -> Scores:
    return Scores.from_body(from_frame(raw))


def _json_scores(raw: bytes) -> Scores:
    return Scores.from_body(json.loads(raw))


def _frame_routes(raw: bytes) -> object:
    return _frame_scores(raw).routed_experts


def _json_routes(raw: bytes) -> object:
    return _json_scores(raw).routed_experts


def _normalise_routed(request: LogprobsRequest) -> ScoringPlan:
    return normalise(request, ROUTE_LIMITS)


def route_figures(reps: int, forms: Sequence[str]) -> dict[str, dict[str, float]]:
    """live, replay_<form> and record_<form> over the standard workload's 8 requests."""
    rng = np.random.default_rng(0)
    batches = groups(workload(VOCAB, sequences=64))
    given = [[routes(len(s.tokens), rng) for s in g] for g in batches]
    plain = [plain_body(g) for g in batches]
    st = Stages(reps)
    raw = [httpx_json(b) for b in plain]
    requests = [parse_json(r) for r in raw]
    plans = [normalise(r, ROUTE_LIMITS) for r in requests]
    live = [(p, _route_scores(p, [None] * len(p.jobs))) for p in plans]
    st.time("live", "client_encode", httpx_json, plain)
    st.time("live", "parse", parse_json, raw)
    st.time("live", "normalise", _normalise_routed, requests)
    st.time("live", "answer", _json_write("lists", "lists"), live)
    st.time("live", "client_decode", json.loads, [_json_answer("lists", "lists")(a) for a in live])
    for form in forms:
        replay_form(st, form, plain, given)
        record_form(st, form, plain, given)
    extras(st.figures, "live")
    return st.figures


def replay_form(st: Stages, form: str, plain: list[dict[str, Any]], given: list[list[np.ndarray]]) -> None:
    name = f"replay_{form}"
    read: Callable[[bytes], LogprobsRequest] = parse_json
    if form == "frames":
        bodies = [{**b, "routed_experts": g} for b, g in zip(plain, given, strict=True)]
        st.time(name, "client_encode", client_frame, bodies)
        raw = [f for f in map(client_frame, bodies) if f is not None]
        read = parse_frame
    else:
        sent = [[b64(r, "<i4") if form == "base64" else r.tolist() for r in g] for g in given]
        bodies = [{**b, "routed_experts": s} for b, s in zip(plain, sent, strict=True)]
        st.time(name, "client_encode", httpx_json, bodies)
        raw = [httpx_json(b) for b in bodies]
    st.figures[name]["request_mb"] = round(sum(map(len, raw)) / 1e6, 1)
    st.time(name, "parse", read, raw)
    st.time(name, "normalise", _normalise_routed, [read(r) for r in raw])


def record_form(st: Stages, form: str, plain: list[dict[str, Any]], given: list[list[np.ndarray]]) -> None:
    name = f"record_{form}"
    asked = {"return_routed_experts": True, "routed_experts_format": "lists" if form == "frames" else form}
    plans = [normalise(parse_json(httpx_json({**b, **asked})), ROUTE_LIMITS) for b in plain]
    scored = [(p, _route_scores(p, g)) for p, g in zip(plans, given, strict=True)]
    st.time(name, "answer", _frame_answer if form == "frames" else _json_write(form, "lists"), scored)
    write = _frame_answer if form == "frames" else _json_answer(form, "lists")
    written = [write(a) for a in scored]
    st.figures[name]["answer_mb"] = round(sum(map(len, written)) / 1e6, 1)
    if form == "frames":
        st.time(name, "client_decode", _frame_scores, written)
        st.time(name, "client_arrays", _frame_routes, written)
        got = _frame_scores(written[0])
    else:
        st.time(name, "client_decode", json.loads, written)
        st.time(name, "client_arrays", _json_routes, written)
        got = _json_scores(written[0])
    assert all(np.array_equal(a, b) for a, b in zip(got.routed_experts or [], given[0], strict=True))


def _top_scores(plan: ScoringPlan, k: int, rng: np.random.Generator) -> list[SequenceScores]:
    out = []
    for job in plan.jobs:
        n = int(job.actions.shape[0])
        ids = ((rng.integers(0, VOCAB, size=(n, 1)) + np.arange(k) * 7919) % VOCAB).astype(np.int32)
        lps = -np.cumsum(rng.exponential(0.05, size=(n, k)), axis=1).astype(np.float32)
        out.append(
            SequenceScores(
                logprobs=lps[:, 0].copy(),
                entropy=None,
                top_ids=ids,
                top_logprobs=lps,
                ranks=rng.integers(1, 50, size=n),
            )
        )
    return out


def decode_compact(raw: bytes) -> dict[str, list[np.ndarray]]:
    """A plain client's read of a `distribution_format: "base64"` answer: json.loads, then each row
    decoded as docs/api.md's snippet does."""
    body = json.loads(raw)
    dtypes = {"top_ids": "<i4", "top_logprobs": "<f4", "candidate_logprobs": "<f4"}
    return {
        name: [np.frombuffer(base64.b64decode(row), dtypes[name]).reshape(-1, k) for row in body[name]]
        for name, k in body["columns"].items()
    }


def distribution_figures(reps: int, k: int, forms: Sequence[str]) -> dict[str, dict[str, float]]:
    """plain and top_logprobs K in each form over GRPO 8 x 8's 8 requests."""
    batches = groups(grpo_short(VOCAB))
    limits = ModelLimits(vocab_size=VOCAB, max_sequence_tokens=4096, max_top_logprobs=1024)
    st = Stages(reps)
    rng = np.random.default_rng(0)
    plain = [plain_body(g) for g in batches]
    plain_plans = [normalise(parse_json(httpx_json(b)), limits) for b in plain]
    top_plans = [normalise(parse_json(httpx_json({**b, "top_logprobs": k})), limits) for b in plain]
    top = [_top_scores(p, k, rng) for p in top_plans]
    plain_scored = [
        (p, [SequenceScores(logprobs=s.logprobs, entropy=None) for s in t])
        for p, t in zip(plain_plans, top, strict=True)
    ]
    lists = _json_answer("lists", "lists")
    st.time("plain", "answer", _json_write("lists", "lists"), plain_scored)
    st.time("plain", "client_decode", json.loads, [lists(a) for a in plain_scored])
    for form in forms:
        name = f"top{k}_{form}"
        asked = {"top_logprobs": k} | ({"distribution_format": "base64"} if form == "base64" else {})
        plans = [normalise(parse_json(httpx_json({**b, **asked})), limits) for b in plain]
        scored = list(zip(plans, top, strict=True))
        st.time(name, "answer", _frame_answer if form == "frames" else _json_write("lists", form), scored)
        write = _frame_answer if form == "frames" else _json_answer("lists", form)
        written = [write(a) for a in scored]
        st.figures[name]["answer_mb"] = round(sum(map(len, written)) / 1e6, 1)
        if form == "frames":
            st.time(name, "client_decode", _frame_scores, written)
            got = _frame_scores(written[0])
        else:
            st.time(name, "client_decode", decode_compact if form == "base64" else json.loads, written)
            st.time(name, "client_arrays", _json_scores, written)
            got = _json_scores(written[0])
        want = [np.asarray(s.top_logprobs) for s in top[0]]
        assert all(np.array_equal(a, b) for a, b in zip(got.top_logprobs or [], want, strict=True))
    extras(st.figures, "plain")
    return st.figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.probes.json_forms", description=__doc__)
    parser.add_argument(
        "--parts", nargs="+", choices=["routes", "distributions"], default=["routes", "distributions"]
    )
    parser.add_argument(
        "--route-forms",
        nargs="+",
        choices=["frames", "base64", "lists"],
        default=["frames", "base64", "lists"],
    )
    parser.add_argument("--k", type=int, nargs="+", default=[100, 1000])
    parser.add_argument(
        "--distribution-forms",
        nargs="+",
        choices=["frames", "lists", "base64"],
        default=["frames", "lists", "base64"],
    )
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    results: dict[str, Any] = {}
    if "routes" in args.parts:
        results["routes"] = route_figures(args.reps, args.route_forms)
        print(
            orjson.dumps(results["routes"], option=orjson.OPT_INDENT_2).decode(), file=sys.stderr, flush=True
        )
    if "distributions" in args.parts:
        for k in args.k:
            results[f"top_logprobs_{k}"] = distribution_figures(args.reps, k, args.distribution_forms)
            print(
                orjson.dumps(results[f"top_logprobs_{k}"], option=orjson.OPT_INDENT_2).decode(),
                file=sys.stderr,
                flush=True,
            )
    print(orjson.dumps(results, option=orjson.OPT_INDENT_2).decode())
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Sequences far longer than a micro-batch, through the whole service, score equal to the
per-sequence float32 reference: chunk boundaries change nothing.

Tiny models whose positions are raised to LONG_POSITIONS, a budget of 64 tokens, and rows of
1,000+ tokens (each scored in ~20 chunks, each attending to the keys and values of the chunks
before it) beside short rows, in the same request and in concurrent ones; every architecture
(sliding windows, Gemma2's soft-capping and local layers, both decoders), every layout, with
temperature, entropy, an EOS policy and action windows spanning many chunks; the critic and the
reference policy; and the limits (413 past the longest sequence, 422 past the positions), a
cancelled and a failed long request.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from service.engine.batch.kv_store import KVContext
from tests.support import critics, models
from tests.support.device import TOLERANCE, VALUE_RTOL, eager, settings_for
from tests.support.launches import Served, serve
from tests.support.reference import (
    assert_values_close,
    check_reply,
    expected,
    max_diff,
    row_tokens_and_window,
)
from tests.support.requests import LAYOUTS, PAD, make
from tests.support.servers import Reply

LONG_POSITIONS = 1280
BUDGET = 64
LONG = (1000, 1100)  # a long row's real tokens


# --- checkpoints, servers ---


@pytest.fixture(scope="module")
def long_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("long-models")
    return {
        name: models.save(name, root / name, max_position_embeddings=LONG_POSITIONS)
        for name in models.ARCHITECTURES
    }


@pytest.fixture(scope="module")
def long_refs(long_dirs: dict[str, Path]) -> dict[str, Any]:
    return {name: eager(path) for name, path in long_dirs.items()}


@pytest.fixture(scope="module", params=models.ARCHITECTURES)
def served(request: pytest.FixtureRequest, long_dirs: dict[str, Path]) -> Iterator[tuple[str, Served]]:
    name = request.param
    with serve(settings_for(long_dirs[name], max_batch_tokens=BUDGET)) as s:
        yield name, s


# --- long requests in every layout ---


def _tokens(rng: random.Random, n: int, avoid: set[int]) -> list[int]:
    allowed = [t for t in range(models.VOCAB) if t not in avoid]
    return [rng.choice(allowed) for _ in range(n)]


def long_request(
    layout: str, rng: random.Random, lengths: list[int], eos: int | list[int] | None
) -> dict[str, Any]:
    """Rows of `lengths` real tokens in `layout`, action windows as long as the layout allows (a
    long row's spans many chunks). With `eos`, no token is an EOS but one put 70 % into each row's
    window, on an action, so the EOS policy ends the row's actions inside a chunk."""
    avoid = set([eos] if isinstance(eos, int) else eos or [])
    request: dict[str, Any]
    if layout.startswith("ragged"):
        ids = [_tokens(rng, n, avoid) for n in lengths]
        request = {"input_ids": ids}
        if layout == "ragged_num_actions":
            request["num_actions"] = [rng.randint(len(r) // 3, len(r) - 1) for r in ids]
        else:
            request["action_mask"] = [[0] + [int(rng.random() < 0.6) for _ in r[1:]] for r in ids]
    else:
        prompts, responses = [], []
        for n in lengths:
            p = rng.randint(max(1, n // 3), max(1, n // 2))
            prompts.append(_tokens(rng, p, avoid))
            responses.append(_tokens(rng, n - p, avoid))
        p_width = max(map(len, prompts))
        r_width = max(map(len, responses))
        ids, mask = [], []
        for k, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
            # a left-padded short row would leave padded_response_length a window of a few tokens
            side = rng.choice(["left", "right", "split"] if k == 0 else ["right", "split"])
            seq = prompt + response
            if side == "split":
                left, right = p_width - len(prompt), r_width - len(response)
            elif side == "left":
                left, right = p_width + r_width - len(seq), 0
            else:
                left, right = 0, p_width + r_width - len(seq)
            ids.append([PAD] * left + seq + [PAD] * right)
            mask.append([0] * left + [1] * len(seq) + [0] * right)
        request = {"input_ids": ids, "attention_mask": mask}
        width = p_width + r_width
        if layout == "padded_response_length":
            request["response_length"] = min(r_width, width - 1 - max(m.index(1) for m in mask))
        else:
            request["action_mask"] = [
                [int(m[c] == 1 and c != m.index(1) and rng.random() < 0.7) for c in range(1, width)]
                for m in mask
            ]
    if eos is not None:
        request["eos_token_id"] = eos
        stop = [eos] if isinstance(eos, int) else eos
        for i in range(len(lengths)):
            _, window = row_tokens_and_window(request, i)
            real = [k for k, p in enumerate(window) if p is not None]
            if not real:
                continue
            k = real[len(real) * 7 // 10]  # window entry k is column k + first of the row
            first = len(request["input_ids"][i]) - len(window)
            request["input_ids"][i][k + first] = rng.choice(stop)
            if "action_mask" in request:  # the mask's entries are columns 1.. of the row
                request["action_mask"][i][k + first - 1] = 1
    return request


def _spans_chunks(request: dict[str, Any], row: int, body: dict[str, Any]) -> bool:
    """Whether row `row`'s scored actions lie in several 64-token chunks."""
    _, window = row_tokens_and_window(request, row)
    scored = [p for p, m in zip(window, body["action_mask"][row], strict=True) if m and p is not None]
    return len(scored) > 0 and max(scored) - min(scored) > 3 * BUDGET


# layout -> (rows: "L" long, "s" short; EOS; entropy)
VARIANTS: dict[str, tuple[str, str | None, bool]] = {
    "ragged_num_actions": ("LsLs", None, True),
    "ragged_action_mask": ("sL", "int", True),
    "padded_response_length": ("Lss", "int", False),
    "padded_action_mask": ("Ls", "list", True),
}


def variant_request(layout: str, rng: random.Random) -> dict[str, Any]:
    rows, eos_kind, entropy = VARIANTS[layout]
    lengths = [rng.randint(*LONG) if r == "L" else rng.randint(2, 30) for r in rows]
    eos: int | list[int] | None = None
    if eos_kind == "int":
        eos = rng.randrange(3, models.VOCAB)
    elif eos_kind == "list":
        eos = rng.sample(range(3, models.VOCAB), 4)
    request = long_request(layout, rng, lengths, eos)
    request["temperature"] = rng.choice([1.0, 0.7, 1.6])
    request["return_entropy"] = entropy
    return request


@pytest.mark.parametrize("layout", LAYOUTS)
def test_long_rows_equal_reference(
    served: tuple[str, Served], layout: str, long_refs: dict[str, Any]
) -> None:
    name, s = served
    rng = random.Random(f"long-{name}-{layout}")
    request = variant_request(layout, rng)
    before = len(s.launches)
    reply = s.client.post("/logprobs", json=request)
    check_reply(reply, request, long_refs[name])
    rows = VARIANTS[layout][0]
    long_rows = [i for i, r in enumerate(rows) if r == "L"]
    assert any(_spans_chunks(request, i, reply.json()) for i in long_rows)
    chunks = s.chunks(before)
    assert len({c.sequence for c in chunks}) == rows.count("L")  # each long row went in chunks
    assert len(chunks) >= rows.count("L") * LONG[0] // BUDGET
    if request.get("eos_token_id") is not None:  # the EOS ended the window inside it
        for i, r in enumerate(rows):
            if r == "L":
                mask = reply.json()["action_mask"][i]
                last = max(k for k, m in enumerate(mask) if m)
                assert sum(mask[last + 1 :]) == 0
                assert last < len(mask) - 50


def test_architecture_runs_its_decoder(served: tuple[str, Served]) -> None:
    """Both decoders score chunks: the fused one where it fits, transformers' for the others."""
    name, s = served
    info = s.client.get("/info").json()
    assert info["decoder"] == ("transformers" if name in ("gemma2", "phi3") else "fused")
    assert (info["max_positions"], info["max_sequence_tokens"], info["max_sequence_limit"]) == (
        LONG_POSITIONS,
        LONG_POSITIONS,
        "positions",
    )
    assert s.engine._stores == {}  # every finished sequence dropped its stores


def test_concurrent_long_and_short_requests(served: tuple[str, Served], long_refs: dict[str, Any]) -> None:
    """A long request and short ones sent at once: short rows ride in the long rows' micro-batches."""
    name, s = served
    rng = random.Random(f"concurrent-{name}")
    requests = [variant_request("ragged_action_mask", rng)]
    requests += [make(layout, rng, models.VOCAB, rows=3) for layout in LAYOUTS]
    before = len(s.launches)
    with ThreadPoolExecutor(max_workers=len(requests)) as pool:
        replies = list(pool.map(lambda r: s.client.post("/logprobs", json=r), requests))
    for request, reply in zip(requests, replies, strict=True):
        check_reply(reply, request, long_refs[name])
    chunks = s.chunks(before)
    assert chunks
    assert chunks[-1].last


@pytest.mark.parametrize("name", ["qwen2", "mistral"])
def test_transformers_decoder_on_a_fused_architecture(
    name: str, long_dirs: dict[str, Path], long_refs: dict[str, Any]
) -> None:
    """decoder=transformers on a model the fused decoder would take: the context reaches every layer
    through transformers' attention interface."""
    rng = random.Random(f"transformers-{name}")
    settings = settings_for(long_dirs[name], max_batch_tokens=BUDGET, decoder="transformers")
    with serve(settings) as s:
        assert s.client.get("/info").json()["decoder"] == "transformers"
        for layout in ("ragged_num_actions", "padded_action_mask"):
            request = variant_request(layout, rng)
            check_reply(s.client.post("/logprobs", json=request), request, long_refs[name])
        assert len(s.chunks()) >= 3 * LONG[0] // BUDGET


# --- the critic and the reference policy ---


@pytest.fixture(scope="module")
def long_ref_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("long-ref") / "qwen2-ref"
    return models.save("qwen2", directory, seed=7, max_position_embeddings=LONG_POSITIONS)


@pytest.fixture(scope="module")
def long_ref_model(long_ref_dir: Path) -> Any:
    return eager(long_ref_dir)


def _long_critic(fmt: str, directory: Path) -> Path:
    critics.save(fmt, directory)
    config = json.loads((directory / "config.json").read_text())
    config["max_position_embeddings"] = LONG_POSITIONS
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


@pytest.fixture(scope="module", params=critics.FORMATS)
def ppo(
    request: pytest.FixtureRequest,
    long_dirs: dict[str, Path],
    long_ref_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Path, Served]]:
    critic_dir = _long_critic(request.param, tmp_path_factory.mktemp("long-critic") / request.param)
    settings = settings_for(
        long_dirs["qwen2"], critic=critic_dir, ref_model=long_ref_dir, max_batch_tokens=BUDGET
    )
    with serve(settings, delay_s=0.002) as s:
        yield critic_dir, s


def _values_want(critic_dir: Path, request: dict[str, Any], mask: list[list[int]]) -> list[list[float]]:
    rows = []
    for i, row_mask in enumerate(mask):
        tokens, window = row_tokens_and_window(request, i)
        per_position = critics.expected_values(critic_dir, tokens)  # index t-1 -> action t
        rows.append(
            [
                per_position[p - 1] if m and p is not None else 0.0
                for p, m in zip(window, row_mask, strict=True)
            ]
        )
    return rows


def check_ppo(reply: Reply, request: dict[str, Any], policy: Any, reference: Any, critic_dir: Path) -> None:
    """Log-probs (via `check`), and values / ref_logprobs where asked, against the references."""
    check_reply(reply, request, policy)
    body = reply.json()
    mask = body["action_mask"]
    if request.get("return_ref_logprobs"):
        assert max_diff(body["ref_logprobs"], expected(reference, request).logprobs) <= TOLERANCE
    else:
        assert body.get("ref_logprobs") is None
    if request.get("return_values"):
        assert_values_close(body["values"], _values_want(critic_dir, request, mask), TOLERANCE, VALUE_RTOL)
    else:
        assert body.get("values") is None


def _ppo_layouts(fmt: str) -> list[str]:
    return list(LAYOUTS) if fmt == "trl" else [LAYOUTS[critics.FORMATS.index(fmt)]]


def test_values_and_ref_logprobs_of_long_rows(
    ppo: tuple[Path, Served], long_refs: dict[str, Any], long_ref_model: Any
) -> None:
    critic_dir, s = ppo
    reference = long_ref_model
    for layout in _ppo_layouts(critic_dir.name):
        rng = random.Random(f"ppo-long-{critic_dir.name}-{layout}")
        request = variant_request(layout, rng)
        request.update(return_values=True, return_ref_logprobs=True)
        check_ppo(
            s.client.post("/logprobs", json=request), request, long_refs["qwen2"], reference, critic_dir
        )
    assert s.engine._stores == {}


def test_long_and_short_requests_asking_different_models(
    ppo: tuple[Path, Served], long_refs: dict[str, Any], long_ref_model: Any
) -> None:
    """Concurrently: a long request asking only log-probs beside short ones asking values and
    ref_logprobs, and a long one asking both beside short ones asking neither. Each model keeps a
    store only for the sequences that ask it, and runs over a chunk it does not keep for."""
    critic_dir, s = ppo
    reference = long_ref_model
    rng = random.Random(f"ppo-mixed-{critic_dir.name}")
    for long_asks in (False, True):
        long = variant_request("ragged_num_actions", rng)
        long.update(return_values=long_asks, return_ref_logprobs=long_asks)
        shorts = [make(layout, rng, models.VOCAB, rows=3) for layout in LAYOUTS]
        for short in shorts:
            short.update(return_values=not long_asks, return_ref_logprobs=not long_asks)
        before = len(s.launches)

        def post(request: dict[str, Any], pause: float) -> Reply:
            time.sleep(pause)
            reply: Reply = s.client.post("/logprobs", json=request)
            return reply

        with ThreadPoolExecutor(max_workers=1 + len(shorts)) as pool:
            futures = [pool.submit(post, long, 0.0)] + [
                pool.submit(post, r, 0.02 * (k + 1)) for k, r in enumerate(shorts)
            ]
            replies = [f.result() for f in futures]
        for request, reply in zip([long, *shorts], replies, strict=True):
            check_ppo(reply, request, long_refs["qwen2"], reference, critic_dir)
        mixed = [launch for launch in s.launches[before:] if launch.chunk is not None and launch.jobs > 0]
        assert mixed, "no short sequence rode beside a chunk"
    assert s.engine._stores == {}


# --- limits, cancellation, failure ---


def test_past_the_longest_sequence_413_past_the_positions_422(
    long_dirs: dict[str, Path], long_refs: dict[str, Any]
) -> None:
    settings = settings_for(long_dirs["llama"], max_batch_tokens=BUDGET, max_sequence_tokens=1000)
    with serve(settings) as s:
        info = s.client.get("/info").json()
        assert (info["max_positions"], info["max_sequence_tokens"], info["max_sequence_limit"]) == (
            LONG_POSITIONS,
            1000,
            "setting",
        )
        rng = random.Random("limits")
        too_long = {"input_ids": [_tokens(rng, 5, set()), _tokens(rng, 1001, set())], "num_actions": 1}
        reply = s.client.post("/logprobs", json=too_long)
        assert reply.status_code == 413, reply.text
        error = reply.json()["error"]
        assert (error["type"], error["field"], error["row"]) == ("sequence_too_large", "input_ids", 1)
        assert "row 1 has 1001 tokens" in error["message"]
        limited = "longest sequence this server scores is 1000 (set by --max-sequence-tokens)"
        assert limited in error["message"]
        past = {"input_ids": [_tokens(rng, LONG_POSITIONS + 1, set())], "num_actions": 1}
        reply = s.client.post("/logprobs", json=past)
        assert reply.status_code == 422, reply.text
        assert reply.json()["error"]["row"] == 0
        assert f"positions cover {LONG_POSITIONS}" in reply.json()["error"]["message"]
        assert s.launches == []  # neither reached the engine
        at_limit = {"input_ids": [_tokens(rng, 1000, set()), _tokens(rng, 7, set())], "num_actions": [900, 6]}
        check_reply(s.client.post("/logprobs", json=at_limit), at_limit, long_refs["llama"])


def test_longest_sequence_the_positions_allow(long_dirs: dict[str, Path], long_refs: dict[str, Any]) -> None:
    """A row of exactly the model's positions: its last chunk's filler runs past the store's end of
    the sequence (the store holds the filler's keys too)."""
    with serve(settings_for(long_dirs["mistral"], max_batch_tokens=BUDGET)) as s:
        rng = random.Random("positions")
        request = {"input_ids": [_tokens(rng, LONG_POSITIONS, set())], "num_actions": LONG_POSITIONS - 1}
        check_reply(s.client.post("/logprobs", json=request), request, long_refs["mistral"])


def test_cancelled_and_failed_long_requests_do_not_break_the_next(
    long_dirs: dict[str, Path], long_refs: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random("cancel")
    with serve(settings_for(long_dirs["gemma2"], max_batch_tokens=BUDGET), delay_s=0.03) as s:
        # a deadline passes mid-sequence (17 chunks of >= 30 ms): 504, its remaining chunks
        # dropped, its stores released
        doomed = {"input_ids": [_tokens(rng, 1050, set())], "num_actions": 1000, "timeout_s": 0.3}
        reply = s.client.post("/logprobs", json=doomed)
        assert reply.status_code == 504, reply.text
        deadline = time.monotonic() + 10
        while s.engine._stores and time.monotonic() < deadline:
            time.sleep(0.01)
        assert s.engine._stores == {}
        cancelled = {c.sequence for c in s.chunks()}
        assert len(cancelled) == 1
        assert 0 < len(s.chunks()) < 1050 // BUDGET
        after = variant_request("ragged_num_actions", rng)
        check_reply(s.client.post("/logprobs", json=after), after, long_refs["gemma2"])

        # a chunk's forward fails: 500 for its request, the stores go, the next long one is exact
        real_extend = KVContext.extend
        failed = threading.Event()

        def failing(self: KVContext, layer: int, k: Any, v: Any) -> Any:
            if self.start >= 4 * BUDGET and not failed.is_set():
                failed.set()
                raise RuntimeError("injected failure")
            return real_extend(self, layer, k, v)

        monkeypatch.setattr(KVContext, "extend", failing)
        broken = {"input_ids": [_tokens(rng, 1000, set()), _tokens(rng, 9, set())], "num_actions": [500, 5]}
        reply = s.client.post("/logprobs", json=broken)
        assert reply.status_code == 500, reply.text
        assert reply.json()["error"]["type"] == "engine_failure"
        assert "injected failure" in reply.json()["error"]["message"]
        assert failed.is_set()
        assert s.engine._stores == {}
        again = variant_request("padded_action_mask", rng)
        check_reply(s.client.post("/logprobs", json=again), again, long_refs["gemma2"])
        assert s.engine._stores == {}


def test_out_of_memory_beside_a_later_chunk_retries_it_exactly(
    long_dirs: dict[str, Path], long_refs: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A micro-batch of short sequences and a chunk past the first runs out of memory: the batcher
    retries the chunk and the short sequences apart, and every score is still exact."""
    real_extend = KVContext.extend
    ran_out = threading.Event()

    def running_out(self: KVContext, layer: int, k: Any, v: Any) -> Any:
        if self.others > 0 and self.start > 0 and not ran_out.is_set():
            ran_out.set()
            raise torch.OutOfMemoryError("injected out-of-memory")
        return real_extend(self, layer, k, v)

    monkeypatch.setattr(KVContext, "extend", running_out)
    rng = random.Random("oom")
    with serve(settings_for(long_dirs["llama"], max_batch_tokens=BUDGET), delay_s=0.005) as s:
        long = {"input_ids": [_tokens(rng, 1000, set())], "num_actions": 900}
        shorts = [make(layout, rng, models.VOCAB, rows=3) for layout in LAYOUTS]

        def post(request: dict[str, Any], pause: float) -> Reply:
            time.sleep(pause)
            reply: Reply = s.client.post("/logprobs", json=request)
            return reply

        with ThreadPoolExecutor(max_workers=1 + len(shorts)) as pool:
            futures = [pool.submit(post, long, 0.0)]
            futures += [pool.submit(post, r, 0.02 * (k + 1)) for k, r in enumerate(shorts)]
            replies = [f.result() for f in futures]
        assert ran_out.is_set()
        for request, reply in zip([long, *shorts], replies, strict=True):
            check_reply(reply, request, long_refs["llama"])
        assert s.engine._stores == {}

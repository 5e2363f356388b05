"""response.distribution and the frame writer on [A, K] blocks: a block that fills its row's window
goes into the answer (and the frame) as the engine handed it, no copy; any other row is zero where
no action sits, and either way the frame reads back equal to a reference built entry by entry.
to_json's lists form writes the blocks natively (or by orjson): orjson's bytes for the whole answer,
read back as the frame's bits."""

from __future__ import annotations

import base64
import dataclasses
from typing import Any

import numpy as np
import orjson
import pytest

from service.answer.layout import distribution, json_parts, to_json
from service.client.wire import from_frame
from service.core.jobs import SequenceScores
from service.normalise import ModelLimits, ScoringPlan, normalise
from service.wire import jsonrows
from service.wire.arrays import to_frame
from service.wire.frame import ArraySpec, pack, unpack
from service.wire.schemas import LogprobsRequest
from tests.support.needs import native_or_skip

VOCAB = 151_936
LIMITS = ModelLimits(vocab_size=VOCAB, max_sequence_tokens=64)
EOS = 7


def plan_of(body: dict[str, Any]) -> ScoringPlan:
    return normalise(LogprobsRequest(**body), LIMITS)


def engine_scores(plan: ScoringPlan, k: int, seed: int = 0) -> list[SequenceScores]:
    """What the engine hands the response per job: int32 ids and float32 log-probs [A, K]."""
    rng = np.random.default_rng(seed)
    out = []
    for job in plan.jobs:
        a = int(job.actions.shape[0])
        out.append(
            SequenceScores(
                logprobs=np.zeros(a, np.float32),
                entropy=None,
                top_ids=rng.integers(0, VOCAB, size=(a, k)).astype(np.int32),
                top_logprobs=-rng.exponential(2.0, size=(a, k)).astype(np.float32),
                ranks=rng.integers(1, 100, size=a),
            )
        )
    return out


def reference(plan: ScoringPlan, per_job: list[np.ndarray], k: int) -> list[list[list[float]]]:
    """Each row's [window][K] as lists: the job's values at its slots, 0 elsewhere."""
    rows = []
    for window, values in zip(plan.windows, per_job, strict=True):
        row = [[0.0] * k for _ in range(window.width)]
        for a, slot in enumerate(window.slots.tolist()):
            row[slot] = [float(v) for v in values[a]]
        rows.append(row)
    return rows


def test_blocks_that_fill_their_windows_are_the_engines_own() -> None:
    plan = plan_of({"input_ids": [[1, 2, 3, 4, 5], [1, 2, 3]], "num_actions": [3, 2], "top_logprobs": 4})
    scores = engine_scores(plan, 4)
    got = distribution(plan, scores)
    for row, s in zip(got["top_ids"], scores, strict=True):
        assert row is s.top_ids  # no copy on the way to the frame
    for row, s in zip(got["top_logprobs"], scores, strict=True):
        assert row is s.top_logprobs


@pytest.mark.parametrize("k", [1, 5])
def test_rows_with_gaps_are_zero_where_no_action_sits(k: int) -> None:
    body = {
        "input_ids": [[1, 2, 3, EOS, 5, 6], [1, 2, 3, 4], [1, 2, 3, 4, 5]],
        "num_actions": [4, 3, 2],
        "eos_token_id": EOS,  # row 0: the actions after its EOS are cut
        "top_logprobs": k,
    }
    plan = plan_of(body)
    assert len(plan.windows[0].slots) < plan.windows[0].width
    scores = engine_scores(plan, k, seed=k)
    got = distribution(plan, scores)
    for name in ("top_ids", "top_logprobs"):
        want = reference(plan, [getattr(s, name) for s in scores], k)
        assert [r.tolist() for r in got[name]] == want
        assert all(r.flags.c_contiguous for r in got[name])
    assert got["top_ids"][0].dtype == np.int32
    assert not np.shares_memory(got["top_ids"][0], scores[0].top_ids)  # scattered into its own row


def test_ids_of_another_dtype_or_layout_are_converted() -> None:
    """int64 ids (a fake engine's) and a block narrower in memory than its K (a job's K sliced from a
    micro-batch's larger one) come out as C-contiguous int32 / float32 of the same values."""
    plan = plan_of({"input_ids": [[1, 2, 3, 4]], "num_actions": 3, "top_logprobs": 2})
    wide = np.arange(3 * 5, dtype=np.int64).reshape(3, 5) * 10_007
    lps = -np.arange(15, dtype=np.float32).reshape(3, 5)
    scores = [
        SequenceScores(
            logprobs=np.zeros(3, np.float32),
            entropy=None,
            top_ids=wide[:, :2],
            top_logprobs=lps[:, :2],
            ranks=np.ones(3, np.int64),
        )
    ]
    got = distribution(plan, scores)
    assert got["top_ids"][0].dtype == np.int32
    assert got["top_ids"][0].tolist() == wide[:, :2].tolist()
    assert got["top_logprobs"][0].flags.c_contiguous
    assert got["top_logprobs"][0].tolist() == lps[:, :2].tolist()


def test_the_frame_of_an_answer_reads_back_to_the_reference() -> None:
    body = {
        "input_ids": [[1, 2, 3, EOS, 5, 6], [1, 2, 3, 4, 5, 6, 8]],
        "num_actions": [4, 5],
        "eos_token_id": EOS,
        "top_logprobs": 3,
    }
    plan = plan_of(body)
    scores = engine_scores(plan, 3, seed=3)
    answer = {"model": "m", "logprobs": [np.zeros(w.width, np.float32) for w in plan.windows]}
    raw = to_frame(answer | distribution(plan, scores))
    frame = unpack(raw)
    assert frame.arrays["top_ids"][0].dtype == "i4"  # ids past 65536
    got = from_frame(raw)
    for name in ("top_ids", "top_logprobs"):
        want = reference(plan, [getattr(s, name) for s in scores], 3)
        assert [r.tolist() for r in got[name]] == want


def test_pack_writes_pieces_as_one_array() -> None:
    """An array given as its rows' buffers is the same frame, byte for byte, as the joined array."""
    rows = [np.arange(5, dtype="<i4"), np.zeros(0, dtype="<i4"), np.arange(3, dtype="<i4") * -7]
    spec = ArraySpec("x", "i4", (5, 0, 3))
    joined = pack(b"{}", [(spec, np.concatenate(rows).tobytes())])
    pieces = pack(b"{}", [(spec, [r.view(np.uint8).data for r in rows if r.size])])
    assert pieces == joined
    with pytest.raises(ValueError, match="28 bytes for 8 values"):
        pack(b"{}", [(spec, [rows[0].view(np.uint8).data, rows[2][:2].view(np.uint8).data])])


@pytest.mark.parametrize("writer", ["native", "python"])
def test_json_lists_are_orjsons_bytes_and_the_frames_bits(
    writer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """top_ids, top_logprobs and candidate_logprobs in the lists form (ragged windows, a gap, padding
    zeros, -0.0, subnormal and tiny log-probs): the bytes orjson writes for the answer, and, read back,
    the frame's int32 and float32 bits."""
    if writer == "native":
        native_or_skip()
    else:
        monkeypatch.setattr(jsonrows, "native", lambda: None)
    body = {
        "input_ids": [[1, 2, 3, EOS, 5, 6], [1, 2, 3, 4, 5, 6, 8], [1, 2]],
        "num_actions": [4, 5, 1],
        "eos_token_id": EOS,
        "top_logprobs": 6,
        "candidate_ids": [3, 9],
    }
    plan = plan_of(body)
    scores = engine_scores(plan, 6, seed=6)
    first = scores[0].top_logprobs
    assert first is not None
    first[0] = [-0.0, -1e-45, -1e-8, -30.0, -103.27893, -1.5e-6]
    rng = np.random.default_rng(7)
    scores = [
        dataclasses.replace(
            s, candidate_logprobs=-rng.exponential(5.0, (len(s.logprobs), 2)).astype(np.float32)
        )
        for s in scores
    ]
    answer = {"model": "m", "logprobs": [np.zeros(w.width, np.float32) for w in plan.windows]}
    answer |= distribution(plan, scores)
    text = to_json(answer)
    assert text == orjson.dumps(answer, option=orjson.OPT_SERIALIZE_NUMPY)
    read, framed = orjson.loads(text), from_frame(to_frame(answer))
    for name, dtype in (
        ("top_ids", np.int32),
        ("top_logprobs", np.float32),
        ("candidate_logprobs", np.float32),
    ):
        for row, want in zip(read[name], framed[name], strict=True):
            assert np.array(row, dtype).tobytes() == np.asarray(want, dtype).tobytes(), name


@pytest.mark.parametrize(
    ("routes", "blocks"), [("lists", "lists"), ("base64", "base64"), ("base64", "lists")]
)
def test_json_parts_are_the_answer_with_each_big_text_a_part_of_its_own(routes: str, blocks: str) -> None:
    rng = np.random.default_rng(8)
    answer: dict[str, Any] = {
        "model": "a\0b",  # a NUL the answer carries escaped, never taken for a big text's place
        "logprobs": [rng.standard_normal(5).astype(np.float32), np.zeros(3, np.float32)],
        "routed_experts": [rng.integers(0, 128, (5, 4, 2), dtype=np.uint8), np.zeros((0, 4, 2), np.uint8)],
        "top_ids": [
            rng.integers(0, VOCAB, (5, 3), dtype=np.int32),
            rng.integers(0, VOCAB, (3, 3), dtype=np.int32),
        ],
        "top_logprobs": [-rng.exponential(3.0, (5, 3)).astype(np.float32), np.zeros((3, 3), np.float32)],
        "usage": {"input_tokens": 8},
    }
    parts = json_parts(answer, routes=routes, distribution=blocks)

    def b64(rows: list[np.ndarray], dtype: str) -> list[str]:
        return [base64.b64encode(np.ascontiguousarray(r, dtype).tobytes()).decode() for r in rows]

    want: dict[str, Any] = dict(answer)
    if routes == "base64":
        want["routed_experts"] = b64(answer["routed_experts"], "<i4")
    if blocks == "base64":
        want["top_ids"], want["top_logprobs"] = (
            b64(answer["top_ids"], "<i4"),
            b64(answer["top_logprobs"], "<f4"),
        )
        want["columns"] = {"top_ids": 3, "top_logprobs": 3}
    assert b"".join(parts) == orjson.dumps(want, option=orjson.OPT_SERIALIZE_NUMPY)
    assert len(parts) == 7  # the JSON around three big texts
    for text, name in zip(parts[1::2], ("routed_experts", "top_ids", "top_logprobs"), strict=True):
        assert text == orjson.dumps(want[name], option=orjson.OPT_SERIALIZE_NUMPY), name

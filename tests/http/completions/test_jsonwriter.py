"""jsonwriter.py's bytes against orjson.dumps of the dicts built the obvious way from the same scores:
equal bytes, for vLLM's prompt_logprobs and OpenAI's top_logprobs / tokens / token_logprobs /
text_offset, over K = 0, 1, 5, 100 and the whole vocabulary, ties, the token among the K or not,
-inf (the -9999.0 floor), NaN (null), texts that need escaping and texts shared by several ids.
prompt_logprobs are checked as the native writer writes them and as numpy's copies do."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import orjson
import pytest

from service.http.completions import jsonwriter
from service.http.completions import pieces as pieces_module
from service.http.completions.bytepool import SLACK
from service.http.completions.jsonwriter import Positions
from service.http.completions.pieces import TokenPieces
from tests.support.completions import (
    Table,
    clamp,
    openai_reference,
    positions,
    text_of,
    vllm_reference,
    vocabulary,
)
from tests.support.needs import native_or_skip


def joined(chunks: Iterable[bytes]) -> bytes:
    return b"".join(chunks)


@pytest.fixture(params=["native", "numpy"])
def writer(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """prompt_logprobs' entries written by service.wire._jsonrows.prompt_entries, or by numpy's copies."""
    if request.param == "native":
        native_or_skip()
    else:
        monkeypatch.setattr(jsonwriter, "native", lambda: None)
    return str(request.param)


@pytest.mark.parametrize(
    ("k", "v", "n"), [(0, 50, 9), (1, 50, 40), (5, 300, 40), (100, 1000, 30), (64, 64, 20)]
)
@pytest.mark.parametrize("with_tokenizer", [True, False])
def test_prompt_logprobs_are_orjson_of_the_dicts(
    writer: str, k: int, v: int, n: int, with_tokenizer: bool
) -> None:
    rng = np.random.default_rng(k + v)
    table = vocabulary(v, rng) if with_tokenizer else None
    pieces = TokenPieces.build(table, v)
    for ties in (False, True):
        p = positions(n, v, k, rng, ties=ties)
        got = joined(jsonwriter.prompt_logprobs(pieces, p, k))
        assert got == orjson.dumps(vllm_reference(p, k, table))


@pytest.mark.parametrize(
    ("k", "v", "n"), [(0, 50, 9), (1, 50, 40), (5, 300, 40), (100, 1000, 30), (64, 64, 20)]
)
@pytest.mark.parametrize("with_tokenizer", [True, False])
@pytest.mark.parametrize("null_first", [True, False])
def test_top_logprobs_are_orjson_of_the_dicts(
    k: int, v: int, n: int, with_tokenizer: bool, null_first: bool
) -> None:
    rng = np.random.default_rng(k + v + 1)
    table = vocabulary(v, rng) if with_tokenizer else None
    pieces = TokenPieces.build(table, v)
    for ties in (False, True):
        p = positions(n, v, k, rng, ties=ties)
        got = joined(jsonwriter.top_logprobs(pieces, p, k, null_first=null_first))
        expected = openai_reference(p, k, table)
        assert got == orjson.dumps([None, *expected] if null_first else expected)


def test_blocks_join_into_one_array(writer: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Positions over several blocks (and a block of one position) write one array."""
    monkeypatch.setattr(jsonwriter, "BLOCK_ENTRIES", 7)
    rng = np.random.default_rng(5)
    table = vocabulary(40, rng)
    pieces = TokenPieces.build(table, 40)
    p = positions(13, 40, 3, rng)
    assert joined(jsonwriter.prompt_logprobs(pieces, p, 3)) == orjson.dumps(vllm_reference(p, 3, table))
    got = joined(jsonwriter.top_logprobs(pieces, p, 3, null_first=False))
    assert got == orjson.dumps(openai_reference(p, 3, table))


def test_no_positions(writer: str) -> None:
    pieces = TokenPieces.build(None, 10)
    empty = (
        positions(0, 10, 2, np.random.default_rng(0))
        if False
        else Positions(
            np.zeros(0, np.int64),
            np.zeros(0, np.float32),
            np.zeros(0, np.int64),
            np.zeros((0, 2), np.int64),
            np.zeros((0, 2), np.float32),
        )
    )
    assert joined(jsonwriter.prompt_logprobs(pieces, empty, 2)) == b"[null]"
    assert joined(jsonwriter.top_logprobs(pieces, empty, 2, null_first=True)) == b"[null]"
    assert joined(jsonwriter.top_logprobs(pieces, empty, 2, null_first=False)) == b"[]"


@pytest.mark.parametrize("with_tokenizer", [True, False])
def test_token_lists(with_tokenizer: bool) -> None:
    rng = np.random.default_rng(9)
    table = vocabulary(200, rng) if with_tokenizer else None
    pieces = TokenPieces.build(table, 200)
    tokens = rng.integers(0, 200, size=300)
    texts = [text_of(table, int(t)) for t in tokens]
    assert jsonwriter.token_strings(pieces, tokens) == orjson.dumps(texts)
    assert jsonwriter.token_strings(pieces, tokens[:0]) == b"[]"
    offsets = [sum(len(t) for t in texts[:i]) if with_tokenizer else 0 for i in range(len(texts))]
    assert jsonwriter.text_offsets(pieces, tokens) == orjson.dumps(offsets)
    values = rng.standard_normal(50).astype(np.float32) * 4
    values[[3, 7]] = [-np.inf, np.nan]
    floats = [clamp(float(x)) for x in values]
    assert jsonwriter.logprob_list(values, null_first=True) == orjson.dumps([None, *floats])
    assert jsonwriter.logprob_list(values, null_first=False) == orjson.dumps(floats)
    assert jsonwriter.logprob_list(values[:0], null_first=True) == b"[null]"


def test_spills_land_in_pieces_copied_later() -> None:
    """_prompt_block's order: decoded_token (spills into the next entry's key, number and rank), key
    (into its number and rank), number (into its rank), rank (exact)."""
    w = jsonwriter
    assert w.NUMBER_WIDTH - 1 <= w.SHORTEST_RANK
    assert pieces_module.KEY_WIDTH - 1 <= w.SHORTEST_NUMBER + w.SHORTEST_RANK
    assert pieces_module.DECODED_WIDTH - 1 <= w.SHORTEST_KEY + w.SHORTEST_NUMBER + w.SHORTEST_RANK
    pieces = TokenPieces.build(None, 10)
    assert int(pieces.key.length.min()) == w.SHORTEST_KEY
    assert int(pieces.rank.length.min()) == w.SHORTEST_RANK
    assert max(pieces_module.KEY_WIDTH, w.NUMBER_WIDTH, pieces_module.DECODED_WIDTH) <= SLACK


@pytest.mark.parametrize("value", [0.0, -0.0, float("nan"), float("-inf")])
def test_the_shortest_entries(writer: str, value: float) -> None:
    """Entries of one-digit ids, empty texts and the shortest numbers: every copy's spill at its widest."""
    v, k, n = 10, 9, 12
    rng = np.random.default_rng(3)
    table = Table([""] * v)
    top = np.stack([rng.permutation(v)[:k] for _ in range(n)])
    p = Positions(
        token=rng.integers(0, v, size=n),
        logprob=np.full(n, value, dtype=np.float32),
        rank=rng.integers(1, v, size=n),
        top_ids=top,
        top_logprobs=np.full((n, k), value, dtype=np.float32),
    )
    for t in (table, None):
        pieces = TokenPieces.build(t, v)
        assert joined(jsonwriter.prompt_logprobs(pieces, p, k)) == orjson.dumps(vllm_reference(p, k, t))
        got = joined(jsonwriter.top_logprobs(pieces, p, k, null_first=True))
        assert got == orjson.dumps([None, *openai_reference(p, k, t)])


def test_the_native_writer_refuses_an_id_it_has_no_piece_for() -> None:
    """prompt_entries checks every shown id against the pieces (response.py refuses such scores
    before writing; the writer never reads past its pool either way)."""
    native_or_skip()
    from service.wire.jsonrows import native

    writer = native()
    assert writer is not None
    pieces = TokenPieces.build(None, 10)
    d = pieces.decoded
    numbers = orjson.dumps([0.0] * 4)
    ids = np.array([[1, 2], [3, 10]], dtype=np.int64)
    keep = np.ones((2, 2), dtype=np.uint8)
    first = np.array([1, 1], dtype=np.int64)
    with pytest.raises(ValueError, match="do not fit"):
        writer.prompt_entries(numbers, ids, first, keep, 2, d.data, d.start, d.length)
    ids[1, 1] = 9
    written = writer.prompt_entries(numbers, ids, first, keep, 2, d.data, d.start, d.length)
    assert orjson.loads(b"[null" + written + b"]")[2] == {
        "3": {"logprob": 0.0, "rank": 1, "decoded_token": None},
        "9": {"logprob": 0.0, "rank": 1, "decoded_token": None},
    }
    with pytest.raises(ValueError, match="do not fit"):  # fewer numbers than slots
        writer.prompt_entries(orjson.dumps([0.0] * 3), ids, first, keep, 2, d.data, d.start, d.length)

"""The two big arrays of a completions answer as JSON bytes, written by numpy a block at a time.

    prompt_logprobs (vLLM)   [null,{"<id>":{"logprob":x,"rank":r,"decoded_token":"t"},...},...]
    top_logprobs (OpenAI)    [null,{"<text>":x,...},...]

Each position shows its own token first, then the K most likely; a token among the K appears once,
in first place, with the K's log-prob and rank (a dict's key written twice). OpenAI's dicts are keyed
by text: tokens of one text keep the first one's place and the last one's log-prob. Log-probs are
clamped to -9999.0 (vLLM's floor for -inf); NaN is written null. The bytes are those orjson.dumps
writes for the same dicts of Python floats (tests/http/completions/test_jsonwriter.py holds them to it):
numbers are orjson's own, of float64 arrays, and the rest is pieces.py's text copied by token id
(bytepool.py; prompt_logprobs' entries in one native pass where service.wire._jsonrows is built).
Memory: one block of BLOCK_ENTRIES entries at a time besides the bytes written.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
from numpy.typing import NDArray

from service.http.completions.bytepool import Bytes, Ints, Pool, copy_exact, copy_over, room, windows
from service.http.completions.pieces import DECODED_WIDTH, KEY_WIDTH, TokenPieces
from service.wire.jsonrows import native

Map = Callable[[Callable[[Any], bytes], Iterable[Any]], Iterator[bytes]]  # map, Executor.map
FLOOR = -9999.0  # vLLM's clamp for -inf, which JSON cannot carry
BLOCK_ENTRIES = 1 << 15  # entries (tokens shown) rendered at once: about 2.3 MB of prompt_logprobs' JSON
NUMBERS = orjson.OPT_SERIALIZE_NUMPY
# prompt_logprobs' copies spill up to width - 1 bytes past a piece, into the pieces after it, which
# _prompt_block copies later: the shortest of those must hold the spill (test_jsonwriter checks it).
NUMBER_WIDTH = 24
SHORTEST_KEY, SHORTEST_NUMBER, SHORTEST_RANK = (
    len(',"0":{"logprob":'),
    len("0.0"),
    len(',"rank":0,"decoded_token":'),
)


@dataclass(frozen=True, slots=True)
class Positions:
    """Scored positions: token, logprob, rank [n] (the token at each); top_ids, top_logprobs [n, >= K]
    the most likely first."""

    token: Ints
    logprob: NDArray[np.floating]
    rank: Ints
    top_ids: Ints
    top_logprobs: NDArray[np.floating]

    def __len__(self) -> int:
        return int(self.token.shape[0])

    @classmethod
    def concat(cls, parts: list[Positions]) -> Positions:
        def cat(field: str) -> Any:
            return np.concatenate([getattr(p, field) for p in parts])

        return cls(cat("token"), cat("logprob"), cat("rank"), cat("top_ids"), cat("top_logprobs"))

    def blocks(self, k: int) -> Iterator[Positions]:
        step = max(1, BLOCK_ENTRIES // (k + 1))
        for a in range(0, len(self), step):
            b = a + step
            yield Positions(
                self.token[a:b], self.logprob[a:b], self.rank[a:b], self.top_ids[a:b], self.top_logprobs[a:b]
            )


@dataclass(frozen=True, slots=True)
class Entries:
    """A block's entries, slot 0 the position's token, slot j its j-th most likely (rank j): ids,
    logprobs (float64, clamped), keep (False: shown in an earlier slot) [n, K + 1]; first_rank [n]
    slot 0's rank."""

    ids: Ints
    logprobs: NDArray[np.float64]
    first_rank: Ints
    keep: NDArray[np.bool_]
    repeated: Ints  # [<= n] flat indices of the K's slots that repeat slot 0 (keep False)

    @classmethod
    def of(cls, block: Positions, k: int) -> Entries:
        n = len(block)
        ids = np.empty((n, k + 1), dtype=np.int64)
        ids[:, 0], ids[:, 1:] = block.token, block.top_ids[:, :k]
        logprobs = np.empty((n, k + 1), dtype=np.float64)
        logprobs[:, 0], logprobs[:, 1:] = block.logprob, block.top_logprobs[:, :k]
        first_rank = block.rank.astype(np.int64)
        again = ids[:, 1:] == ids[:, :1]  # the position's token among the K: shown once, in slot 0
        rows, slots = np.nonzero(again)  # one slot at most per row: the K are distinct ids
        slots += 1
        logprobs[rows, 0] = logprobs[rows, slots]
        first_rank[rows] = slots
        keep = np.ones((n, k + 1), dtype=np.bool_)
        keep[rows, slots] = False
        np.copyto(logprobs, FLOOR, where=logprobs < FLOOR)  # -inf to the floor; NaN stays (null)
        return cls(
            ids=ids, logprobs=logprobs, first_rank=first_rank, keep=keep, repeated=rows * (k + 1) + slots
        )

    def merge_same_text(self, text_class: Ints) -> None:
        """Keys by text: of the tokens of one text, the first keeps its slot and takes the last's log-prob."""
        s = self.ids.shape[1]
        cls = np.where(self.keep, text_class[self.ids], -1 - np.arange(s))  # left out: a class alone
        order = np.argsort(cls, axis=1, kind="stable")  # a text's slots together, in slot order
        ordered = np.take_along_axis(cls, order, axis=1)
        same = ordered[:, 1:] == ordered[:, :-1]  # [n, s - 1]: item j + 1 has item j's text
        rows = np.flatnonzero(same.any(axis=1))
        if rows.size == 0:
            return
        order, same = order[rows], same[rows]
        first = np.ones(order.shape, dtype=np.bool_)
        first[:, 1:] = ~same
        last = np.ones(order.shape, dtype=np.bool_)
        last[:, :-1] = ~same
        j = np.arange(s)
        run_end = np.flip(np.minimum.accumulate(np.flip(np.where(last, j, s), axis=1), axis=1), axis=1)
        r, c = np.nonzero(first)
        self.logprobs[rows[r], order[r, c]] = self.logprobs[rows[r], order[r, run_end[r, c]]]
        r, c = np.nonzero(~first)
        self.keep[rows[r], order[r, c]] = False


def _numbers(logprobs: NDArray[np.float64]) -> Pool:
    return Pool.of_json_array(orjson.dumps(np.ascontiguousarray(logprobs).ravel(), option=NUMBERS))


@dataclass(frozen=True, slots=True)
class Layout:
    """Where a block's entries go: at [n * s] each entry's offset, close [n] each position's `}`."""

    at: Ints
    close: Ints
    total: int

    @classmethod
    def of(cls, sizes: Ints) -> Layout:
        """From the entries' sizes [n, s] (0: left out), each position closed by one byte."""
        n, s = sizes.shape
        with_close = np.ones((n, s + 1), dtype=np.int64)
        with_close[:, :s] = sizes
        ends = np.cumsum(with_close.ravel()).reshape(n, s + 1)
        return cls(
            at=(ends[:, :s] - sizes).ravel(), close=ends[:, s] - 1, total=int(ends[-1, -1]) if n else 0
        )


def _prompt_bytes(pieces: TokenPieces, block: Positions, k: int) -> bytes:
    """One block of prompt_logprobs' positions, each `,{...}`: written natively where the install
    built service.wire._jsonrows (prompt_entries: every entry's pieces in one pass, the GIL
    released), else by numpy's copies (_prompt_block)."""
    writer = native()
    if writer is None:
        return _prompt_block(pieces, block, k).tobytes()
    e = Entries.of(block, k)
    numbers = orjson.dumps(np.ascontiguousarray(e.logprobs).ravel(), option=NUMBERS)
    decoded = pieces.decoded
    return writer.prompt_entries(
        numbers,
        np.ascontiguousarray(e.ids, dtype=np.int64),
        np.ascontiguousarray(e.first_rank, dtype=np.int64),
        np.ascontiguousarray(e.keep).view(np.uint8),
        e.ids.shape[1],
        decoded.data,
        decoded.start,
        decoded.length,
    )


def _prompt_block(pieces: TokenPieces, block: Positions, k: int) -> Bytes:
    """One block of prompt_logprobs' positions, each `,{...}`, by numpy's copies."""
    e = Entries.of(block, k)
    n, s = e.ids.shape
    ids = e.ids.ravel()
    keys = e.ids.copy()
    keys[:, 0] += pieces.vocab_size  # the first entry opens the position's dict
    keys = keys.ravel()
    numbers = _numbers(e.logprobs)
    l_key, l_number, l_decoded = pieces.key.length[keys], numbers.length, pieces.decoded.length[ids]
    rank_lengths = np.empty((n, s), dtype=np.int64)  # slot j >= 1: rank j
    rank_lengths[:, 0], rank_lengths[:, 1:] = pieces.rank.length[e.first_rank], pieces.rank.length[1:s]
    l_rank = rank_lengths.ravel()
    sizes = l_key + l_number + l_rank + l_decoded
    sizes[e.repeated] = 0
    layout = Layout.of(sizes.reshape(n, s))
    total, at_key = layout.total, layout.at
    at_key[e.repeated] = total  # left out: copied past the end
    at_number = at_key + l_key
    at_rank = at_number + l_number
    at_decoded = at_rank + l_rank
    buf = room(total, pieces.decoded, pieces.key, numbers, pieces.rank)
    # Each copy spills into the pieces after it, copied later: decoded_token's into the next entry.
    copy_over(buf, at_decoded, pieces.decoded, ids, DECODED_WIDTH)
    copy_over(buf, at_key, pieces.key, keys, KEY_WIDTH)
    copy_over(buf, at_number, numbers, np.arange(ids.size), NUMBER_WIDTH)
    _copy_ranks(buf, at_rank.reshape(n, s), pieces.rank, e.first_rank)
    buf[layout.close] = ord("}")
    return buf[:total]


def _copy_ranks(buf: Bytes, at: Ints, rank: Pool, first: Ints) -> None:
    """The rank pieces, each its exact length: slot 0's by its rank, slot j's (rank j) by column."""
    copy_exact(buf, at[:, 0], rank.data, rank.start[first], rank.length[first])
    widths = rank.length[1 : at.shape[1]]
    cuts = [0, *(np.flatnonzero(np.diff(widths)) + 1).tolist(), widths.size]
    for a, b in itertools.pairwise(cuts):  # slots a + 1 .. b, ranks of one number of digits
        if b > a:
            width = int(widths[a])
            windows(buf, width)[at[:, a + 1 : b + 1]] = windows(rank.data, width)[rank.start[a + 1 : b + 1]]


def _top_block(pieces: TokenPieces, block: Positions, k: int) -> Bytes:
    """One block of top_logprobs' positions, each `,{...}` keyed by text; every copy exact."""
    e = Entries.of(block, k)
    if pieces.shared_texts:
        e.merge_same_text(pieces.text_class)
    n, s = e.ids.shape
    keys = e.ids.copy()
    keys[:, 0] += pieces.vocab_size
    keys, keep = keys.ravel(), e.keep.ravel()
    numbers = _numbers(e.logprobs)
    l_key, l_number = pieces.text.length[keys] * keep, numbers.length * keep
    layout = Layout.of((l_key + l_number).reshape(n, s))
    buf = room(layout.total, pieces.text, numbers)
    copy_exact(buf, layout.at, pieces.text.data, pieces.text.start[keys], l_key)
    copy_exact(buf, layout.at + l_key, numbers.data, numbers.start, l_number)
    buf[layout.close] = ord("}")
    return buf[: layout.total]


def _array(blocks: Iterator[bytes], null_first: bool, empty: bool) -> Iterator[bytes]:
    """A JSON array of the blocks' `,{...}` items (the first block opens it unless `null_first`)."""
    if null_first:
        yield b"[null"
    elif empty:
        yield b"["
    yield from blocks
    yield b"]"


def prompt_logprobs(pieces: TokenPieces, positions: Positions, k: int, run: Map = map) -> Iterator[bytes]:
    """vLLM's choices[i].prompt_logprobs for the prompt's positions 1..L-1 (null for position 0); its
    blocks rendered by `run` (map, or an Executor's map: submitted at once, in parallel)."""
    blocks = run(lambda block: _prompt_bytes(pieces, block, k), positions.blocks(k))
    return _array(blocks, null_first=True, empty=len(positions) == 0)


def top_logprobs(
    pieces: TokenPieces, positions: Positions, k: int, *, null_first: bool, run: Map = map
) -> Iterator[bytes]:
    """OpenAI's logprobs.top_logprobs: a dict of the K + 1 at most per position, keyed by text."""

    def render(numbered: tuple[int, Positions]) -> bytes:
        i, block = numbered
        buf = _top_block(pieces, block, k)
        if i == 0 and not null_first:
            buf[0] = ord("[")  # the first item's comma opens the array
        return buf.tobytes()

    blocks = run(render, enumerate(positions.blocks(k)))
    return _array(blocks, null_first=null_first, empty=len(positions) == 0)


def token_strings(pieces: TokenPieces, tokens: Ints) -> bytes:
    """OpenAI's logprobs.tokens: ["<text>",...], from the text keys less their colon."""
    if tokens.size == 0:
        return b"[]"
    tokens = tokens.astype(np.int64)
    length = pieces.text.length[tokens] - 1  # ,"<text>"
    at = np.cumsum(length) - length
    total = int(length.sum())
    buf = room(total, pieces.text)
    copy_exact(buf, at, pieces.text.data, pieces.text.start[tokens], length)
    buf[0] = ord("[")
    buf[total] = ord("]")
    return buf[: total + 1].tobytes()


def text_offsets(pieces: TokenPieces, tokens: Ints) -> bytes:
    """OpenAI's logprobs.text_offset: where each token's text starts in the concatenated texts."""
    chars = pieces.chars[tokens.astype(np.int64)]
    return orjson.dumps(np.cumsum(chars) - chars, option=NUMBERS)


def logprob_list(logprobs: NDArray[np.floating], *, null_first: bool) -> bytes:
    """OpenAI's logprobs.token_logprobs: clamped, NaN as null, after a null where `null_first`."""
    values = np.asarray(logprobs, dtype=np.float64).copy()
    np.copyto(values, FLOOR, where=values < FLOOR)
    text = orjson.dumps(values, option=NUMBERS)
    if not null_first:
        return text
    return b"[null]" if values.size == 0 else b"[null," + text[1:]

"""The completions answer's per-token JSON text, built once per served vocabulary (V ids).

Every entry of prompt_logprobs (vLLM) and of top_logprobs (OpenAI) is a token's fixed text around a
number; jsonwriter.py copies these pieces by token id instead of formatting each entry. Strings are
escaped by orjson, as the service's orjson.dumps writes them (quotes, backslashes and control
characters escaped, other characters as UTF-8).

    key        ,"<id>":{"logprob":          pool ids V..2V-1: ,{"<id>":{"logprob":  (a position's first)
    decoded    "<decoded>"}  or  null}       vLLM's decoded_token: null without a tokenizer
    rank       ,"rank":<r>,"decoded_token":  for r in 0..V
    text       ,"<text>":                    pool ids V..2V-1: ,{"<text>":  OpenAI's top_logprobs keys
    text_class [V] the lowest id with the same text: keys that meet in one top_logprobs dict
    chars      [V] the text's length in code points (OpenAI's text_offset); 0 without a tokenizer

A token's text is the tokenizer's piece, or vLLM's "token_id:<id>" without one (response.py). Without
a tokenizer the answer's `text` is empty, so every token's text_offset is 0: an offset into the text
returned, not into the placeholders.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import orjson

from service.engine.contract import TokenText
from service.http.completions.bytepool import Ints, Pool

KEY_WIDTH, DECODED_WIDTH = 24, 32  # bytes per copy of a key and of a decoded_token (jsonwriter.py)


@dataclass(frozen=True, slots=True)
class TokenPieces:
    vocab_size: int
    key: Pool
    decoded: Pool
    rank: Pool
    text: Pool
    text_class: Ints
    chars: Ints
    shared_texts: bool  # some ids have one text (never without a tokenizer: "token_id:<id>")

    @classmethod
    def build(cls, token_text: TokenText | None, vocab_size: int) -> TokenPieces:
        ids = range(vocab_size)
        texts = [token_text.piece(i) if token_text is not None else f"token_id:{i}" for i in ids]
        quoted = [orjson.dumps(t) for t in texts]
        digits = [str(i).encode() for i in ids]
        first: dict[str, int] = {}
        text_class = np.array([first.setdefault(t, i) for i, t in enumerate(texts)], dtype=np.int64)
        return cls(
            vocab_size=vocab_size,
            key=Pool.of(
                [b',"' + d + b'":{"logprob":' for d in digits]
                + [b',{"' + d + b'":{"logprob":' for d in digits],
                head=KEY_WIDTH,
            ),
            decoded=Pool.of(
                [q + b"}" for q in quoted] if token_text is not None else [b"null}"] * vocab_size,
                head=DECODED_WIDTH,
            ),
            rank=Pool.of([b',"rank":%d,"decoded_token":' % r for r in range(vocab_size + 1)]),
            text=Pool.of([b"," + q + b":" for q in quoted] + [b",{" + q + b":" for q in quoted]),
            text_class=text_class,
            chars=np.fromiter(map(len, texts), dtype=np.int64, count=vocab_size)
            if token_text is not None
            else np.zeros(vocab_size, dtype=np.int64),
            shared_texts=len(first) < vocab_size,
        )


@dataclass(frozen=True, slots=True)
class _Built:
    token_text: TokenText | None
    pieces: TokenPieces


class PiecesCache:
    """The pieces of the served vocabulary: built on first use (about a second at 152k ids), again
    only when the serving engine's tokenizer or vocabulary changes (a reload)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._built: _Built | None = None

    def get(self, token_text: TokenText | None, vocab_size: int) -> TokenPieces:
        with self._lock:
            built = self._built
            if built is None or built.token_text is not token_text or built.pieces.vocab_size != vocab_size:
                built = self._built = _Built(token_text, TokenPieces.build(token_text, vocab_size))
            return built.pieces

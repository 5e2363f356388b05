"""The checkpoint's tokenizer as TokenText: the text of token ids for the completions surface.

Scoring never tokenizes (requests carry token ids); only the OpenAI / vLLM completions answer names
tokens by their text (`decoded_token`, `tokens`). A model directory holding a tokenizer
(tokenizer.json, tokenizer_config.json, tokenizer.model or vocab.json) is loaded with transformers'
AutoTokenizer, offline; `piece(id)` is `tokenizer.decode([id])`, as vLLM's `decoded_token`
(vllm/tokenizers/detokenizer_utils.py, convert_ids_list_to_tokens), read from a table of every id
of the model's vocabulary built once at load ("" past the tokenizer's own vocabulary).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.engine.contract import TokenText

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True, slots=True)
class CheckpointTokens:
    """TokenText over a loaded tokenizer; pieces: [vocab_size] the text of each id alone."""

    tokenizer: Any
    pieces: tuple[str, ...]

    def piece(self, token_id: int) -> str:
        return self.pieces[token_id]

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(token_ids)))


def load_token_text(model: Path | None, vocab_size: int) -> TokenText | None:
    """The tokenizer saved beside the checkpoint in `model`, or None: no directory (the demo model),
    none of TOKENIZER_FILES in it, or one transformers cannot load offline (logged; scoring goes on)."""
    if model is None or not any((model / name).is_file() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    except (OSError, ValueError, ImportError) as exc:  # scoring needs no tokenizer: serve without text
        log.warning(
            "the tokenizer in %s did not load (%s: %s): token text is null", model, type(exc).__name__, exc
        )
        return None
    known = min(len(tokenizer), vocab_size)
    pieces = tokenizer.batch_decode([[i] for i in range(known)])
    log.info("tokenizer of %s: %d of the model's %d ids have text", model, known, vocab_size)
    return CheckpointTokens(tokenizer=tokenizer, pieces=(*pieces, *([""] * (vocab_size - known))))

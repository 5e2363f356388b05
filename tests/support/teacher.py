"""A teacher for the /v1/completions tests: a tiny qwen2 with a word-level tokenizer saved beside it,
its float64 reference, and a real `python -m service serve` of it (tests/conftest.py's fixtures
teacher_dir, teacher_reference, teacher_server)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tests.support import ROOT, models
from tests.support.servers import free_port, server_process

MAX_TOP = 64  # the server's --max-top-logprobs here: under the vocabulary of 96, so -1 is over it
TOLERANCE = 1e-4  # float32 service against the float64 reference (docs/semantics.md)


def save_tokenizer(directory: Path) -> None:
    """A word-level tokenizer of the tiny models' 96 ids, built offline: <pad> <s> </s> w3 .. w95."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers import models as tokenizer_models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, models.VOCAB)}}
    tokenizer = Tokenizer(tokenizer_models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece()
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<pad>"
    )
    fast.save_pretrained(directory)


def save(directory: Path) -> Path:
    """The teacher checkpoint (qwen2, seed 3) with its tokenizer, in `directory`."""
    models.save("qwen2", directory, seed=3)
    save_tokenizer(directory)
    return directory


@dataclass(frozen=True)
class Reference:
    """The checkpoint in float64, one unpadded sequence at a time."""

    model: Any

    @classmethod
    def of(cls, directory: Path) -> Reference:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            directory, attn_implementation="eager", dtype=torch.float64
        )
        return cls(model.eval())  # type: ignore[no-untyped-call]

    @torch.no_grad()
    def logprobs(self, tokens: list[int], temperature: float = 1.0) -> torch.Tensor:
        """[L, vocab] log_softmax(logits / T): row t is the distribution of token t + 1."""
        logits = self.model(torch.tensor([tokens])).logits[0]
        return torch.log_softmax(logits / temperature, dim=-1)


def top_k(row: torch.Tensor, k: int) -> list[int]:
    """The k most likely ids of one [vocab] row, ties broken by the lower id."""
    return sorted(range(row.shape[0]), key=lambda v: (-row[v].item(), v))[:k]


@contextmanager
def serving(directory: Path, log: Path) -> Iterator[str]:
    """`python -m service serve --model <directory>` on loopback (CPU, float32); its base URL once ready."""
    port = free_port()
    env = {
        **os.environ,
        # the checkout first, then whatever the environment adds (a GPU host's packages on PYTHONPATH)
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
        "LOGPROBD_DRAIN_SECONDS": "0",
        "LOGPROBD_DEVICE": "cpu",
        "LOGPROBD_DTYPE": "float32",
        "LOGPROBD_MAX_TOP_LOGPROBS": str(MAX_TOP),
    }
    command = [sys.executable, "-m", "service", "serve", "--model", str(directory), "--port", str(port)]
    with server_process(command, port, env=env, log=log, timeout=180, what="the teacher server") as url:
        yield url

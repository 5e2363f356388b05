"""CPU time to write a distillation teacher's /v1/completions answer: TRL's prompt_logprobs call.

    python -m benchmarks.probes.completions_render [--prompts 8] [--length 4096] [--k 100] [--vocab 151936]

Scores as the engine returns them (random: the top K distinct ids per position, sorted log-probs, the
prompt's token among them six times in ten), token text from a synthetic table of realistic pieces
(words with and without a leading space, punctuation, CJK, emoji, byte tokens' "\\ufffd", runs of
spaces and newlines). Prints, best of --reps: `after` (service/http/completions/response.py's chunks, the
server's path, on response.RENDER_THREADS threads: min(4, cores)) and `before` (the same answer as
Python dicts through orjson.dumps, as the service wrote it before jsonwriter.py; --no-before skips
it), the document's size, the one-off build of the vocabulary's pieces, and that both give the same
bytes.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from typing import Any

import numpy as np
import orjson

from service.core.jobs import SequenceScores
from service.http.completions.pieces import TokenPieces
from service.http.completions.plan import CompletionPlan
from service.http.completions.response import completion_chunks

FLOOR = -9999.0


class SyntheticText:
    """TokenText over `vocab` made-up pieces in the proportions of a BPE vocabulary."""

    def __init__(self, vocab: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
        kinds = rng.choice(6, size=vocab, p=[0.35, 0.3, 0.1, 0.1, 0.1, 0.05])
        lengths = rng.integers(1, 12, size=vocab)
        pieces = []
        for i in range(vocab):
            kind, n = int(kinds[i]), int(lengths[i])
            if kind == 0:
                pieces.append(" " + "".join(rng.choice(list(letters), size=n)))
            elif kind == 1:
                pieces.append("".join(rng.choice(list(letters), size=n)))
            elif kind == 2:
                pieces.append("".join(chr(0x4E00 + int(c)) for c in rng.integers(0, 20000, size=1 + n % 3)))
            elif kind == 3:
                pieces.append(
                    str(rng.choice(['"', "\\", ".", ",", "()", "{\n", "});", "=>", "🙂", "é"])) * (1 + n % 2)
                )
            elif kind == 4:
                pieces.append(" " * n if i % 2 else "\n" * (1 + n % 3) + "\t" * (n % 2))
            else:
                pieces.append("\ufffd")
        self.pieces = pieces

    def piece(self, token_id: int) -> str:
        return self.pieces[token_id]

    def decode(self, token_ids: Any) -> str:
        return "".join(self.pieces[t] for t in token_ids)


def teacher_call(
    prompts: int, length: int, k: int, vocab: int, seed: int = 1
) -> tuple[CompletionPlan, list[SequenceScores]]:
    """The plan and scores of `prompts` prompts of `length` tokens with prompt_logprobs k (max_tokens 0)."""
    rng = np.random.default_rng(seed)
    token_lists, scores = [], []
    n = length - 1
    for _ in range(prompts):
        base = rng.integers(0, vocab, size=(n, 1))
        top_ids = (base + np.arange(k) * 7919) % vocab  # distinct: 7919 is prime, k < vocab
        top_lps = -np.cumsum(rng.exponential(0.15, size=(n, k)), axis=1).astype(np.float32)
        among = rng.random(n) < 0.6
        slot = rng.integers(0, k, size=n)
        token = np.where(among, top_ids[np.arange(n), slot], rng.integers(0, vocab, size=n))
        rank = np.where(among, slot + 1, rng.integers(k + 1, vocab, size=n))
        logprob = np.where(among, top_lps[np.arange(n), slot], top_lps[:, -1] - rng.exponential(2.0, size=n))
        token_lists.append(np.concatenate([[1], token]).astype(np.int64))
        scores.append(
            SequenceScores(
                logprobs=logprob.astype(np.float32),
                entropy=None,
                top_ids=top_ids.astype(np.int64),
                top_logprobs=top_lps,
                ranks=rank.astype(np.int64),
            )
        )
    plan = CompletionPlan(
        prompts=token_lists, jobs=[], prompt_k=k, logprobs_k=None, echo=False, draw=False, greedy=True
    )
    return plan, scores


def dict_body(
    plan: CompletionPlan, scores: list[SequenceScores], text: SyntheticText, rid: str, created: int
) -> bytes:
    """The answer as Python dicts through orjson.dumps: the service's path before jsonwriter.py."""

    def lp(x: float) -> float:
        return x if x >= FLOOR else FLOOR

    choices = []
    k = plan.prompt_k or 0
    for i, (prompt, s) in enumerate(zip(plan.prompts, scores, strict=True)):
        assert s.ranks is not None
        assert s.top_ids is not None
        assert s.top_logprobs is not None
        tokens, lps, ranks = prompt.tolist(), s.logprobs.tolist(), s.ranks.tolist()
        top_ids, top_lps = s.top_ids.tolist(), s.top_logprobs.tolist()
        entries: list[Any] = [None]
        for p in range(len(tokens) - 1):
            t = tokens[p + 1]
            entry = {str(t): {"logprob": lp(lps[p]), "rank": ranks[p], "decoded_token": text.piece(t)}}
            for j in range(k):
                u = top_ids[p][j]
                entry[str(u)] = {"logprob": lp(top_lps[p][j]), "rank": j + 1, "decoded_token": text.piece(u)}
            entries.append(entry)
        choices.append(
            {
                "index": i,
                "text": "",
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
                "prompt_logprobs": entries,
            }
        )
    usage = {"prompt_tokens": plan.input_tokens, "completion_tokens": 0, "total_tokens": plan.input_tokens}
    body = {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": "teacher",
        "choices": choices,
        "usage": usage,
    }
    return orjson.dumps(body)


def best(reps: int, run: Any) -> tuple[float, Any]:
    times, out = [], None
    for _ in range(reps):
        began = time.perf_counter()
        out = run()
        times.append(time.perf_counter() - began)
        del out
    began = time.perf_counter()
    out = run()
    times.append(time.perf_counter() - began)
    return min(times), out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.probes.completions_render", description=__doc__
    )
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--k", type=int, default=100)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--no-before", action="store_true", help="skip the dict path (seconds, GBs)")
    args = parser.parse_args(argv)
    text = SyntheticText(args.vocab)
    began = time.perf_counter()
    pieces = TokenPieces.build(text, args.vocab)
    built = time.perf_counter() - began
    plan, scores = teacher_call(args.prompts, args.length, args.k, args.vocab)
    plan = replace(plan, prompt_k=args.k)
    rid, created = "cmpl-bench", 0

    def after() -> list[bytes]:
        return completion_chunks(
            plan,
            scores,
            [None] * len(scores),
            model="teacher",
            token_text=text,
            pieces=pieces,
            request_id=rid,
            created=created,
        )

    seconds, chunks = best(args.reps - 1, after)
    size = sum(map(len, chunks))
    entries = sum((len(p) - 1) for p in plan.prompts) * (args.k + 1)
    shape = f"{args.prompts} x {args.length} positions, K={args.k}, vocab {args.vocab}"
    print(f"{shape}: {entries / 1e6:.2f} M entries")
    print(f"pieces of the vocabulary (once per server): {built:.3f} s")
    print(f"after  (jsonwriter, {len(chunks)} chunks): {seconds:.3f} s, {size / 1e6:.1f} MB")
    if not args.no_before:
        before, document = best(0, lambda: dict_body(plan, scores, text, rid, created))
        print(f"before (dicts + orjson.dumps):     {before:.3f} s, {len(document) / 1e6:.1f} MB")
        print(f"same bytes: {document == b''.join(chunks)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A large completions answer sent a choice at a time, as each prompt's scores arrive.

A distillation teacher's call (8 prompts of 4,096 tokens, prompt_logprobs 100) answers ~230 MB
that a client reads at a few hundred MB/s, and its prompts are scored in a few micro-batches. The
batcher sets each prompt's future as its micro-batch is collected (Batcher.submit_each), so choice
i is checked and written (response.choice_stream, its blocks on the render pool) as soon as prompt
i's scores and drawn token are in, while later prompts compute, and sent after choice i - 1: the
bytes are response.completion_chunks' for the same scores.

When (`streams`): more than one prompt and an answer of about STREAM_CHUNKS chunks or more,
estimated as the scored positions x (the K shown + 1) x ENTRY_BYTES (fewer bytes than any entry
takes, so the estimate errs low). Smaller answers are sent whole, after every prompt's scores.

The status is settled by choice 0: the route waits for it (an engine failure, bad scores, the
deadline or a disconnect answer as they do for a whole answer), then sends 200, chunked. A later
failure (a micro-batch failing, scores the writer cannot write, the deadline passing) can no longer
change it: the connection is cut before the chunked body's end, which HTTP clients report as an
incomplete body; the failure is logged and counted by its kind. A client that goes away cancels
what is queued (its sequences never reach the engine) and the writing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

from fastapi import Request

from service.core.errors import ClientDisconnected, DeadlineExceeded, ServiceError
from service.core.jobs import SequenceScores
from service.http.bodies import answer_or_give_up
from service.http.completions import response
from service.http.completions.plan import CompletionPlan
from service.http.completions.response import (
    Drawn,
    Shared,
    answer_head,
    answer_tail,
    render_pool,
)

log = logging.getLogger(__name__)

STREAM_CHUNKS = 4  # an answer of about this many response.CHUNK_BYTES or more goes a choice at a time
ENTRY_BYTES = 20  # the least one shown (token, log-prob) entry takes in either form's JSON

DrawFor = Callable[[int, SequenceScores], Awaitable[Drawn | None]]


def estimated_bytes(plan: CompletionPlan) -> int:
    """The answer's size, from below: every scored position shows its token and the K most likely."""
    shown = (plan.prompt_k or 0) + (plan.logprobs_k or 0)
    return plan.scored_tokens * (shown + 1) * ENTRY_BYTES


def streams(plan: CompletionPlan) -> bool:
    """Whether the answer goes a choice at a time (StreamedAnswer) rather than whole."""
    return len(plan.prompts) > 1 and estimated_bytes(plan) >= STREAM_CHUNKS * response.CHUNK_BYTES


class StreamedAnswer:
    """The choices of `plan` over `scores` (one future per prompt, Batcher.submit_each), each written
    once its scores and `drawn(i, scores)` (the token drawn after prompt i, or None) are in.
    `first` settles the status; `rest` is the body; `drop` cancels what has not run."""

    def __init__(
        self,
        plan: CompletionPlan,
        scores: list[asyncio.Future[SequenceScores]],
        drawn: DrawFor,
        cached: Callable[[], int] = lambda: 0,
    ) -> None:
        """`cached()`: the prompt tokens the prefix cache served, once every prompt is scored."""
        self._plan = plan
        self._cached = cached
        self._scores = scores
        self._drawn = drawn
        self._pool = render_pool()
        self._shared: Shared | None = None
        self._choices: list[asyncio.Task[Iterator[bytes]]] = []

    async def first(self, shared: Callable[[], Shared]) -> Iterator[bytes]:
        """Build `shared` on a thread (the vocabulary's pieces, while the prompts compute), start
        every choice's writing, and return choice 0's chunks: its failure is the request's."""
        self._shared = await asyncio.to_thread(shared)
        self._choices = [asyncio.ensure_future(self._choice(i)) for i in range(len(self._scores))]
        return await asyncio.shield(self._choices[0])

    async def _choice(self, i: int) -> Iterator[bytes]:
        scores = await self._scores[i]
        drawn = await self._drawn(i, scores)
        assert self._shared is not None
        return await asyncio.to_thread(
            response.choice_stream, self._plan, i, scores, drawn, h=self._shared, pool=self._pool
        )

    async def rest(
        self, http: Request, first: Iterator[bytes], deadline: float, on_done: Callable[[str], None]
    ) -> AsyncIterator[bytes]:
        """The answer's bytes, choice 0's chunks given; each later choice awaited until `deadline`
        (time.perf_counter()) or the client's disconnect. `on_done(outcome)` once sent ("ok") or
        given up (the error's kind)."""
        assert self._shared is not None
        outcome = "internal_error"
        try:
            yield answer_head(self._shared)
            chunks = first
            for i in range(len(self._choices)):
                if i:
                    chunks = await self._next(http, i, deadline)
                while (chunk := await asyncio.to_thread(next, chunks, None)) is not None:
                    yield chunk
                    del chunk
            outcome = "ok"
            yield answer_tail(self._plan, self._cached())
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "ok" if outcome == "ok" else "client_disconnected"
            raise
        except ClientDisconnected:
            outcome = "client_disconnected"
            log.info("completions: the client left after the first byte; its queued work was dropped")
            raise
        except ServiceError as exc:
            outcome = exc.kind
            log.error("completions: the answer is cut after its first byte: %s", exc.message)
            raise
        except Exception:
            log.exception("completions: the answer failed after its first byte; the connection is cut")
            raise
        finally:
            on_done(outcome)
            self.drop()

    async def _next(self, http: Request, i: int, deadline: float) -> Iterator[bytes]:
        """Choice i's chunks once written; DeadlineExceeded past `deadline`, ClientDisconnected as
        soon as the client goes (not at the next write)."""
        task = self._choices[i]
        if not task.done():
            try:
                await answer_or_give_up(http, asyncio.shield(task), max(deadline - time.perf_counter(), 0.0))
            except DeadlineExceeded:
                raise DeadlineExceeded(
                    f"choice {i} was not scored within the deadline; its unscored work was dropped"
                ) from None
        return task.result()

    def drop(self) -> None:
        """Cancel what has not run: queued sequences leave the batcher, pending writing stops; every
        failure retrieved (seen once, never logged again as lost)."""
        for future in self._scores:
            if not future.cancel() and not future.cancelled():
                future.exception()
        for task in self._choices:
            task.cancel()
            task.add_done_callback(_retrieve)
        self._pool.shutdown(wait=False, cancel_futures=True)


def _retrieve(task: asyncio.Task[Iterator[bytes]]) -> None:
    if not task.cancelled():
        task.exception()

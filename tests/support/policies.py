"""The batcher's policy driven by hand, without an event loop: requests enqueued with a future per
sequence, micro-batches taken and checked to refuse and release nothing."""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future

import numpy as np

from service.batcher.policy import Policy
from service.batcher.queue import Batch, Request
from service.core.jobs import SequenceJob, SequenceScores

Answer = Future[SequenceScores]
SERVING = {"policy": "v1"}


def grouped(response: int, first: int, prompt: int = 100) -> SequenceJob:
    """A sequence of the shared prompt (tokens 0..`prompt`-1) and its own response."""
    tokens = np.concatenate([np.arange(prompt), np.arange(first, first + response)]).astype(np.int64)
    return SequenceJob(tokens, np.arange(prompt, prompt + response, dtype=np.int64), 1.0, False)


def submit(
    policy: Policy[Answer],
    jobs: list[SequenceJob],
    pins: Mapping[str, str] | None = None,
    batch_tokens: int | None = None,
) -> Request[Answer]:
    request: Request[Answer] = Request(pins or {}, batch_tokens=batch_tokens)
    request.futures = [Future() for _ in jobs]
    policy.enqueue(request, jobs)
    return request


def take(policy: Policy[Answer], only_started: bool = False) -> Batch[Answer]:
    taken = policy.take(only_started)
    assert taken.refused == []
    assert taken.release is None
    return taken.batch

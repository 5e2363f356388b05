"""A deterministic engine with no model, for testing the layers above the engine."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import numpy as np

from service.engine.base import EngineInfo, OutOfMemory
from service.jobs import SequenceJob, SequenceScores


class FakeEngine:
    """logprob of action t = -(x_t + t) / T; entropy = t. Records every micro-batch it sees."""

    def __init__(
        self, delay: float = 0.0, fail_on_token: int | None = None, oom_over_tokens: int | None = None
    ) -> None:
        self.delay = delay
        self.fail_on_token = fail_on_token
        self.oom_over_tokens = oom_over_tokens  # raise OutOfMemory on larger micro-batches
        self.batches: list[list[int]] = []  # token count of each sequence, per micro-batch
        self.threads: set[str] = set()
        self.info = EngineInfo(
            model="fake",
            demo=False,
            architecture="Fake",
            dtype="float32",
            device="cpu",
            attention_backend="none",
            kernels="none",
            vocab_size=1000,
            max_positions=4096,
            versions={},
        )

    def warm_up(self) -> None:
        pass

    def score(self, jobs: Sequence[SequenceJob]) -> list[SequenceScores]:
        self.threads.add(threading.current_thread().name)
        self.batches.append([job.num_tokens for job in jobs])
        if self.delay:
            time.sleep(self.delay)
        if self.fail_on_token is not None and any(self.fail_on_token in job.tokens for job in jobs):
            raise RuntimeError("injected failure")
        if self.oom_over_tokens is not None and sum(job.num_tokens for job in jobs) > self.oom_over_tokens:
            raise OutOfMemory("injected out-of-memory")
        return [expected_scores(job) for job in jobs]


def expected_scores(job: SequenceJob) -> SequenceScores:
    values = -(job.tokens[job.actions] + job.actions).astype(np.float32) / np.float32(job.temperature)
    return SequenceScores(logprobs=values, entropy=job.actions.astype(np.float32))

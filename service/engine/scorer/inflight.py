"""A launched micro-batch: its scores copied to host memory behind the device's queued work, and
split back per sequence when the batcher collects them (any thread; `result` waits on an event).

Boundary: device tensors [A] in (scores of the micro-batch's action rows, in packing order; the
recorded MoE routes of its rows), and [R, ...] ones of the rows that asked more (the head's
ExtraScores); one SequenceScores per job out, with only the extras its job asked.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from service.core.jobs import FloatArray, IntArray, SequenceJob, SequenceScores, route_dtype
from service.engine.batch.asks import Extras
from service.engine.batch.packing import PackedBatch
from service.engine.batch.route_buffers import TORCH_DTYPES, RecordedRoutes
from service.engine.contract import MoeShape
from service.engine.heads.base import ExtraScores

# the host copy's top ids: ExtraScores' int64 narrowed on the device (any vocabulary fits), so the
# copy moves half the bytes and the answer's frame takes them as they are (its i4)
HOST_ID_DTYPE = torch.int32


@dataclass(frozen=True, slots=True)
class HostExtras:
    """ExtraScores copied to the host (filled once `done`), and the rows [R] they belong to."""

    rows: IntArray
    top_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None
    ranks: torch.Tensor
    candidate_logprobs: torch.Tensor | None
    processed: torch.Tensor | None
    drawn: torch.Tensor | None

    def of(self, job: SequenceJob, first: int, count: int) -> dict[str, Any]:
        """SequenceScores' extra fields of the job whose actions are rows [first, first + count)."""
        at = int(np.searchsorted(self.rows, first))
        cut = slice(at, at + count)

        def take(t: torch.Tensor | None, width: int | None = None) -> Any:
            assert t is not None
            values = t.numpy()[cut]
            return values if width is None else values[:, :width]

        out: dict[str, Any] = {}
        if job.top_logprobs:
            out |= {
                "top_ids": take(self.top_ids, job.top_logprobs),
                "top_logprobs": take(self.top_logprobs, job.top_logprobs),
                "ranks": take(self.ranks),
            }
        if job.candidate_ids is not None:
            out["candidate_logprobs"] = take(self.candidate_logprobs, int(job.candidate_ids.shape[-1]))
        if job.sampling is not None:
            out["processed_logprobs"] = take(self.processed)
        if job.draw_seed is not None:
            out["drawn"] = take(self.drawn)
        return out


def no_extras(job: SequenceJob) -> dict[str, Any]:
    """The extra fields of a job with no action rows: empty arrays."""
    out: dict[str, Any] = {}
    if job.top_logprobs:
        out |= {
            "top_ids": np.zeros((0, job.top_logprobs), dtype=np.int32),
            "top_logprobs": np.zeros((0, job.top_logprobs), dtype=np.float32),
            "ranks": np.zeros(0, dtype=np.int64),
        }
    if job.candidate_ids is not None:
        out["candidate_logprobs"] = np.zeros((0, job.candidate_ids.shape[-1]), dtype=np.float32)
    if job.sampling is not None:
        out["processed_logprobs"] = np.zeros(0, dtype=np.float32)
    if job.draw_seed is not None:
        out["drawn"] = np.zeros(0, dtype=np.int64)
    return out


@dataclass(frozen=True, slots=True)
class InFlight:
    """A launched micro-batch: its [A] float32 scores, host tensors that the copies queued on the
    device fill; `done` is recorded after those copies (None: computed on the host, ready)."""

    jobs: Sequence[SequenceJob]
    actions_per_sequence: list[int]
    logprobs: torch.Tensor
    entropy: torch.Tensor | None
    ref_logprobs: torch.Tensor | None
    values: torch.Tensor | None
    done: torch.cuda.Event | None
    expert_counts: torch.Tensor | None = None  # [layers, E] int32 host copy: decoder.expert_counts
    extras: HostExtras | None = None
    routes: RecordedRoutes | None = None  # where a sequence gave or asked for MoE routes

    def expert_load(self) -> IntArray | None:
        if self.done is not None:
            self.done.synchronize()
        return None if self.expert_counts is None else self.expert_counts.numpy().astype(np.int64)

    def result(self) -> list[SequenceScores]:
        if self.done is not None:
            self.done.synchronize()  # releases the GIL while the device works
        firsts = np.concatenate(([0], np.cumsum(self.actions_per_sequence)))
        splits = firsts[1:-1]

        def per_sequence(values: torch.Tensor | None) -> list[FloatArray] | None:
            # views of the host tensor, which they keep alive (its pinned block is not reused under them)
            return None if values is None else np.split(values.numpy(), splits)

        lp, ent = per_sequence(self.logprobs), per_sequence(self.entropy)
        rf, vl = per_sequence(self.ref_logprobs), per_sequence(self.values)
        assert lp is not None
        scores = []
        for i, job in enumerate(self.jobs):
            routes, agreement = self.routes.of(i, job) if self.routes is not None else (None, None)
            scores.append(
                SequenceScores(
                    logprobs=lp[i],
                    entropy=ent[i] if ent is not None and job.return_entropy else None,
                    values=vl[i] if vl is not None and job.return_values else None,
                    ref_logprobs=rf[i] if rf is not None and job.return_ref else None,
                    routes=routes,
                    route_agreement=agreement,
                    **self._extras(job, int(firsts[i]), self.actions_per_sequence[i]),
                )
            )
        return scores

    def _extras(self, job: SequenceJob, first: int, count: int) -> dict[str, Any]:
        if not job.wants_extras:
            return {}
        if count == 0 or self.extras is None:
            return no_extras(job)
        return self.extras.of(job, first, count)


def host_copier(device: torch.device, rows: int) -> Callable[[torch.Tensor | None], torch.Tensor | None]:
    """A float32 host copy of a device tensor's first `rows`: on CUDA, into pinned memory, queued on
    the stream."""

    def copy(values: torch.Tensor | None) -> torch.Tensor | None:
        if values is None:
            return None
        values = values[:rows]
        if device.type != "cuda":
            return values.float().cpu()
        host = torch.empty(values.shape, dtype=torch.float32, pin_memory=True)
        host.copy_(values, non_blocking=True)
        return host

    return copy


def extra_host(device: torch.device, asked: Extras | None, scores: ExtraScores | None) -> HostExtras | None:
    """Host copies of the asking rows' ExtraScores, one per field for the whole micro-batch (pinned,
    queued on the stream on CUDA); top ids as HOST_ID_DTYPE."""
    if asked is None or scores is None:
        return None

    def copy(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None or device.type != "cuda":
            return None if t is None else t.cpu()
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        return host

    ranks = copy(scores.ranks)
    assert ranks is not None
    return HostExtras(
        rows=asked.rows,
        top_ids=copy(None if scores.top_ids is None else scores.top_ids.to(HOST_ID_DTYPE)),
        top_logprobs=copy(scores.top_logprobs),
        ranks=ranks,
        candidate_logprobs=copy(scores.candidate_logprobs),
        processed=copy(scores.processed),
        drawn=copy(scores.drawn),
    )


def host_counts(counts: torch.Tensor | None) -> torch.Tensor | None:
    """A host copy of device counts; on CUDA, into pinned memory, queued on the stream."""
    if counts is None or counts.device.type != "cuda":
        return None if counts is None else counts.clone()
    host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
    host.copy_(counts, non_blocking=True)
    return host


def host_routes(
    batch: PackedBatch, jobs: Sequence[SequenceJob], shape: MoeShape | None
) -> RecordedRoutes | None:
    """Host copies of what the policy's forward over `batch` recorded (batch/device_routes.py), queued on the
    stream: the experts used, in the narrowest dtype, where a sequence asked for them; each row's
    agreement counts where one gave routes."""
    routes, rows = batch.routes, batch.route_rows
    if routes is None or rows is None:
        return None
    assert shape is not None
    used = None
    if any(job.return_routes for job in jobs):
        used = host_counts(routes.used.to(TORCH_DTYPES[route_dtype(shape.experts)]))
    agreement = routes.agreement()
    exact, matches = (None, None) if agreement is None else (host_counts(a) for a in agreement)
    return RecordedRoutes(rows, shape.top_k, used, exact, matches)


def done_event(device: torch.device) -> torch.cuda.Event | None:
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record()
    return event

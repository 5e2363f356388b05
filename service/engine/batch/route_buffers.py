"""A micro-batch's MoE routes: the given ones (replay, R3) laid out on the packed row, the buffers the
forward records into (R2), and back on the host, each sequence's routes and route agreement.

Boundary: SequenceJobs (GivenRoutes, return_routes), the row's segments and the policy's MoeShape in;
device_routes.py's BatchRoutes on the device out; after the forward, host copies in and per sequence
`routes` [P, layers, k] and a RouteAgreement out.

A segment of the row (a Forest node, or the chunk) holds positions [start, end) of its owner's
sequence; its given routes are the owner's over them. Sequences share a node only while their
routes over it are equal (prefixes.py), so the owner's are every one's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from service.core.jobs import Chunk, IntArray, RouteAgreement, SequenceJob, route_dtype
from service.core.prefixes import Forest, routes_agree
from service.engine.batch.device_routes import BatchRoutes
from service.engine.contract import MoeShape

# jobs.route_dtype's dtypes as torch's
TORCH_DTYPES = {
    np.dtype(np.uint8): torch.uint8,
    np.dtype(np.int16): torch.int16,
    np.dtype(np.int32): torch.int32,
}


@dataclass(frozen=True, slots=True)
class RouteRows:
    """Per sequence of the micro-batch (the chunk's last): rows [P] of the packed row holding its
    positions first .. first + P - 1 (the whole sequence, or the chunk's part)."""

    rows: list[IntArray]
    first: list[int]


def wanted(jobs: Sequence[SequenceJob]) -> bool:
    """Whether a forward over `jobs` replays or records routes."""
    return any(job.routes is not None or job.return_routes for job in jobs)


def check(job: SequenceJob, shape: MoeShape | None, index: int) -> None:
    """Raise ValueError naming sequence `index` where its routes do not fit the policy: their shape
    and positions here; ids in range where not in normalise's narrow dtype (jobs.route_dtype), else by
    `_guard`, over the micro-batch's packed ids at once."""
    if shape is None:
        raise ValueError(f"sequence {index}: routes given or asked for, but the policy has no MoE layers")
    routes = job.routes
    if routes is None:
        return
    experts = routes.experts
    if experts.ndim != 3 or experts.shape[1:] != (shape.layers, shape.top_k):
        raise ValueError(
            f"sequence {index}: routes of shape {tuple(experts.shape)}, the policy routes "
            f"[positions, {shape.layers}, {shape.top_k}]"
        )
    if routes.start < 0 or routes.end > job.num_tokens:
        raise ValueError(
            f"sequence {index}: routes cover positions {routes.start}..{routes.end - 1} of {job.num_tokens}"
        )
    if experts.dtype != route_dtype(shape.experts) and not _in_range(experts, shape.experts):
        # not normalise's dtype: checked before packing would cast (and wrap) its ids
        raise ValueError(f"sequence {index}: an expert id outside 0..{shape.experts - 1}")


def _in_range(experts: np.ndarray, count: int) -> bool:
    """Whether every id of `experts` is in 0 .. count - 1: one max (and, for a signed dtype, one min)."""
    if not experts.size:
        return True
    return int(experts.max()) < count and (experts.dtype.kind == "u" or int(experts.min()) >= 0)


def _guard(given: np.ndarray, every: Sequence[SequenceJob], shape: MoeShape) -> None:
    """Raise ValueError naming the first sequence with an expert id outside 0 .. experts - 1 (normalise
    checked them; the route kernel indexes by them): one pass over the packed ids [N, layers, k], the
    sequences looked at only past a fault."""
    if _in_range(given, shape.experts):
        return
    for i, job in enumerate(every):
        if job.routes is not None and not _in_range(job.routes.experts, shape.experts):
            raise ValueError(f"sequence {i}: an expert id outside 0..{shape.experts - 1}")
    raise ValueError(f"an expert id outside 0..{shape.experts - 1}")


def lay_out(  # noqa: PLR0917
    jobs: Sequence[SequenceJob],
    chunk: Chunk | None,
    forest: Forest,
    starts: np.ndarray,
    tokens: int,
    shape: MoeShape | None,
    device: torch.device,
    to: Callable[[np.ndarray], torch.Tensor],
) -> tuple[BatchRoutes, RouteRows] | None:
    """The routes of a row of `tokens` rows whose segments start at rows `starts` (forest's nodes,
    then the chunk's), on `device`; None where no sequence gives or asks for any. The given ids are
    packed on the host into one buffer [tokens, layers, k] of their narrow dtype (pinned on CUDA) and
    copied over without a synchronisation; `to` copies the small arrays."""
    every = [*jobs, chunk.job] if chunk is not None else list(jobs)
    if not wanted(every):
        return None
    for i, job in enumerate(every):
        check(job, shape, i)
    assert shape is not None
    _check_shared(jobs, forest)
    used = torch.zeros((tokens, shape.layers, shape.top_k), dtype=torch.int32, device=device)
    routes = BatchRoutes(used)
    if any(job.routes is not None for job in every):
        segments = [(jobs[n.owner], n.start, n.end) for n in forest.nodes]
        if chunk is not None:
            segments.append((chunk.job, chunk.start, chunk.end))
        given, covered = _packed(segments, starts, tokens, shape, device)
        _guard(given.numpy(), every, shape)
        if device.type != "cpu":
            given = given.to(device, non_blocking=True)  # from pinned memory: queued, no wait
        matches = torch.zeros((tokens, shape.layers), dtype=torch.int8, device=device)
        routes = BatchRoutes(used, given, to(covered), torch.zeros_like(used), matches)
    lengths = np.asarray([n.length for n in forest.nodes], dtype=np.int64)
    rows = [_ranges(starts[list(path)], lengths[list(path)]) for path in forest.paths]
    first = [forest.nodes[path[0]].start for path in forest.paths]  # past 0 where the prefix cache served it
    if chunk is not None:
        own = starts[len(forest.nodes)]
        rows.append(np.arange(own, own + chunk.num_tokens, dtype=np.int64))
        first.append(chunk.start)
    return routes, RouteRows(rows, first)


def _packed(
    segments: Sequence[tuple[SequenceJob, int, int]],
    starts: np.ndarray,
    tokens: int,
    shape: MoeShape,
    device: torch.device,
) -> tuple[torch.Tensor, np.ndarray]:
    """The given ids of the row [tokens, layers, k] in the routes' narrow dtype (a host tensor, pinned
    where `device` is CUDA: torch's pinned-block cache reuses it once its copy is done) and covered
    [tokens] bool. Segment by segment, in row order: each one's covered rows copied from its owner's
    routes (one numpy copy a segment), the rows between them zeroed."""
    dtype = route_dtype(shape.experts)
    host = torch.empty(
        (tokens, shape.layers, shape.top_k),
        dtype=TORCH_DTYPES[dtype],
        pin_memory=device.type == "cuda",
    )
    given = host.numpy()
    covered = np.zeros(tokens, dtype=np.bool_)
    done = 0  # rows below it are written
    for (job, start, end), row in zip(segments, starts.tolist(), strict=False):
        if job.routes is None:
            continue
        lo, hi = max(start, job.routes.start), min(end, job.routes.end)
        if lo >= hi:
            continue
        a, b = row + lo - start, row + hi - start
        given[done:a] = 0
        given[a:b] = job.routes.experts[lo - job.routes.start : hi - job.routes.start]
        covered[a:b] = True
        done = b
    given[done:] = 0
    return host, covered


def _check_shared(jobs: Sequence[SequenceJob], forest: Forest) -> None:
    """Raise ValueError where a node serves a sequence whose routes over it are not its owner's (a
    forest built without the routes: prefixes.share takes them)."""
    for i, path in enumerate(forest.paths):
        for n in path:
            node = forest.nodes[n]
            owner = jobs[node.owner]
            if node.owner != i and routes_agree(owner.routes, jobs[i].routes, node.end) < node.end:
                raise ValueError(
                    f"sequences {node.owner} and {i} share positions {node.start}..{node.end - 1}, "
                    "where their routes differ"
                )


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> IntArray:
    return np.concatenate([np.arange(s, s + n, dtype=np.int64) for s, n in zip(starts, lengths, strict=True)])


@dataclass(frozen=True, slots=True)
class RecordedRoutes:
    """Host copies of a forward's routes (filled once the micro-batch's `done` event has passed):
    used [N, layers, k] (None: no sequence asked for them), and per row exact / matches [N] int32
    (BatchRoutes.agreement; None: nothing given)."""

    rows: RouteRows
    top_k: int
    used: torch.Tensor | None
    exact: torch.Tensor | None
    matches: torch.Tensor | None

    def of(self, index: int, job: SequenceJob) -> tuple[IntArray | None, RouteAgreement | None]:
        """Sequence `index`'s routes [P, layers, k] over its rows' positions (where it asked) and its
        agreement over its covered positions among them (where it gave routes)."""
        rows, first = self.rows.rows[index], self.rows.first[index]
        routes = None
        if job.return_routes and self.used is not None:
            routes = self.used.numpy()[rows]
        agreement = None
        if job.routes is not None and self.exact is not None and self.matches is not None:
            lo = max(job.routes.start, first) - first
            hi = min(job.routes.end, first + rows.shape[0]) - first
            at = rows[lo:hi] if lo < hi else rows[:0]
            exact, matches = self.exact.numpy()[at], self.matches.numpy()[at]
            agreement = RouteAgreement(
                compared=int(at.shape[0]) * int(job.routes.experts.shape[1]),
                exact=int(exact.sum()),
                overlap=float(matches.sum()) / self.top_k,
            )
        return routes, agreement

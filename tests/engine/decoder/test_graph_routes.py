"""CUDA graphs of micro-batches that record (R2) or replay (R3) MoE routes, against the eager forward.

On CPU the EagerRecorder stands in for capture (a replay runs the body again over the static
buffers), as in test_graphs.py: a body that read the batch's own routes instead of the static ones,
records not copied back, a stale given id from the micro-batch before, a mode's graph replayed for
another would show as different hidden states or records. Each micro-batch is packed twice, one copy
for the graphed decoder and one for the eager one, each writing its own records.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from service.core.jobs import GivenRoutes, SequenceJob
from service.engine.batch.packing import PackedBatch, pack
from service.engine.contract import MoeShape
from service.engine.decoder import FusedDecoder
from service.engine.decoder.graphs import EagerRecorder, GraphedDecoder
from service.engine.ops.elementwise import TORCH
from tests.engine.decoder.test_fused import KERNEL, packed_model
from tests.support import models
from tests.support.recorders import Counting

CPU = torch.device("cpu")


def shape_of(decoder: FusedDecoder) -> MoeShape:
    sparse = decoder.sparse_layers
    return MoeShape(len(sparse), int(sparse[0].experts.gate_up_proj.shape[0]), sparse[0].routing.top_k)


def jobs_of(lengths: tuple[int, ...], mode: str, shape: MoeShape, seed: int) -> list[SequenceJob]:
    """Sequences of `lengths`: none routed (live), every one recording (record), or every other one
    giving random distinct routes from position 2 on and the rest recording (replay)."""
    rng = np.random.default_rng(seed)
    jobs = []
    for i, n in enumerate(lengths):
        tokens = rng.integers(3, models.VOCAB, n)
        routes = None
        if mode == "replay" and i % 2 == 0:
            ids = np.argsort(rng.random((n - 3, shape.layers, shape.experts)), axis=-1)[..., : shape.top_k]
            routes = GivenRoutes(2, ids.astype(np.int64))
        job = SequenceJob(tokens, np.arange(1, n), 1.0, False, routes=routes, return_routes=mode != "live")
        jobs.append(job)
    return jobs


def twice(jobs: list[SequenceJob], shape: MoeShape) -> tuple[PackedBatch, PackedBatch]:
    return pack(jobs, CPU, moe=shape), pack(jobs, CPU, moe=shape)


def graphed(model: Any, recorder: EagerRecorder | None = None, limit: int = 16) -> GraphedDecoder:
    inner = FusedDecoder(model.base_model, KERNEL, TORCH, 0)
    return GraphedDecoder(inner, recorder or EagerRecorder(), 512, True, limit)


def assert_same_records(got: PackedBatch, want: PackedBatch) -> None:
    assert got.routes is not None
    assert want.routes is not None
    assert torch.equal(got.routes.used, want.routes.used)
    for a, b in ((got.routes.live, want.routes.live), (got.routes.matches, want.routes.matches)):
        assert (a is None) == (b is None)
        if a is not None and b is not None:
            assert torch.equal(a, b)


# same N (128) across modes and seeds, then another N (256): a stale given id or record would show
BATCHES = [
    ((20, 33, 7, 12), "record"),
    ((50, 40), "replay"),
    ((20, 33, 7, 12), "live"),
    ((30, 25, 9), "replay"),
]
BATCHES += [((100, 90), "replay"), ((100, 90), "record"), ((50, 40), "record"), ((11, 60), "replay")]


Batches = list[tuple[tuple[int, ...], str]]  # each micro-batch's sequence lengths and its routes' mode


def assert_batches(decoder: GraphedDecoder, eager: FusedDecoder, batches: Batches) -> None:
    """Each batch through `decoder` equals the eager forward, the same records."""
    shape = shape_of(eager)
    with torch.inference_mode():
        for seed, (lengths, mode) in enumerate(batches):
            mine, theirs = twice(jobs_of(lengths, mode, shape, seed), shape)
            got = decoder(mine, mine.hidden_index)
            want = eager(theirs, theirs.hidden_index)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            if mode != "live":
                assert_same_records(mine, theirs)


@pytest.mark.parametrize("name", models.MOE_ARCHITECTURES)
def test_routed_replays_equal_the_eager_forward(name: str) -> None:
    model = packed_model(name)
    decoder = graphed(model)
    eager = FusedDecoder(model.base_model, KERNEL, TORCH, 0)
    assert_batches(decoder, eager, BATCHES)
    assert decoder.modes_off == {}
    assert {key.mode for key in decoder._graphs} == {"live", "record", "replay"}
    assert decoder.graphs == 3  # 128 tokens in three modes; 256 in record and replay ran eagerly, met once
    assert decoder.pending == 2
    with torch.inference_mode():
        assert decoder.capture_pending()  # the engine idles: one graph a call
        assert not decoder.capture_pending()
    assert decoder.graphs == 5
    assert_batches(decoder, eager, BATCHES)  # the graphs captured while idle replay every mode
    assert decoder.graphs == 5


def counted(name: str, limit: int = 16) -> tuple[GraphedDecoder, Counting, FusedDecoder]:
    """A graphed decoder of the architecture's tiny model whose captures are counted, and its eager twin."""
    model, recorder = packed_model(name), Counting()
    return graphed(model, recorder, limit), recorder, FusedDecoder(model.base_model, KERNEL, TORCH, 0)


def test_a_routed_shape_met_again_before_the_engine_idles_is_captured_then() -> None:
    decoder, recorder, eager = counted("qwen3_moe")
    assert_batches(decoder, eager, [((20, 33, 7, 12), "record"), ((100, 90), "record")])
    assert (recorder.captures, decoder.pending) == (1, 1)  # the mode's first (checked); 256 queued
    assert_batches(decoder, eager, [((100, 90), "record")])
    assert (recorder.captures, decoder.pending) == (2, 0)
    with torch.inference_mode():
        assert not decoder.capture_pending()
    assert recorder.captures == 2


def test_plan_routed_queues_every_size_in_both_modes_once_both_are_checked() -> None:
    decoder, recorder, eager = counted("mixtral")
    assert decoder.plan_routed() == 0  # no routed micro-batch yet: no static routes, no checks
    assert_batches(decoder, eager, [((20, 33, 7, 12), "record"), ((30, 25, 9), "replay")])
    assert decoder.plan_routed() == 6  # 512, 384, 256 tokens in each mode (128's are captured)
    queued = list(decoder._pending)
    assert [(key.tokens, key.mode) for key in queued[:2]] == [(512, "record"), (512, "replay")]
    with torch.inference_mode():
        while decoder.capture_pending():
            pass
    assert (recorder.captures, decoder.graphs, decoder.pending) == (8, 8, 0)
    sizes: Batches = [((20, 33, 7, 12), "record"), ((100, 90), "replay"), ((200, 100), "record")]
    assert_batches(decoder, eager, [*sizes, ((300, 150), "replay")])
    assert recorder.captures == 8  # every routed micro-batch replayed a graph captured while idle


def test_weights_rebound_queue_every_routed_graph_again() -> None:
    model, other = packed_model("qwen3_moe"), packed_model("qwen3_moe", seed=1)
    decoder = graphed(model, Counting())
    eager = FusedDecoder(model.base_model, KERNEL, TORCH, 0)
    routed: Batches = [((20, 33, 7, 12), "record"), ((30, 25, 9), "replay"), ((100, 90), "replay")]
    assert_batches(decoder, eager, routed)
    decoder.plan_routed()
    with torch.inference_mode():
        while decoder.capture_pending():
            pass
        for param, new in zip(model.parameters(), other.parameters(), strict=True):
            param.data = new.detach().clone()  # a swap reload
    decoder.refresh()
    assert (decoder.graphs, decoder.pending) == (0, 8)  # the old graphs read the old tensors
    with torch.inference_mode():
        while decoder.capture_pending():
            pass
    assert_batches(decoder, FusedDecoder(model.base_model, KERNEL, TORCH, 0), [((100, 90), "replay")])


def test_the_idle_queue_never_evicts_a_graph() -> None:
    decoder, _, eager = counted("qwen3_moe", limit=3)
    assert_batches(decoder, eager, [((20, 33, 7, 12), "record"), ((30, 25, 9), "replay")])
    assert decoder.plan_routed() == 6
    with torch.inference_mode():
        assert decoder.capture_pending()  # the third graph
        assert not decoder.capture_pending()  # the limit: the rest of the queue is dropped
    assert (decoder.graphs, decoder.pending) == (3, 0)
    assert {key.tokens for key in decoder._graphs} == {128, 512}


def test_live_traffic_allocates_no_route_buffers() -> None:
    model = packed_model("qwen3_moe")
    decoder = graphed(model)
    shape = shape_of(decoder.inner)
    with torch.inference_mode():
        batch = pack(jobs_of((20, 33), "live", shape, 0), CPU, moe=shape)
        decoder(batch, batch.hidden_index)
    assert decoder._routes is None
    assert [key.mode for key in decoder._graphs] == ["live"]


class Stale(EagerRecorder):
    """A wrong graph: its replay does nothing."""

    def capture(self, body: Callable[[], None]) -> Callable[[], None]:
        return lambda: None


class Failing(EagerRecorder):
    def capture(self, body: Callable[[], None]) -> Callable[[], None]:
        raise RuntimeError("operation not permitted when stream is capturing")


@pytest.mark.parametrize("recorder", [Stale, Failing], ids=["wrong", "failing"])
def test_a_wrong_routed_graph_turns_its_mode_off(
    recorder: type[EagerRecorder], caplog: pytest.LogCaptureFixture
) -> None:
    """The first graph of a mode checked where captured: wrong or failing, that mode runs eagerly from
    then on (the micro-batch at hand included), with a warning; live graphs stay on."""
    model = packed_model("mixtral")
    decoder = graphed(model, recorder())
    eager = FusedDecoder(model.base_model, KERNEL, TORCH, 0)
    shape = shape_of(eager)
    with torch.inference_mode(), caplog.at_level(logging.WARNING):
        for seed, (lengths, mode) in enumerate(
            [((50, 40), "replay"), ((50, 40), "replay"), ((9, 8), "record")]
        ):
            mine, theirs = twice(jobs_of(lengths, mode, shape, seed), shape)
            torch.testing.assert_close(decoder(mine, mine.hidden_index), eager(theirs, theirs.hidden_index))
            assert_same_records(mine, theirs)
    assert set(decoder.modes_off) == {"replay", "record"}
    assert caplog.text.count("CUDA graphs off for micro-batches with replay routes") == 1
    assert decoder.disabled is None
    assert decoder.graphs == 0


# ---- on the GPU: CUDA capture, the Triton routing kernels, the device's grouped GEMM -----------------


@pytest.mark.gpu
@pytest.mark.parametrize("name", models.MOE_ARCHITECTURES)
def test_cuda_routed_graphs_equal_the_eager_forward(name: str) -> None:
    """bf16, torch_varlen attention, Triton ops (route_kernel replays and records), the grouped GEMM
    `auto` picks: every mode's graphs against the same decoder run eagerly, the same records."""
    from service.engine.decoder import graphs
    from service.engine.moe import grouped_gemm
    from service.engine.ops.attention import choose_backend
    from service.engine.ops.elementwise import Ops

    device = torch.device("cuda")
    backend = choose_backend("torch_varlen", device)
    model = packed_model(name).to(device=device, dtype=torch.bfloat16)
    kernel = grouped_gemm.choose("auto", device, torch.bfloat16)
    ops = Ops.for_device(device, allow_triton=True)
    inner = FusedDecoder(model.base_model, backend.kernel, ops, 0, moe_kernel=kernel)
    decoder = GraphedDecoder(inner, graphs.CudaRecorder(device), 512, False, limit=16)
    shape = shape_of(inner)
    with torch.inference_mode():
        for seed, (lengths, mode) in enumerate(BATCHES):
            jobs = jobs_of(lengths, mode, shape, seed)
            mine, theirs = pack(jobs, device, moe=shape), pack(jobs, device, moe=shape)
            got, want = decoder(mine, mine.hidden_index), inner(theirs, theirs.hidden_index)
            assert float((got.float() - want.float()).norm() / want.float().norm()) < 1e-3
            if mode != "live":
                assert_same_records(mine, theirs)
        assert decoder.pending > 0  # the routed shapes met once: their graphs wait for the idle time
        while decoder.capture_pending():  # captured over whatever the static buffers hold
            pass
        captured = decoder.graphs
        for seed, (lengths, mode) in enumerate(BATCHES):
            jobs = jobs_of(lengths, mode, shape, seed + 100)
            mine, theirs = pack(jobs, device, moe=shape), pack(jobs, device, moe=shape)
            got, want = decoder(mine, mine.hidden_index), inner(theirs, theirs.hidden_index)
            assert float((got.float() - want.float()).norm() / want.float().norm()) < 1e-3
            if mode != "live":
                assert_same_records(mine, theirs)
        assert (decoder.graphs, decoder.pending) == (captured, 0)  # every one replayed a graph
    assert decoder.modes_off == {}
    assert {key.mode for key in decoder._graphs} == {"live", "record", "replay"}

"""CUDA graphs of the fused decoder: the graphed forward against the eager one it records.

On CPU the EagerRecorder stands in for CUDA capture: a "replay" runs the recorded body again, over
the same static buffers. So everything but the CUDA call itself is exercised: a body that read the
batch it was captured with instead of the buffers, boundaries not padded to the graph's slots, a stale
rotary table or residual, a reload the graphs miss. The GPU tests run the CUDA recorder with the
device's attention kernel against the same eager forward.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from service.core.jobs import SequenceJob
from service.core.prefixes import share
from service.engine.batch.packing import PackedBatch, pack
from service.engine.decoder import FusedDecoder, TransformersDecoder, graphs
from service.engine.decoder.graphs import EagerRecorder, GraphedDecoder, GraphKey
from service.engine.ops.attention import choose_backend
from service.engine.ops.elementwise import TORCH, Ops
from service.engine.scorer.engine import PackedScorer
from service.settings import Settings
from tests.engine.decoder.test_fused import KERNEL, packed_model
from tests.support import models
from tests.support.recorders import Counting

CPU = torch.device("cpu")


def batch_of(lengths: tuple[int, ...], seed: int = 0, device: torch.device = CPU) -> PackedBatch:
    rng = np.random.default_rng(seed)
    jobs = [SequenceJob(rng.integers(3, models.VOCAB, n), np.arange(1, n), 1.0, False) for n in lengths]
    return pack(jobs, device)


def groups_of(
    groups: tuple[tuple[int, tuple[int, ...]], ...], seed: int = 0, device: torch.device = CPU
) -> PackedBatch:
    """GRPO-like groups (a prompt's length, its completions' lengths), packed with their prompts shared
    (each completion's segment attends to its prompt's rows through the batch's key_index)."""
    rng = np.random.default_rng(seed)
    jobs = []
    for prompt_length, completions in groups:
        prompt = rng.integers(3, models.VOCAB, prompt_length)
        for length in completions:
            tokens = np.concatenate((prompt, rng.integers(3, models.VOCAB, length)))
            jobs.append(SequenceJob(tokens, np.arange(prompt_length, tokens.shape[0]), 1.0, False))
    batch = pack(jobs, device, forest=share([job.tokens for job in jobs], 4)).attach(None)
    assert batch.context is not None
    assert batch.context.gather is not None
    return batch


def read_rows(batch: PackedBatch) -> torch.Tensor:
    return batch.hidden_index  # the rows the heads read, as the engine passes them


def graphed(model: Any, max_tokens: int = 512, total_bounded: bool = True, **kwargs: Any) -> GraphedDecoder:
    inner = FusedDecoder(model.base_model, KERNEL, TORCH, 0)
    return GraphedDecoder(inner, kwargs.pop("recorder", EagerRecorder()), max_tokens, total_bounded, **kwargs)


# Each batch differs from the one before in what a stale static buffer would carry over: the
# boundaries (same N), the positions, N itself (one graph for 128 tokens, another for 256); and, for
# the kernels whose graphs also split by them, more sequences than 8 slots, a sequence past 128 tokens.
BATCHES = [(20, 33, 7, 12), (50, 40), (3, 9, 11, 2, 30, 5), (100, 90), (10,) * 9, (200, 40), (20, 33, 7, 12)]


def assert_replays(decoder: GraphedDecoder, model: Any, batches: list[PackedBatch]) -> None:
    """Each batch through `decoder` (its graphs) equals the same model's eager fused forward."""
    eager = FusedDecoder(model.base_model, KERNEL, TORCH, 0)
    with torch.inference_mode():
        for batch in batches:
            got, want = decoder(batch, read_rows(batch)), eager(batch, read_rows(batch))
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("total_bounded", [True, False])
def test_replays_equal_the_eager_forward(name: str, total_bounded: bool) -> None:
    """qwen2 and mistral have sliding windows shorter than the sequences; qwen3 has head norms."""
    model = packed_model(name)
    decoder = graphed(model, total_bounded=total_bounded, limit=8)
    assert_replays(decoder, model, [batch_of(lengths, seed) for seed, lengths in enumerate(BATCHES)])
    # one graph per N with a total-bounded kernel; the others also split by sequences and length
    assert decoder.graphs == (2 if total_bounded else 4)


def test_a_micro_batch_of_more_sequences_than_the_start_graphs_hold_gets_a_graph_of_its_own() -> None:
    """A total-bounded graph holds 64 sequences: 70 in the same N replay one of 128 slots, captured when
    first met, beside the 64-slot one, each equal to the eager forward and each replayed again."""
    model = packed_model("qwen2")
    decoder = graphed(model, limit=8)
    few, many = batch_of((60, 100, 40)), batch_of((3,) * 70, seed=1)
    assert few.num_tokens == many.num_tokens == 256
    assert_replays(decoder, model, [few, many])
    assert {key.slots for key in decoder._graphs} == {64, 128}
    assert_replays(decoder, model, [many, few, batch_of((3,) * 64 + (14,), seed=2)])
    assert decoder.graphs == 2


def test_the_graphs_give_transformers_hidden_states() -> None:
    model = packed_model("qwen2")
    batch = batch_of((60, 17, 40))
    every = torch.arange(batch.num_tokens)
    with torch.inference_mode():
        want = TransformersDecoder(model.base_model)(batch, every)
        got = graphed(model, limit=8)(batch, every)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_keys() -> None:
    flash4 = graphed(packed_model("llama"), max_tokens=16384, total_bounded=True, limit=8)
    assert flash4.key(16384, 40, 1500) == GraphKey(16384, 64, 16384)  # one graph per N up to 64 sequences
    assert flash4.key(16384, 64, 250) == GraphKey(16384, 64, 16384)
    assert flash4.key(16384, 65, 250) == GraphKey(16384, 128, 16384)  # more: captured when met
    assert flash4.key(16384, 300, 60) == GraphKey(16384, 512, 16384)
    assert flash4.key(1000, 4, 300) is None  # not a packed micro-batch's shape
    assert flash4.key(16512, 4, 300) is None  # past the buffers
    assert flash4.key(256, 3, 90, 200) == GraphKey(256, 64, 256, keys=131072, max_len_k=131072)
    other = graphed(packed_model("llama"), max_tokens=16384, total_bounded=False, limit=8)
    assert other.key(256, 3, 90, 200) == GraphKey(256, 8, 128, keys=131072, max_len_k=256)
    assert other.key(16384, 40, 1500) == GraphKey(16384, 64, 2048)
    assert other.key(256, 3, 90) == GraphKey(256, 8, 128)
    assert other.key(256, 1, 256) == GraphKey(256, 8, 256)


# Shared micro-batches: the same N with other boundaries and key counts, more segments than 8 slots,
# a prompt past 128 tokens (a longest key segment past 256), and N itself (128, 256, 384 tokens)
GROUPS = [
    ((30, (5, 9, 2)), (20, (7, 7))),
    ((40, (3,) * 12),),
    ((150, (20, 11, 30, 4)),),
    ((60, (10, 40, 3, 25)), (30, (8, 9)), (90, (50,))),
    ((30, (5, 9, 2)), (20, (7, 7))),
]


@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
@pytest.mark.parametrize("total_bounded", [True, False])
def test_shared_prefix_batches_replay_equal_to_the_eager_forward(name: str, total_bounded: bool) -> None:
    """Each group's completions attend to their prompt's keys gathered from the prompt's rows: the
    graph reads the index, its length and the key boundaries from its static buffers."""
    model = packed_model(name)
    decoder = graphed(model, total_bounded=total_bounded, limit=16)
    batches = []
    for seed, groups in enumerate(GROUPS):
        batch = groups_of(groups, seed)
        batches += [batch, batch_of((batch.num_tokens - 40, 40), seed)]  # the same N, no sharing, between
    assert_replays(decoder, model, batches)
    keys = {(key.tokens, key.keys > 0) for key in decoder._graphs}
    assert {(128, True), (256, True), (384, True), (128, False), (256, False), (384, False)} <= keys
    assert decoder.shared_off is None
    assert ("live", True) in decoder._checked  # the first shared graph was checked as it was captured


def test_shared_prefix_batches_give_the_unshared_scores() -> None:
    """Through the graphs, a group's completions score as they do packed whole (no sharing)."""
    model = packed_model("qwen2")
    decoder = graphed(model, limit=8)
    groups = ((40, (10, 30, 5)), (70, (20, 9)))
    shared = groups_of(groups, 3)
    rng = np.random.default_rng(3)
    with torch.inference_mode():
        got = decoder(shared, read_rows(shared))
        jobs = []
        for prompt_length, completions in groups:  # the same tokens as groups_of draws them
            prompt = rng.integers(3, models.VOCAB, prompt_length)
            for length in completions:
                tokens = np.concatenate((prompt, rng.integers(3, models.VOCAB, length)))
                jobs.append(SequenceJob(tokens, np.arange(prompt_length, tokens.shape[0]), 1.0, False))
        whole = pack(jobs, CPU)
        want = decoder(whole, read_rows(whole))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_shared_batch_past_the_key_capacity_runs_eagerly() -> None:
    model = packed_model("qwen2")
    decoder = graphed(model, max_tokens=128, limit=8)  # 1,024 gathered keys at most
    batch = groups_of(((100, (2,) * 12),))  # 12 x 102 keys, 124 tokens
    assert batch.context is not None
    assert batch.context.gather is not None
    assert batch.context.gather.shape[0] > decoder.key_capacity
    with torch.inference_mode():
        got = decoder(batch, read_rows(batch))
        want = FusedDecoder(model.base_model, KERNEL, TORCH, 0)(batch, read_rows(batch))
    torch.testing.assert_close(got, want)
    assert decoder.graphs == 0


def test_a_wrong_shared_graph_turns_off_shared_graphs_only(caplog: pytest.LogCaptureFixture) -> None:
    model = packed_model("qwen2")
    decoder = graphed(model, limit=8, recorder=StaleShared())
    eager = FusedDecoder(model.base_model, KERNEL, TORCH, 0)
    with torch.inference_mode(), caplog.at_level(logging.WARNING):
        decoder.capture(batch_of((20, 33, 7)))
        shared, plain = groups_of(GROUPS[0]), batch_of((20, 33, 7), 1)
        torch.testing.assert_close(decoder(shared, read_rows(shared)), eager(shared, read_rows(shared)))
        torch.testing.assert_close(decoder(plain, read_rows(plain)), eager(plain, read_rows(plain)))
    assert decoder.disabled is None
    assert "hidden states are" in str(decoder.shared_off)
    assert "CUDA graphs off for micro-batches with shared prefixes" in caplog.text
    assert decoder.graphs == 4
    assert all(key.keys == 0 for key in decoder._graphs)


def test_batch_invariant_mode_keeps_shared_batches_eager() -> None:
    """In batch-invariant mode (wrap's batch_invariant) a shared micro-batch runs the eager path the
    mode's bitwise suite covers: no shared graph is checked, captured or replayed."""
    model = packed_model("qwen2")
    decoder = graphed(model, limit=16, recorder=(recorder := Counting()), shared=False)
    with torch.inference_mode():
        decoder.capture(batch_of((20, 33, 7)))
        assert recorder.captures == 4  # the probe's and every size's, none shared
        assert_replays(decoder, model, [groups_of(GROUPS[0]), groups_of(GROUPS[2], 2)])
    assert recorder.captures == 4
    assert all(key.keys == 0 for key in decoder._graphs)
    assert "batch-invariant" in str(decoder.shared_off)


class StaleShared(EagerRecorder):
    """Shared graphs whose replay leaves the residual stream as it was (a stale key buffer's effect)."""

    def capture(self, body: Callable[[], None]) -> Callable[[], None]:
        self.calls = getattr(self, "calls", 0) + 1
        return body if self.calls != 2 else lambda: None  # the second capture: the shared probe's


def test_the_least_recently_used_graph_goes_past_the_limit() -> None:
    model = packed_model("llama")
    decoder = graphed(model, limit=2)
    eager = FusedDecoder(model.base_model, KERNEL, TORCH, 0)
    small, large, largest = batch_of((20, 33)), batch_of((100, 90)), batch_of((200, 100))
    with torch.inference_mode():
        for batch in (small, large, small, largest, small):
            torch.testing.assert_close(decoder(batch, read_rows(batch)), eager(batch, read_rows(batch)))
    assert decoder.graphs == 2
    assert set(decoder._graphs) == {decoder.key(384, 3, 200), decoder.key(128, 3, 33)}


def test_capture_checks_then_records_every_size_largest_first() -> None:
    model = packed_model("qwen2")
    recorder = Counting()
    decoder = graphed(model, max_tokens=500, recorder=recorder, limit=8)
    with torch.inference_mode():
        decoder.capture(batch_of((20, 33, 7)))
    assert decoder.disabled is None
    assert recorder.captures == 8  # the probe's (128 tokens) and its shared twin's, then the others
    captured = [(key.tokens, key.keys) for key in decoder._graphs]  # in the order captured
    shared = decoder.key_capacity
    assert captured == live_and_shared(shared, 128, 512, 384, 256)


def live_and_shared(shared: int, *tokens: int) -> list[tuple[int, int]]:
    """(N, keys) of a live then a shared-prefix graph per N, in the order given."""
    return [(n, keys) for n in tokens for keys in (0, shared)]


def test_the_start_captures_its_share_of_the_sizes_and_the_idle_time_the_rest() -> None:
    """With a start share of 256 tokens under a 768-token budget: N = 768 and 640 at start (and the
    probe's 128), N = 512, 384, 256 queued, largest first, each captured at an idle call; a size met
    before its turn is captured there and then and leaves the queue."""
    model = packed_model("qwen2")
    decoder = graphed(model, max_tokens=768, recorder=(recorder := Counting()), limit=16, start_tokens=256)
    eager = FusedDecoder(model.base_model, KERNEL, TORCH, 0)
    shared = decoder.key_capacity
    with torch.inference_mode():
        decoder.capture(batch_of((20, 33, 7)))
        assert [(key.tokens, key.keys) for key in decoder._graphs] == live_and_shared(shared, 128, 768, 640)
        assert [(key.tokens, key.keys) for key in decoder._pending] == live_and_shared(shared, 512, 384, 256)
        met = batch_of((200, 100, 40))  # 384 tokens: its graph is captured as met, not left queued
        torch.testing.assert_close(decoder(met, read_rows(met)), eager(met, read_rows(met)))
        assert decoder.pending == 5
        assert decoder.key(384, 3, 200) in decoder._graphs
        while decoder.capture_pending():
            pass
        assert decoder.pending == 0
        assert recorder.captures == 12  # each key once
        assert {key.tokens for key in decoder._graphs} == {128, 256, 384, 512, 640, 768}
        assert_replays(decoder, model, [batch_of((100, 90)), groups_of(GROUPS[0])])
    assert recorder.captures == 12  # replayed, none captured again


def test_capture_keeps_the_largest_within_the_limit() -> None:
    decoder = graphed(packed_model("qwen2"), max_tokens=1024, recorder=Counting(), limit=3)
    with torch.inference_mode():
        decoder.capture(batch_of((20, 33, 7)))
    assert sorted((key.tokens, key.keys) for key in decoder._graphs) == [(128, 0), (128, 8192), (1024, 0)]


def test_other_kernels_capture_as_met() -> None:
    recorder = Counting()
    decoder = graphed(packed_model("qwen2"), max_tokens=1024, total_bounded=False, recorder=recorder, limit=8)
    with torch.inference_mode():
        decoder.capture(batch_of((20, 33, 7)))
    assert recorder.captures == 1
    assert decoder.graphs == 1


def test_a_probe_past_the_buffers_turns_graphs_off(caplog: pytest.LogCaptureFixture) -> None:
    decoder = graphed(packed_model("llama"), max_tokens=64, limit=8)
    with torch.inference_mode(), caplog.at_level(logging.WARNING):
        decoder.capture(batch_of((100, 90)))
    assert "no graph holds the 256-token probe" in str(decoder.disabled)
    strict = graphed(packed_model("llama"), max_tokens=64, limit=8, strict=True)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="cuda_graphs=on: no graph holds"):
        strict.capture(batch_of((100, 90)))


def test_buffers_exist_before_any_capture() -> None:
    """Allocated inside a graph, the buffers' zero fill would be recorded, and each replay would
    zero the token ids the batch had just copied in (the twin cannot see that: it records nothing)."""
    decoder = graphed(packed_model("llama"), recorder=(seen := Seeing()), limit=8)
    seen.decoder = decoder
    with torch.inference_mode():
        decoder.capture(batch_of((20, 33, 7)))
    assert seen.captures == 8


class Seeing(Counting):
    decoder: GraphedDecoder | None = None

    def capture(self, body: Callable[[], None]) -> Callable[[], None]:
        assert self.decoder is not None
        assert self.decoder._buffers is not None
        return super().capture(body)


class Stale(EagerRecorder):
    """A wrong graph: its replay does nothing, so the last layer reads whatever the buffers held."""

    def capture(self, body: Callable[[], None]) -> Callable[[], None]:
        return lambda: None


class Failing(EagerRecorder):
    def capture(self, body: Callable[[], None]) -> Callable[[], None]:
        raise RuntimeError("operation not permitted when stream is capturing")


def test_a_wrong_graph_is_caught_at_start(caplog: pytest.LogCaptureFixture) -> None:
    model = packed_model("qwen2")
    decoder = graphed(model, recorder=Stale(), limit=8)
    batch = batch_of((20, 33, 7))
    with torch.inference_mode(), caplog.at_level(logging.WARNING):
        decoder.capture(batch)
        got = decoder(batch, read_rows(batch))
        want = FusedDecoder(model.base_model, KERNEL, TORCH, 0)(batch, read_rows(batch))
    assert decoder.disabled is not None
    assert "of their norm from the eager ones" in decoder.disabled
    assert "CUDA graphs off" in caplog.text
    assert decoder.graphs == 0
    torch.testing.assert_close(got, want)  # eager from then on
    strict = graphed(model, recorder=Stale(), limit=8, strict=True)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="cuda_graphs=on"):
        strict.capture(batch)


def test_a_failed_capture_while_serving_turns_graphs_off(caplog: pytest.LogCaptureFixture) -> None:
    model = packed_model("llama")
    decoder = graphed(model, recorder=Failing(), limit=8)
    batch = batch_of((20, 33, 7))
    with torch.inference_mode(), caplog.at_level(logging.WARNING):
        got = decoder(batch, read_rows(batch))
        again = decoder(batch, read_rows(batch))
        want = FusedDecoder(model.base_model, KERNEL, TORCH, 0)(batch, read_rows(batch))
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(again, want)
    assert "operation not permitted" in str(decoder.disabled)
    assert caplog.text.count("CUDA graphs off") == 1
    strict = graphed(model, recorder=Failing(), limit=8, strict=True)  # cuda_graphs=on
    with torch.inference_mode():
        torch.testing.assert_close(strict(batch, read_rows(batch)), want)  # serving: no request fails
        assert strict.disabled is not None
        with pytest.raises(RuntimeError, match="cuda_graphs=on: capture of"):
            graphed(model, recorder=Failing(), limit=8, strict=True).capture(batch)  # the start does
        with pytest.raises(RuntimeError, match="cuda_graphs=on: capture of"):
            strict.capture(batch)  # graphs that went off in the warm-up's own scoring fail the start too


def test_reloads() -> None:
    """Weights copied in place: the graphs read them. Weights rebound (a swap reload): the graphs,
    which read the old tensors, are dropped and captured again."""
    model, other, third = packed_model("qwen3"), packed_model("qwen3", seed=1), packed_model("qwen3", seed=2)
    decoder = graphed(model, limit=8)
    batch = batch_of((20, 33, 7))
    every = torch.arange(batch.num_tokens)
    with torch.inference_mode():
        decoder(batch, every)
        with torch.no_grad():
            for param, new in zip(model.parameters(), other.parameters(), strict=True):
                param.copy_(new)
        decoder.refresh()
        assert decoder.graphs == 1
        want = TransformersDecoder(other.base_model)(batch, every)
        torch.testing.assert_close(decoder(batch, every), want, atol=1e-5, rtol=1e-5)
        with torch.no_grad():
            for param, new in zip(model.parameters(), third.parameters(), strict=True):
                param.data = new.detach().clone()
        decoder.refresh()
        assert decoder.graphs == 0
        want = TransformersDecoder(third.base_model)(batch, every)
        torch.testing.assert_close(decoder(batch, every), want, atol=1e-5, rtol=1e-5)
        assert decoder.graphs == 1


def test_wrap_resolves_the_setting() -> None:
    model = packed_model("qwen2")
    fused = FusedDecoder(model.base_model, KERNEL, TORCH, 0)
    plain = TransformersDecoder(model.base_model)
    args = (CPU, EagerRecorder(), 512, 8)
    assert graphs.wrap(fused, "off", "flash_attn_cute", *args) is fused
    assert graphs.wrap(fused, "auto", "flash_attn_cute", *args) is fused  # not CUDA
    assert graphs.wrap(plain, "auto", "flash_attn_cute", *args) is plain
    with pytest.raises(RuntimeError, match="cuda_graphs=on: the device is not CUDA"):
        graphs.wrap(fused, "on", "flash_attn_cute", *args)
    with pytest.raises(RuntimeError, match="cuda_graphs=on: the transformers decoder"):
        graphs.wrap(plain, "on", "flash_attn_cute", *args)


def test_graphs_on_refuses_a_cpu_engine(model_dirs: dict[str, Path]) -> None:
    with pytest.raises(RuntimeError, match="cuda_graphs=on"):
        PackedScorer.from_config(
            Settings(model=model_dirs["qwen2"], device="cpu", cuda_graphs="on").engine_config()
        )
    engine = PackedScorer.from_config(Settings(model=model_dirs["qwen2"], device="cpu").engine_config())
    assert "graphs" not in engine.info.kernels


# ---- on the GPU: CUDA capture with the device's attention kernel -------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["auto", "torch_varlen"])
@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_cuda_graphs_equal_the_eager_forward(name: str, attention: str) -> None:
    """bf16, the attention kernel `auto` picks here (flash-attn 4 on Hopper with the hopper extra) and
    torch's; replays of several micro-batches, each against the same decoder run eagerly."""
    device = torch.device("cuda")
    backend = choose_backend(attention, device)
    model = packed_model(name).to(device=device, dtype=torch.bfloat16)
    inner = FusedDecoder(model.base_model, backend.kernel, Ops.for_device(device, allow_triton=True), 0)
    bounded = backend.name in graphs.TOTAL_BOUNDED
    decoder = GraphedDecoder(inner, graphs.CudaRecorder(device), 512, bounded, limit=2, strict=True)
    with torch.inference_mode():
        decoder.capture(batch_of((20, 33, 7), device=device))
        # past the limit of 2: graphs go and are captured again; 70 sequences: a graph of 128 slots
        for seed, lengths in enumerate([*BATCHES, (3,) * 70]):
            batch = batch_of(lengths, seed, device)
            got, want = decoder(batch, read_rows(batch)), inner(batch, read_rows(batch))
            torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
            assert float((got.float() - want.float()).norm() / want.float().norm()) < 1e-3
        for seed, groups in enumerate(GROUPS):  # shared prefixes: the gather from the static index
            batch = groups_of(groups, seed, device)
            got, want = decoder(batch, read_rows(batch)), inner(batch, read_rows(batch))
            assert float((got.float() - want.float()).norm() / want.float().norm()) < 1e-3
        assert decoder.shared_off is None
        with torch.no_grad():  # a swap reload: every graph goes; the shared pool must stay usable
            for param in model.parameters():
                param.data = param.data.clone()
        decoder.refresh()
        assert decoder.graphs == 0
        batch = batch_of(BATCHES[0], 0, device)
        got, want = decoder(batch, read_rows(batch)), inner(batch, read_rows(batch))
        assert float((got.float() - want.float()).norm() / want.float().norm()) < 1e-3
        assert decoder.graphs == 1
    assert decoder.disabled is None

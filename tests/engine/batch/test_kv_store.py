"""Chunked scoring's pieces: attention with key boundaries longer than the queries (a cached context,
bottom-right causal), the store a context writes and reads, and packing a chunk as a row's last
segment. Each is checked against a direct construction written here, not against the service."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch

from service.core.jobs import Chunk, SequenceJob
from service.core.prefixes import share
from service.engine.batch.kv_store import CONTEXT_KWARG, KVContext, KVStore, cache_bytes_per_token
from service.engine.batch.packing import pack
from service.engine.ops.attention import Segments, sdpa_kernel

# --- (a) attention over a context: the kernel against whole-sequence attention, last rows kept ---


def _cached(store: KVStore, start: int, others: int) -> KVContext:
    """A context of cached keys only (extend does not read its boundaries)."""
    return KVContext(torch.zeros(2, dtype=torch.int32), 0, store=store, start=start, others=others)


def whole_sequence_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    window: int | None,
    softcap: float | None,
    scale: float,
) -> torch.Tensor:
    """q, k, v: [L, H*, D] one sequence's every query, key and value; float64 causal attention of
    every query over its sequence, as an unchunked forward computes it: [L, Hq, D]."""
    length, heads, _ = q.shape
    kk = k.double().repeat_interleave(heads // k.shape[1], dim=1)
    vv = v.double().repeat_interleave(heads // v.shape[1], dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    i = torch.arange(length)
    allowed = i[None, :] <= i[:, None]
    if window is not None:
        allowed &= i[None, :] > i[:, None] - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), vv)


def context_inputs(
    segments: list[tuple[int, int]], hq: int, hk: int, *, window: int | None, softcap: float | None, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Segments, torch.Tensor]:
    """segments: (queries, keys) each, keys >= queries: a sequence of `keys` tokens whose last
    `queries` are this row's. Returns the kernel's packed q, k, v and Segments, and the float64
    expected output: each sequence's whole attention, its last `queries` rows."""
    gen = torch.Generator().manual_seed(seed)
    d = 16
    scale = d**-0.5
    qs, ks, vs, want = [], [], [], []
    for queries, keys in segments:
        q_all = torch.randn(keys, hq, d, generator=gen)
        k_all = torch.randn(keys, hk, d, generator=gen)
        v_all = torch.randn(keys, hk, d, generator=gen)
        full = whole_sequence_reference(q_all, k_all, v_all, window=window, softcap=softcap, scale=scale)
        qs.append(q_all[keys - queries :])
        ks.append(k_all)
        vs.append(v_all)
        want.append(full[keys - queries :])
    q_lengths = [queries for queries, _ in segments]
    k_lengths = [keys for _, keys in segments]
    cu = torch.tensor([0, *itertools.accumulate(q_lengths)], dtype=torch.int32)
    cu_k = torch.tensor([0, *itertools.accumulate(k_lengths)], dtype=torch.int32)
    seg = Segments(cu, max(q_lengths), scale, window, softcap, cu_k, max(k_lengths))
    return torch.cat(qs), torch.cat(ks), torch.cat(vs), seg, torch.cat(want)


CONTEXT_CASES = {
    # (queries, keys) per segment; the context segment (keys > queries) is the row's last
    "context_alone": ([(16, 80)], None, None, 4, 2),
    "context_after_segments": ([(5, 5), (1, 1), (17, 17), (24, 131)], None, None, 8, 2),
    "window_shorter_than_chunk": ([(9, 9), (30, 100)], 6, None, 8, 2),
    "window_reaches_into_context": ([(3, 3), (5, 70)], 12, None, 8, 2),
    "window_longer_than_context": ([(7, 7), (10, 14)], 64, None, 4, 4),
    "softcap": ([(11, 11), (20, 57)], None, 2.0, 4, 2),
    "softcap_and_window": ([(13, 13), (2, 2), (32, 96)], 5, 3.0, 8, 2),
    "gqa_one_key_head": ([(6, 6), (40, 200)], None, None, 8, 1),
    "single_query_deep_in_context": ([(4, 4), (1, 300)], None, None, 4, 2),
}


@pytest.mark.parametrize("case", CONTEXT_CASES)
def test_sdpa_kernel_with_key_boundaries_equals_whole_sequence_attention(case: str) -> None:
    segments, window, softcap, hq, hk = CONTEXT_CASES[case]
    q, k, v, seg, want = context_inputs(segments, hq, hk, window=window, softcap=softcap, seed=len(case))
    got = sdpa_kernel(q, k, v, seg)
    assert got.shape == want.shape
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_reference_sees_the_context() -> None:
    """The check above can fail: ignoring the context (keys = the queries' own) changes the output."""
    q, k, v, seg, want = context_inputs([(5, 5), (16, 48)], 4, 2, window=None, softcap=None, seed=1)
    own = torch.cat([k[:5], k[5 + 32 :]]), torch.cat([v[:5], v[5 + 32 :]])
    blind = Segments(seg.cu, seg.max_len, seg.scale, None, None)
    got = sdpa_kernel(q, *own, blind)
    torch.testing.assert_close(got[:5].double(), want[:5], atol=1e-5, rtol=1e-5)  # ordinary segment
    assert (got[5:].double() - want[5:]).abs().max() > 1e-2


# --- (b) the store: what extend writes and what attention reads ---


def test_extend_alone_writes_behind_the_cache_and_returns_a_view() -> None:
    store = KVStore(capacity=10)
    gen = torch.Generator().manual_seed(0)
    k1, v1 = torch.randn(4, 2, 3, generator=gen), torch.randn(4, 2, 3, generator=gen)
    keys, values = _cached(store, 0, 0).extend(0, k1, v1)
    assert torch.equal(keys, k1)
    assert torch.equal(values, v1)
    assert keys.data_ptr() == store.keys[0].data_ptr()  # a view of the store, no copy
    assert store.keys[0].shape == (10, 2, 3)
    assert store.keys[0].dtype == k1.dtype
    k2, v2 = torch.randn(5, 2, 3, generator=gen), torch.randn(5, 2, 3, generator=gen)
    keys, values = _cached(store, 4, 0).extend(0, k2, v2)
    assert torch.equal(keys, torch.cat([k1, k2]))
    assert torch.equal(values, torch.cat([v1, v2]))
    assert store.nbytes() == 2 * 10 * 2 * 3 * 4


def test_extend_after_other_segments_puts_them_first_and_stores_only_the_last() -> None:
    store = KVStore(capacity=12)
    gen = torch.Generator().manual_seed(1)
    first_k, first_v = torch.randn(6, 2, 3, generator=gen), torch.randn(6, 2, 3, generator=gen)
    _cached(store, 0, 0).extend(3, first_k, first_v)  # layer 3: any layer index
    row_k, row_v = torch.randn(7, 2, 3, generator=gen), torch.randn(7, 2, 3, generator=gen)
    keys, values = _cached(store, 6, 3).extend(3, row_k, row_v)  # 3 others, 4 own
    assert torch.equal(keys, torch.cat([row_k[:3], first_k, row_k[3:]]))
    assert torch.equal(values, torch.cat([row_v[:3], first_v, row_v[3:]]))
    assert torch.equal(store.keys[3][:10], torch.cat([first_k, row_k[3:]]))  # the others' not stored
    assert torch.equal(store.values[3][:10], torch.cat([first_v, row_v[3:]]))
    assert set(store.keys) == {3}


def test_layers_keep_their_own_keys() -> None:
    store = KVStore(capacity=8)
    a, b = torch.ones(3, 1, 2), torch.full((3, 1, 2), 2.0)
    _cached(store, 0, 0).extend(0, a, -a)
    _cached(store, 0, 0).extend(1, b, -b)
    keys0, values0 = _cached(store, 3, 0).extend(0, b, -b)
    keys1, _ = _cached(store, 3, 0).extend(1, a, -a)
    assert torch.equal(keys0, torch.cat([a, b]))
    assert torch.equal(values0, torch.cat([-a, -b]))
    assert torch.equal(keys1, torch.cat([b, a]))


def test_extend_refuses_past_capacity() -> None:
    store = KVStore(capacity=8)
    _cached(store, 0, 0).extend(0, torch.zeros(6, 1, 2), torch.zeros(6, 1, 2))
    _cached(store, 6, 2).extend(0, torch.zeros(4, 1, 2), torch.zeros(4, 1, 2))  # exactly full: 6 + 2
    with pytest.raises(ValueError, match="context of 9 tokens past its store's 8"):
        _cached(store, 6, 1).extend(0, torch.zeros(4, 1, 2), torch.zeros(4, 1, 2))


def test_cache_bytes_per_token() -> None:
    from tests.support.models import configs

    config = configs()["qwen3"]  # 2 layers, 2 key/value heads of 16
    assert cache_bytes_per_token(config, torch.float32) == 2 * 2 * 2 * 16 * 4
    assert cache_bytes_per_token(config, torch.bfloat16) == 2 * 2 * 2 * 16 * 2
    llama = configs()["llama"]  # head_dim 64 / 4 heads = 16
    assert cache_bytes_per_token(llama, torch.float32) == 2 * 2 * 2 * 16 * 4


# --- (c) packing a chunk ---


def _job(
    length: int, actions: list[int] | np.ndarray, temperature: float = 1.0, entropy: bool = False
) -> SequenceJob:
    rng = np.random.default_rng(length)
    return SequenceJob(
        tokens=rng.integers(3, 90, size=length).astype(np.int64),
        actions=np.asarray(actions, dtype=np.int64),
        temperature=temperature,
        return_entropy=entropy,
    )


def test_chunk_actions_partition_the_window_by_predicting_position() -> None:
    """An action window spanning chunks: each chunk holds the actions t whose t - 1 is in it, so the
    chunks of any partition give back the job's actions, in order, each once."""
    job = _job(300, list(range(120, 300)))
    rng = random.Random(0)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, 300), rng.randint(1, 8)))
        bounds = list(itertools.pairwise([0, *cuts, 300]))
        chunks = [Chunk(job, 0, start, end) for start, end in bounds]
        assert [c.last for c in chunks] == [False] * (len(chunks) - 1) + [True]
        for c in chunks:
            assert all(c.start <= t - 1 < c.end for t in c.actions.tolist())
        assert np.concatenate([c.actions for c in chunks]).tolist() == list(range(120, 300))
    assert Chunk(job, 0, 119, 120).actions.tolist() == [120]  # the action predicted by a chunk's last
    assert Chunk(job, 0, 120, 200).actions.tolist() == list(range(121, 201))


def test_pack_a_chunk_after_whole_sequences() -> None:
    short = [_job(3, [1, 2], temperature=0.5), _job(5, [4], entropy=True)]
    long = _job(300, list(range(90, 300)), temperature=2.0)
    chunk = Chunk(long, sequence=7, start=100, end=160)
    batch = pack(short, torch.device("cpu"), step=1, chunk=chunk)
    n = 3 + 5 + 60
    assert batch.input_ids.tolist() == [[*short[0].tokens, *short[1].tokens, *long.tokens[100:160]]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, *range(100, 160)]]
    assert batch.num_tokens == n
    assert batch.cu_seqlens.tolist() == [0, 3, 8, n]
    assert batch.cu_k is not None
    assert batch.cu_k.tolist() == [0, 3, 8, n + 100]  # the last segment's keys: 100 cached + its 60
    assert batch.cu_k.dtype == torch.int32
    assert (batch.max_len, batch.max_len_k) == (60, 160)
    assert (batch.chunk_start, batch.chunk_row) == (100, 8)
    actions = list(range(101, 161))  # t - 1 in [100, 160)
    assert batch.hidden_index.tolist() == [0, 1, 3 + 3] + [8 + t - 1 - 100 for t in actions]
    assert batch.targets.tolist() == [short[0].tokens[1], short[0].tokens[2], short[1].tokens[4]] + [
        long.tokens[t] for t in actions
    ]
    assert batch.actions_per_sequence == [2, 1, 60]
    assert batch.inv_temperature is not None
    assert batch.inv_temperature.tolist() == [2.0, 2.0, 1.0] + [0.5] * 60
    assert batch.want_entropy  # the second short job asks


def test_pack_a_chunk_with_filler_at_the_shape_step() -> None:
    """The filler joins the chunk's segment, after its real tokens (no real token sees it), with
    position 0; filler actions point at row 0; the chunk's entropy wish counts."""
    short = [_job(4, [2, 3])]
    long = _job(1000, [*range(5, 20), *range(600, 1000)], entropy=True)
    chunk = Chunk(long, sequence=1, start=576, end=640)  # 4 + 64 tokens, 60 of filler to 128
    batch = pack(short, torch.device("cpu"), step=128, chunk=chunk)
    assert batch.num_tokens == 128
    ids = batch.input_ids[0].tolist()
    assert ids[4:68] == long.tokens[576:640].tolist()
    assert ids[68:] == [0] * 60
    positions = batch.position_ids[0].tolist()
    assert positions[:68] == [0, 1, 2, 3, *range(576, 640)]
    assert positions[68:] == [0] * 60
    assert batch.cu_seqlens.tolist() == [0, 4, 128]
    assert batch.cu_k is not None
    assert batch.cu_k.tolist() == [0, 4, 128 + 576]
    assert (batch.max_len, batch.max_len_k) == (124, 700)
    actions = list(range(600, 641))  # the window starts inside the chunk; 640 is predicted by 639
    real = 2 + len(actions)
    assert batch.num_actions == real
    assert batch.hidden_index.tolist() == [1, 2] + [4 + t - 1 - 576 for t in actions] + [0] * (128 - real)
    assert batch.targets.tolist()[:real] == [*short[0].tokens[2:4], *long.tokens[actions]]
    assert batch.targets.tolist()[real:] == [0] * (128 - real)
    assert batch.inv_temperature is None
    assert batch.actions_per_sequence == [2, len(actions)]
    assert batch.want_entropy


def test_pack_a_chunk_alone_and_its_context() -> None:
    long = _job(200, list(range(1, 200)))
    first = pack([], torch.device("cpu"), step=16, chunk=Chunk(long, 3, 0, 40))
    assert first.cu_seqlens.tolist() == [0, 48]  # 40 + 8 filler, one segment
    assert first.cu_k is not None
    assert first.cu_k.tolist() == [0, 48]
    assert first.position_ids[0].tolist() == [*range(40), *[0] * 8]
    assert first.hidden_index.tolist()[:40] == list(range(40))  # actions 1..40
    assert first.num_actions == 40
    assert first.chunk_row == 0
    last = pack([], torch.device("cpu"), step=16, chunk=Chunk(long, 3, 160, 200))
    assert last.position_ids[0].tolist()[:40] == list(range(160, 200))
    assert last.hidden_index.tolist()[:39] == list(range(39))  # actions 161..199: no 200th token
    assert last.num_actions == 39
    store = KVStore(capacity=216)
    attached = last.attach(store)
    context = attached.context
    assert context is not None
    assert (context.store, context.start, context.others, context.gather) == (store, 160, 0, None)
    assert context.cu_k is last.cu_k
    kwargs = attached.forward_kwargs()
    assert kwargs[CONTEXT_KWARG] is attached.context
    assert kwargs["cu_seq_lens_k"] is last.cu_k
    assert kwargs["max_length_k"] == 48 + 160
    assert kwargs["max_length_q"] == 48
    assert last.attach(None).context is None
    assert CONTEXT_KWARG not in last.attach(None).forward_kwargs()
    whole = pack([long], torch.device("cpu"), step=16)
    assert whole.chunk_start is None
    assert whole.attach(store).context is None  # no chunk: no context, whatever the store


# --- (d) shared prefixes: packing a forest, with and without a chunk ---


def test_pack_a_forest_gathers_each_nodes_ancestors_then_its_own_keys() -> None:
    """Two sequences sharing 6 tokens, a third alone, then a chunk: the prefix once; each node's
    keys its ancestors' rows then its own; the chunk's segment its own rows (no store) or its cached
    context (a store); actions read the node that holds t - 1."""
    prompt = np.arange(10, 16, dtype=np.int64)
    a = SequenceJob(np.concatenate([prompt, [50, 51]]), np.asarray([5, 6, 7]), 1.0, False)
    b = SequenceJob(np.concatenate([prompt, [60, 61, 62]]), np.asarray([6, 8]), 1.0, False)
    alone = SequenceJob(np.asarray([70, 71, 72], dtype=np.int64), np.asarray([2]), 1.0, False)
    forest = share([a.tokens, b.tokens, alone.tokens], 4)
    assert [(n.start, n.end) for n in forest.nodes] == [(0, 6), (6, 8), (6, 9), (0, 3)]
    long = _job(100, list(range(40, 100)))
    batch = pack([a, b, alone], torch.device("cpu"), step=1, chunk=Chunk(long, 0, 40, 52), forest=forest)
    # rows: prompt 0-5 | a's 6-7 | b's 8-10 | alone 11-13 | chunk 14-25
    assert batch.input_ids[0, :14].tolist() == [*prompt, 50, 51, 60, 61, 62, 70, 71, 72]
    assert batch.position_ids[0].tolist() == [*range(6), 6, 7, 6, 7, 8, 0, 1, 2, *range(40, 52)]
    assert batch.cu_seqlens.tolist() == [0, 6, 8, 11, 14, 26]
    assert batch.key_index is not None
    want_keys = [*range(6), *range(6), 6, 7, *range(6), 8, 9, 10, 11, 12, 13, *range(14, 26)]
    assert batch.key_index.tolist() == want_keys
    assert batch.shared_keys == 6 + 8 + 9 + 3
    assert batch.cu_k_own is not None
    assert batch.cu_k_own.tolist() == [0, 6, 14, 23, 26, 38]
    # a: t-1 = 4 (prompt row 4), 5, 6 (its row 6); b: 5 (row 5), 7 (its row 9); alone: 1 (row 12)
    assert batch.hidden_index.tolist()[:6] == [4, 5, 6, 5, 9, 12]
    assert batch.targets.tolist()[:6] == [15, 50, 51, 60, 62, 72]
    alone_context = batch.attach(None).context  # a model not asked for the chunk: its own rows
    assert alone_context is not None
    assert alone_context.store is None
    assert alone_context.cu_k is batch.cu_k_own
    assert alone_context.gather is batch.key_index
    store = KVStore(capacity=128)
    cached = batch.attach(store).context
    assert cached is not None
    assert cached.store is store
    assert cached.gather is not None
    assert cached.gather.tolist() == want_keys[: batch.shared_keys]
    assert cached.cu_k is not None
    assert cached.cu_k.tolist() == [0, 6, 14, 23, 26, 26 + 40 + 12]
    k = torch.randn(26, 1, 2)
    keys, _ = cached.extend(0, k, -k)
    assert torch.equal(keys[: batch.shared_keys], k[want_keys[: batch.shared_keys]])
    assert torch.equal(keys[batch.shared_keys + 40 :], k[14:])  # after the 40 cached: its own

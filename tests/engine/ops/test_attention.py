"""Packed attention kernels against a dense block-diagonal reference; GPU kernels against the CPU one."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

from service.engine.ops.attention import (
    BACKENDS,
    KEY_BLOCK,
    QUERY_TILE,
    AttentionBackend,
    Kernel,
    Segments,
    blocked_kernel,
    choose_backend,
    flash_cute_kernel,
    invariant,
    sdpa_kernel,
)
from service.engine.runtime import packages as optional
from service.engine.scorer.build import versions as _versions
from tests.support.fake_packages import fake_site


def dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: Segments) -> torch.Tensor:
    """One float64 softmax over the whole packed row with an explicit [N, N] mask."""
    n, heads, _ = q.shape
    seq_id = torch.repeat_interleave(
        torch.arange(len(seg.cu) - 1), (seg.cu[1:] - seg.cu[:-1]).long().cpu()
    ).to(q.device)
    i = torch.arange(n, device=q.device)
    allowed = (seq_id[:, None] == seq_id[None, :]) & (i[None, :] <= i[:, None])
    if seg.window is not None:
        allowed &= i[None, :] > i[:, None] - seg.window
    kk = k.double().repeat_interleave(heads // k.shape[1], dim=1)
    vv = v.double().repeat_interleave(heads // v.shape[1], dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kk) * seg.scale
    if seg.softcap is not None:
        scores = torch.tanh(scores / seg.softcap) * seg.softcap
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), vv)


def make_inputs(
    lengths: list[int], device: str, dtype: torch.dtype, window: int | None, softcap: float | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Segments]:
    gen = torch.Generator().manual_seed(sum(lengths))
    n = sum(lengths)
    q = torch.randn(n, 8, 32, generator=gen).to(device, dtype)
    k = torch.randn(n, 2, 32, generator=gen).to(device, dtype)
    v = torch.randn(n, 2, 32, generator=gen).to(device, dtype)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return q, k, v, Segments(cu, max(lengths), 32**-0.5, window, softcap)


CASES = [
    ([5, 1, 17, 9], None, None),
    ([12, 30, 3], 4, None),  # sliding window shorter than the sequences
    ([7, 20], None, 2.0),  # attention-logit soft-capping (Gemma2)
    ([40, 2, 11], 8, 3.0),
]


@pytest.mark.parametrize(("lengths", "window", "softcap"), CASES)
def test_sdpa_kernel_matches_dense_reference(
    lengths: list[int], window: int | None, softcap: float | None
) -> None:
    q, k, v, seg = make_inputs(lengths, "cpu", torch.float32, window, softcap)
    got = sdpa_kernel(q, k, v, seg)
    torch.testing.assert_close(got.double(), dense_reference(q, k, v, seg), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("lengths", "window", "softcap"), CASES)
def test_blocked_kernel_matches_dense_reference(
    lengths: list[int], window: int | None, softcap: float | None
) -> None:
    q, k, v, seg = make_inputs(lengths, "cpu", torch.float32, window, softcap)
    got = blocked_kernel(q, k, v, seg)
    torch.testing.assert_close(got.double(), dense_reference(q, k, v, seg), atol=1e-5, rtol=1e-5)


def _cut(start: int, end: int, before: int, whole: Segments) -> Segments:
    """Queries [start, end) of one sequence whose keys are its positions 0 .. end - 1, after a segment
    of `before` tokens that attends to itself (a shared node, or a chunk after its context, in a row)."""
    cu = [0, before, before + end - start] if before else [0, end - start]
    cu_k = [0, before, before + end] if before else [0, end]
    device = whole.cu.device
    return Segments(
        torch.tensor(cu, dtype=torch.int32, device=device),
        max(before, end - start),
        whole.scale,
        whole.window,
        whole.softcap,
        torch.tensor(cu_k, dtype=torch.int32, device=device),
        max(before, end),
    )


# (start, end, before): positions [start, end) as queries, end keys, a segment of `before` in front
CUTS = [(0, 300, 0), (1, 300, 0), (130, 300, 0), (64, 128, 0), (299, 300, 0), (77, 201, 37), (0, 5, 70)]


def _scores_rows_alike(kernel: Kernel, device: str, dtype: torch.dtype) -> None:
    """Every row of one 300-token sequence (several query tiles and key blocks, grouped heads) scores
    the same bits however the queries are cut, with a window, a soft-cap, both or neither."""
    assert 2 * max(QUERY_TILE, KEY_BLOCK) < 300
    for window, softcap in ((None, None), (40, None), (None, 2.0), (100, 3.0)):
        q, k, v, whole = make_inputs([300], device, dtype, window, softcap)
        want = kernel(q, k, v, whole)
        other = make_inputs([70], device, dtype, window, softcap)[:3]  # a segment in front of the cut
        for start, end, before in CUTS:
            qs = torch.cat([other[0][:before], q[start:end]])
            ks, vs = (torch.cat([o[:before], x[:end]]) for o, x in ((other[1], k), (other[2], v)))
            got = kernel(qs, ks, vs, _cut(start, end, before, whole))[before:]
            assert torch.equal(got, want[start:end]), (window, softcap, start, end, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocked_kernel_scores_a_row_alike_however_its_queries_are_cut(dtype: torch.dtype) -> None:
    """A shared node's queries, a chunk's after its cached context, a suffix of one query, beside
    another segment: bitwise the rows of the whole sequence (sdpa_kernel's one-query rows differ in
    float32 on the CPU: another kernel for that shape)."""
    _scores_rows_alike(blocked_kernel, "cpu", dtype)


def test_invariant_backend_runs_the_blocked_kernel_where_a_fast_one_cannot() -> None:
    assert invariant(choose_backend("sdpa", torch.device("cpu"))).name == "blocked"
    calls: list[str] = []

    def fast(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: Segments) -> torch.Tensor:
        calls.append("fast")
        return q

    q, k, v, seg = make_inputs([9, 4], "cpu", torch.bfloat16, None, 2.0)
    for name, dtype, want in (("flash_attn", torch.bfloat16, ["fast"]), ("torch_varlen", torch.bfloat16, [])):
        calls.clear()
        out = invariant(AttentionBackend(name, fast)).kernel(q.to(dtype), k.to(dtype), v.to(dtype), seg)
        assert calls == want  # torch varlen has no soft-cap: the blocked kernel
        if not want:
            torch.testing.assert_close(out, blocked_kernel(q, k, v, seg))
    calls.clear()
    invariant(AttentionBackend("flash_attn_cute", fast)).kernel(q.float(), k.float(), v.float(), seg)
    assert calls == []  # float32: the blocked kernel


def test_auto_backend_on_cpu_is_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    assert choose_backend("auto", torch.device("cpu")).name == "sdpa"
    monkeypatch.setattr(optional, "importable", lambda module, package: True)  # flash-attn 2 on a CPU host
    assert choose_backend("auto", torch.device("cpu")).name == "sdpa"
    with pytest.raises(RuntimeError, match="CUDA"):
        choose_backend("torch_varlen", torch.device("cpu"))


def test_flash_attn_4_alone_is_not_taken_for_flash_attn_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """flash-attn-4 installs flash_attn/cute/ only, leaving `flash_attn` a namespace package: that is
    not flash-attn 2, and the versions report reads the distributions, not flash_attn.__version__."""
    (tmp_path / "flash_attn" / "cute").mkdir(parents=True)
    (tmp_path / "flash_attn" / "cute" / "__init__.py").write_text("")
    (tmp_path / "flash_attn_4-4.0.0b1.dist-info").mkdir()
    (tmp_path / "flash_attn_4-4.0.0b1.dist-info" / "METADATA").write_text(
        "Name: flash-attn-4\nVersion: 4.0.0b1\n"
    )
    with fake_site(tmp_path, monkeypatch, {"flash_attn"}):  # the fake leaves with the test (test_releases.py)
        assert optional.importable("flash_attn.cute", "flash-attn-4")
        assert not optional.importable("flash_attn.flash_attn_interface", "flash-attn")
        with pytest.raises(RuntimeError, match="needs the flash-attn package, which is not installed"):
            choose_backend("flash_attn", torch.device("cpu"))
        with pytest.raises(RuntimeError, match=r"capability 8\.0 or later and the flash-attn-4 package"):
            choose_backend("flash_attn_cute", torch.device("cpu"))
        assert choose_backend("auto", torch.device("cpu")).name == "sdpa"
        assert _versions()["flash_attn_4"] == "4.0.0b1"


def test_flash_attn_4_gets_pack_gqa_only_where_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """The service's call names no PackGQA option (flash-attn's choice, and releases without the
    option); the attention probe's `pack_gqa off` passes it."""
    calls: list[dict[str, object]] = []

    def varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options: object) -> torch.Tensor:
        calls.append(options)
        return q

    cute = types.ModuleType("flash_attn.cute")
    cute.flash_attn_varlen_func = varlen  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    q = torch.zeros(4, 2, 8, dtype=torch.bfloat16)
    k = v = torch.zeros(4, 1, 8, dtype=torch.bfloat16)
    seg = Segments(torch.tensor([0, 4], dtype=torch.int32), 4, 8**-0.5, None, None)
    for kernel in (flash_cute_kernel(), flash_cute_kernel(pack_gqa=False), flash_cute_kernel(pack_gqa=True)):
        assert kernel(q, k, v, seg) is q
    assert ["pack_gqa" in c for c in calls] == [False, True, True]
    assert [c.get("pack_gqa") for c in calls[1:]] == [False, True]
    assert all(c["causal"] is True for c in calls)


def _gpu_backends() -> list[str]:
    """The fast kernels this host can run."""
    if not torch.cuda.is_available():
        return ["torch_varlen"]
    names = []
    for name in BACKENDS:
        if name in {"sdpa", "blocked"}:  # the exact kernels: not fast ones, and no `attention` choice
            continue
        try:
            if choose_backend(name, torch.device("cuda")).name == name:
                names.append(name)
        except RuntimeError:
            pass
    return names


GPU_BACKENDS = _gpu_backends()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize(("lengths", "window", "softcap"), CASES)
def test_gpu_kernel_matches_cpu_twin(
    backend: str, lengths: list[int], window: int | None, softcap: float | None
) -> None:
    kernel = choose_backend(backend, torch.device("cuda")).kernel
    q, k, v, seg = make_inputs(lengths, "cuda", torch.bfloat16, window, softcap)
    got = kernel(q, k, v, seg).float()
    want = dense_reference(q, k, v, seg).float()
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("window", [None, 64])
def test_gpu_kernel_takes_views_of_a_packed_qkv_row(backend: str, window: int | None) -> None:
    """The fused decoder passes q, k, v as strided views of one [N, (Hq + 2·Hk)·D] projection,
    with Qwen2.5-1.5B's heads (12 query heads, 2 key/value heads of 128)."""
    kernel = choose_backend(backend, torch.device("cuda")).kernel
    hq, hk, d, lengths = 12, 2, 128, [100, 150, 50]
    n = sum(lengths)
    qkv = torch.randn(n, (hq + 2 * hk) * d, generator=torch.Generator().manual_seed(0)).to(
        "cuda", torch.bfloat16
    )
    q = qkv[:, : hq * d].view(n, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(n, hk, d)
    v = qkv[:, (hq + hk) * d :].view(n, hk, d)
    cu = torch.tensor([0, 100, 250, 300], dtype=torch.int32, device="cuda")
    seg = Segments(cu, max(lengths), d**-0.5, window, None)
    got = kernel(q, k, v, seg)
    assert torch.equal(got, kernel(q.contiguous(), k.contiguous(), v.contiguous(), seg))
    want = dense_reference(q, k, v, seg).float()
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("name", BACKENDS)
def test_registered_names_do_not_impersonate_transformers_kernels(name: str) -> None:
    # transformers routes any implementation named "*sdpa*" or "*flash*" through its own checks
    implementation = AttentionBackend(name, sdpa_kernel).implementation
    assert "sdpa" not in implementation
    assert "flash" not in implementation


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize(("lengths", "window", "softcap"), CASES)
def test_gpu_kernel_with_a_context_matches_cpu_twin(
    backend: str, lengths: list[int], window: int | None, softcap: float | None
) -> None:
    """The last segment's queries are its last 40 % of tokens, its keys all of them (a chunk after its
    cached context, bottom-right causal): each fast kernel against the CPU twin (sdpa_kernel)."""
    kernel = choose_backend(backend, torch.device("cuda")).kernel
    q, k, v, whole = make_inputs(lengths, "cuda", torch.bfloat16, window, softcap)
    context = lengths[-1] - max(1, (2 * lengths[-1]) // 5)  # keys the last segment's queries see first
    keep = torch.ones(q.shape[0], dtype=torch.bool)
    keep[sum(lengths[:-1]) : sum(lengths[:-1]) + context] = False  # its context's queries are not run
    queries = [*lengths[:-1], lengths[-1] - context]
    cu_q = torch.tensor([0, *torch.tensor(queries).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    seg = Segments(cu_q, max(queries), whole.scale, window, softcap, whole.cu, whole.max_len)
    got = kernel(q[keep.cuda()], k, v, seg).float()
    want = sdpa_kernel(q[keep.cuda()].float().cpu(), k.float().cpu(), v.float().cpu(), _on_cpu(seg))
    torch.testing.assert_close(got.cpu(), want, atol=2e-2, rtol=2e-2)
    full = sdpa_kernel(q.float().cpu(), k.float().cpu(), v.float().cpu(), _on_cpu(whole))
    torch.testing.assert_close(want, full[keep], atol=1e-5, rtol=1e-5)  # = the whole sequence's rows


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_kernel_in_invariant_mode_scores_a_row_alike_however_its_queries_are_cut(backend: str) -> None:
    """Batch-invariant mode's premise for prefix sharing and chunks on the GPU: the fast kernel, given
    a shared node's or a chunk's queries with keys from the sequence's position 0, reduces each row as
    over the whole sequence (bf16, and float32 through the blocked kernel)."""
    kernel = invariant(choose_backend(backend, torch.device("cuda"))).kernel
    for dtype in (torch.bfloat16, torch.float32):
        _scores_rows_alike(kernel, "cuda", dtype)


def _on_cpu(seg: Segments) -> Segments:
    cu_k = seg.cu_k.cpu() if seg.cu_k is not None else None
    return Segments(seg.cu.cpu(), seg.max_len, seg.scale, seg.window, seg.softcap, cu_k, seg.max_len_k)


# the attention shapes (query heads, key/value heads; head_dim 128) of Qwen2.5-1.5B, 7B, Qwen3-30B-A3B
REAL_HEADS = {"qwen2.5-1.5b": (12, 2), "qwen2.5-7b": (28, 4), "qwen3-30b-a3b": (32, 4)}


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("shape", list(REAL_HEADS))
def test_gpu_kernel_in_invariant_mode_cuts_a_long_sequence_of_a_real_shape_alike(
    backend: str, shape: str
) -> None:
    """The same premise at the served shapes and lengths (bf16): one 20,000-token sequence (the long
    workload's) scored whole, in chunks after their cached context (cut where budgets of 4,096,
    8,192 and 16,384 and an odd length would cut), its last query alone, and queries after a shared
    prefix beside the prefix's own segment: every row bitwise the whole sequence's."""
    kernel = invariant(choose_backend(backend, torch.device("cuda"))).kernel
    heads, kv_heads = REAL_HEADS[shape]
    n, gen = 20_000, torch.Generator().manual_seed(1)
    q = torch.randn(n, heads, 128, generator=gen).to("cuda", torch.bfloat16)
    k = torch.randn(n, kv_heads, 128, generator=gen).to("cuda", torch.bfloat16)
    v = torch.randn(n, kv_heads, 128, generator=gen).to("cuda", torch.bfloat16)
    whole = Segments(torch.tensor([0, n], dtype=torch.int32, device="cuda"), n, 128**-0.5, None, None)
    want = kernel(q, k, v, whole)
    for chunk in (4096, 8192, 16384, 5003):
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            got = kernel(q[start:end], k[:end], v[:end], _cut(start, end, 0, whole))
            assert torch.equal(got, want[start:end]), (shape, chunk, start)
    assert torch.equal(kernel(q[n - 1 :], k, v, _cut(n - 1, n, 0, whole)), want[n - 1 :])
    prefix = 3000  # a shared node's rows in one segment, then a response's after it
    node = kernel(q[:prefix], k[:prefix], v[:prefix], _cut(0, prefix, 0, whole))
    qs = torch.cat([q[:prefix], q[prefix:4000]])
    ks, vs = torch.cat([k[:prefix], k[:4000]]), torch.cat([v[:prefix], v[:4000]])
    beside = kernel(qs, ks, vs, _cut(prefix, 4000, prefix, whole))
    assert torch.equal(node, want[:prefix])
    assert torch.equal(beside[prefix:], want[prefix:4000])

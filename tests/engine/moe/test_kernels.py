"""The MoE layer's steps around its GEMMs (moe_ops). Combining: the torch twin against a per-token loop
written here, the Triton kernel against the twin. Routing: dispatch.plan_kernel against dispatch.plan (torch's
softmax, topk and stable sort). The kernels run on CPU in Triton's interpreter in float32, in a fresh
process; on a GPU in bf16."""

from __future__ import annotations

import pytest
import torch

from service.engine.moe import dispatch, routing_rule
from service.engine.moe import kernels as moe_ops
from service.engine.runtime import triton_jit
from tests.engine.interpreter import INTERPRETED, only_interpreted, run_interpreter_cases


def test_kernel_cases_in_a_fresh_process() -> None:
    run_interpreter_cases(__file__)


def inputs(  # noqa: PLR0917
    t: int, k: int, width: int, dtype: torch.dtype, w_dtype: torch.dtype, device: str = "cpu", seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [t, width], y [t·k, width] (grouped rows), slots [t, k] (a permutation), w [t, k], extra."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, width, generator=gen).to(device=device, dtype=dtype)
    y = (torch.randn(t * k, width, generator=gen) * 3).to(device=device, dtype=dtype)
    slots = torch.randperm(t * k, generator=gen).view(t, k).to(device)
    w = torch.rand(t, k, generator=gen).to(device=device, dtype=w_dtype)
    extra = torch.randn(t, width, generator=gen).to(device=device, dtype=dtype)
    return x, y, slots, w, extra


def loop_reference(
    x: torch.Tensor, y: torch.Tensor, slots: torch.Tensor, w: torch.Tensor, extra: torch.Tensor | None
) -> torch.Tensor:
    """Token by token, slot by slot: products rounded to w's dtype, a float32 sum, one rounding."""
    out = x.clone()
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1], dtype=torch.float32)
        for j in range(w.shape[1]):
            acc += (y[slots[t, j]].float() * w[t, j].float()).to(w.dtype).float()
        total = acc.to(x.dtype)
        if extra is not None:
            total = total + extra[t]
        out[t] += total
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("w_dtype", ["model", torch.float32], ids=["w_model_dtype", "w_float32"])
@pytest.mark.parametrize("shared", [False, True], ids=["plain", "extra"])
def test_twin_equals_the_loop(dtype: torch.dtype, w_dtype: torch.dtype | str, shared: bool) -> None:
    x, y, slots, w, extra = inputs(9, 4, 48, dtype, dtype if w_dtype == "model" else torch.float32)
    want = loop_reference(x, y, slots, w, extra if shared else None)
    moe_ops.combine_torch(x, y, slots, w, extra if shared else None)
    if dtype == torch.float32:
        torch.testing.assert_close(x, want, atol=1e-6, rtol=1e-6)
    else:  # torch sums in its own order: one rounding apart, twice more rounded (extra, the residual)
        assert float((x.float() - want.float()).abs().max()) <= 2**-6 * float(want.float().abs().max())


@only_interpreted
@pytest.mark.parametrize("shared", [False, True], ids=["plain", "extra"])
@pytest.mark.parametrize("width", [48, 100])
def test_interpreter_kernel_equals_the_twin(shared: bool, width: int) -> None:
    x, y, slots, w, extra = inputs(7, 3, width, torch.float32, torch.float32)
    want = x.clone()
    moe_ops.combine_torch(want, y, slots, w, extra if shared else None)
    strided = torch.zeros(7, width + 16)[:, 5 : 5 + width]  # a residual that is a view with a row stride
    strided.copy_(x)
    moe_ops.combine_kernel(strided, y, slots, w, extra if shared else None)
    torch.testing.assert_close(strided, want, atol=1e-6, rtol=1e-6)


def test_kernel_refuses_cpu_tensors_outside_the_interpreter() -> None:
    if INTERPRETED:
        pytest.skip("the interpreter runs it on CPU")
    x, y, slots, w, _ = inputs(2, 2, 8, torch.float32, torch.float32)
    with pytest.raises(ValueError, match="CUDA or under TRITON_INTERPRET"):
        moe_ops.combine_kernel(x, y, slots, w, None)


@pytest.mark.gpu
@pytest.mark.parametrize("w_dtype", ["model", torch.float32], ids=["w_bf16", "w_float32"])
@pytest.mark.parametrize("shared", [False, True], ids=["plain", "extra"])
def test_kernel_equals_the_loop_on_cuda(w_dtype: torch.dtype | str, shared: bool) -> None:
    """Qwen3-30B-A3B's width and top-8: the same rounding steps as the loop and the same float32 sum
    order. With bf16 weights each product is rounded, so the same bits; with float32 ones the compiler
    may fuse a product into its sum (one rounding fewer): within one bf16 rounding."""
    dtype = torch.bfloat16
    x, y, slots, w, extra = inputs(300, 8, 2048, dtype, dtype if w_dtype == "model" else torch.float32)
    want = loop_reference(x, y, slots, w, extra if shared else None)
    x, y, slots, w, extra = (a.cuda() for a in (x, y, slots, w, extra))
    moe_ops.combine_kernel(x, y, slots, w, extra if shared else None)
    if w.dtype == dtype:
        assert torch.equal(x.cpu(), want)
    else:
        torch.testing.assert_close(
            x.cpu().float(), want.float(), atol=2**-8 * float(want.float().abs().max()), rtol=0
        )


# ---- routing -------------------------------------------------------------------------------------


def distinct_logits(t: int, experts: int, seed: int, device: str = "cpu") -> torch.Tensor:
    """[t, experts] logits, each row a permutation of distinct values exact in bf16 (no ties)."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.arange(experts, dtype=torch.float32) / 16 - experts / 32
    rows = torch.stack([values[torch.randperm(experts, generator=gen)] for _ in range(t)])
    return rows.to(device)


def assert_same_plan(got: dispatch.Plan, want: dispatch.Plan) -> None:
    assert torch.equal(got.rows, want.rows)
    assert torch.equal(got.slots, want.slots)
    assert torch.equal(got.groups.offsets, want.groups.offsets)
    assert got.weights.dtype == want.weights.dtype
    torch.testing.assert_close(got.weights.float(), want.weights.float(), atol=1e-6, rtol=1e-5)


RULES = [
    routing_rule.Routing(2, normalise=True, round_weights=True),  # Qwen3-MoE
    routing_rule.Routing(2, normalise=True, round_weights=False),  # Mixtral
    routing_rule.Routing(8, normalise=False, round_weights=True),  # Qwen2-MoE without norm_topk_prob, top-8
]


@only_interpreted
@pytest.mark.parametrize("rule", RULES, ids=["qwen3", "mixtral", "qwen2_top8"])
@pytest.mark.parametrize(("tokens", "experts"), [(1, 8), (31, 8), (77, 12), (100, 128), (1100, 16)])
def test_interpreter_plan_kernel_equals_torch(rule: routing_rule.Routing, tokens: int, experts: int) -> None:
    """Every block size around the kernel's 32 tokens, more blocks than one step of the prefix sum over
    them, E a power of two and not; the router an identity so the logits are exactly the ones given."""
    if rule.top_k > experts:
        pytest.skip("top-k over the experts")
    logits = distinct_logits(tokens, experts, seed=tokens) + torch.randn(tokens, experts) * 1e-3
    router = torch.eye(experts)
    assert_same_plan(dispatch.plan_kernel(logits, router, rule), dispatch.plan(logits, router, rule))


@only_interpreted
@pytest.mark.parametrize(("rows", "chunk"), [(4, 8), (2, 32), (64, 2)])
def test_interpreter_plan_kernel_scans_in_many_steps(
    monkeypatch: pytest.MonkeyPatch, rows: int, chunk: int
) -> None:
    """The scan's two loops over the blocks, each in steps shorter than the blocks (35 of them here):
    the lower experts' sum ROWS blocks a step, an expert's column CHUNK blocks a step."""
    monkeypatch.setattr(moe_ops, "SCAN_ROWS", rows)
    monkeypatch.setattr(moe_ops, "SCAN_BLOCKS", chunk)
    rule = RULES[2]
    logits = distinct_logits(1100, 16, seed=3) + torch.randn(1100, 16) * 1e-3
    router = torch.eye(16)
    assert_same_plan(dispatch.plan_kernel(logits, router, rule), dispatch.plan(logits, router, rule))


@only_interpreted
def test_interpreter_plan_kernel_of_no_tokens() -> None:
    rule = RULES[0]
    got = dispatch.plan_kernel(torch.zeros(0, 8), torch.eye(8), rule)
    assert got.rows.shape == (0,)
    assert got.slots.shape == (0, 2)
    assert got.groups.offsets.tolist() == [0] * 9


@only_interpreted
def test_interpreter_ties_go_to_the_lower_expert_whatever_the_batch() -> None:
    """Rows of four equal logits ahead of the rest: the two lowest ids of the tie, the same for a token
    alone as among others."""
    rule = routing_rule.Routing(2, normalise=True, round_weights=False)
    tied = torch.full((40, 8), -1.0)
    for t in range(40):
        tied[t, torch.randperm(8, generator=torch.Generator().manual_seed(t))[:4]] = 2.0
    router = torch.eye(8)
    whole = dispatch.plan_kernel(tied, router, rule)
    for t in (0, 17, 39):
        alone = dispatch.plan_kernel(tied[t : t + 1], router, rule)
        lowest = torch.nonzero(tied[t] == 2.0).flatten()[:2].tolist()
        assert sorted(alone.rows.tolist()) == [0, 0]
        assert torch.equal(alone.weights[0], whole.weights[t])
        experts = torch.searchsorted(whole.groups.offsets[1:], whole.slots[t], right=True).tolist()
        assert experts == lowest
        assert torch.searchsorted(alone.groups.offsets[1:], alone.slots[0], right=True).tolist() == lowest


@pytest.mark.gpu
@pytest.mark.parametrize("rule", RULES, ids=["qwen3", "mixtral", "qwen2_top8"])
def test_plan_kernel_equals_torch_on_cuda(rule: routing_rule.Routing) -> None:
    """Qwen3-30B-A3B's router shape at 16k + 5 tokens in bf16, no ties: the same plan as torch's."""
    logits = distinct_logits(16389, 128, seed=1, device="cuda").to(torch.bfloat16)
    router = torch.eye(128, device="cuda", dtype=torch.bfloat16)
    assert_same_plan(dispatch.plan_kernel(logits, router, rule), dispatch.plan(logits, router, rule))


@pytest.mark.gpu
def test_routing_kernels_compile_once_whatever_the_token_count() -> None:
    """A micro-batch of any padded size meets kernels already compiled (a compile costs seconds at
    start and would stall a round met while serving): 128 to 16k tokens, one compile per kernel."""
    triton = triton_jit.triton()
    compiled: list[str] = []

    def hook(**kwargs: object) -> None:
        compiled.append(str(getattr(kwargs["fn"], "name", kwargs["fn"])))

    before = triton.knobs.runtime.jit_post_compile_hook
    triton.knobs.runtime.jit_post_compile_hook = hook
    try:
        router = torch.eye(128, device="cuda", dtype=torch.bfloat16)
        for tokens in (128, 256, 1024, 1152, 4096, 8192, 16384):  # whole and odd counts of 512
            logits = distinct_logits(tokens, 128, seed=tokens, device="cuda").to(torch.bfloat16)
            dispatch.plan_kernel(logits, router, routing_rule.Routing(8, normalise=True, round_weights=False))
        torch.cuda.synchronize()
    finally:
        triton.knobs.runtime.jit_post_compile_hook = before
    assert len(compiled) == len(set(compiled)), compiled


@pytest.mark.gpu
def test_tied_routing_on_cuda_does_not_depend_on_the_batch() -> None:
    """bf16 logits with four-way ties at the top in every token: each token's experts and weights are
    the same alone as among 16k others, and the tie goes to the lowest ids."""
    rule = routing_rule.Routing(2, normalise=True, round_weights=True)
    gen = torch.Generator().manual_seed(0)
    tied = torch.full((16384, 8), -1.0)
    tied[:, :4] = 2.0  # a tie among experts 0-3, and every 97th token among four others
    for t in range(0, 16384, 97):
        tied[t] = -1.0
        tied[t, torch.randperm(8, generator=gen)[:4]] = 2.0
    logits = tied.to("cuda", torch.bfloat16)
    router = torch.eye(8, device="cuda", dtype=torch.bfloat16)
    whole = dispatch.plan_kernel(logits, router, rule)
    for t in (0, 97, 5044, 16383):
        alone = dispatch.plan_kernel(logits[t : t + 1], router, rule)
        lowest = torch.nonzero(tied[t] == 2.0).flatten()[:2].tolist()
        assert torch.equal(alone.weights[0], whole.weights[t])
        assert torch.searchsorted(whole.groups.offsets[1:], whole.slots[t], right=True).tolist() == lowest
        assert torch.searchsorted(alone.groups.offsets[1:], alone.slots[0], right=True).tolist() == lowest


# ---- counting ------------------------------------------------------------------------------------


def routed(tokens: int, experts: int, seed: int, device: str = "cpu") -> tuple[dispatch.Plan, torch.Tensor]:
    """The plan of top-2 routing over distinct logits, and each token's expert ids [tokens, 2]."""
    logits = distinct_logits(tokens, experts, seed=seed, device=device)
    rule = routing_rule.Routing(2, normalise=True, round_weights=False)
    return dispatch.plan(logits, torch.eye(experts, device=device), rule), rule(logits)[1]


def loop_counts(experts: torch.Tensor, real: int, first: int, count: int) -> list[int]:
    """Token by token: the experts of the tokens whose row in the forward (first + t) is below `real`."""
    counts = [0] * count
    for t, chosen in enumerate(experts.tolist()):
        if first + t < real:
            for expert in chosen:
                counts[expert] += 1
    return counts


COUNT_CASES = [(40, 40, 0), (40, 33, 0), (40, 70, 37), (40, 20, 30), (1, 1, 0), (300, 250, 0)]
COUNT_IDS = ["no-filler", "filler", "from-row-37", "all-filler", "one-token", "many-tokens"]


@pytest.mark.parametrize(("tokens", "real", "first"), COUNT_CASES, ids=COUNT_IDS)
def test_twin_counts_the_real_tokens(tokens: int, real: int, first: int) -> None:
    plan, experts = routed(tokens, 8, seed=tokens)
    counts = torch.full((8,), 5, dtype=torch.int32)  # the counts of earlier calls, added to
    moe_ops.count_torch(
        plan.rows, plan.groups.offsets, torch.tensor([real], dtype=torch.int32), first, counts, 64
    )
    assert counts.tolist() == [5 + n for n in loop_counts(experts, real, first, 8)]


@only_interpreted
@pytest.mark.parametrize(("tokens", "real", "first"), COUNT_CASES, ids=COUNT_IDS)
def test_interpreter_count_kernel_equals_the_twin(tokens: int, real: int, first: int) -> None:
    """A tail of 64 rows: more than any expert's filler here (at most 40), fewer than a group's rows."""
    plan, _ = routed(tokens, 8, seed=tokens)
    bound = torch.tensor([real], dtype=torch.int32)
    want, got = torch.full((8,), 5, dtype=torch.int32), torch.full((8,), 5, dtype=torch.int32)
    moe_ops.count_torch(plan.rows, plan.groups.offsets, bound, first, want, 64)
    moe_ops.count_kernel(plan.rows, plan.groups.offsets, bound, first, got, 64)
    assert got.tolist() == want.tolist()


@pytest.mark.gpu
def test_count_kernel_equals_the_loop_on_cuda() -> None:
    """16k tokens over 128 experts, the last 127 filler (a packed row's most), tail 128."""
    plan, experts = routed(16384, 128, seed=2, device="cuda")
    counts = torch.zeros(128, dtype=torch.int32, device="cuda")
    real = torch.tensor([16384 - 127], dtype=torch.int32, device="cuda")
    moe_ops.count_kernel(plan.rows, plan.groups.offsets, real, 0, counts, 128)
    assert counts.tolist() == loop_counts(experts.cpu(), 16384 - 127, 0, 128)

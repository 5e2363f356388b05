"""Replay and recording in the routing kernel (moe_ops.route_kernel given LayerRoutes) against its
torch twin (dispatch.plan, replay.choose): the same plan (ids, grouping, weights), the same ids
written to `used`, the same top-k to `live`, the same |given ∩ live| to `matches`. The routes are a
layer's strided views of BatchRoutes' [N, layers, k] buffers, the call's rows from `first` on. On CPU in
Triton's interpreter (a fresh process), on a GPU in bf16."""

from __future__ import annotations

import pytest
import torch

from service.engine.batch.device_routes import BatchRoutes
from service.engine.moe import dispatch, routing_rule
from tests.engine.interpreter import only_interpreted, run_interpreter_cases
from tests.engine.moe.test_kernels import RULES, assert_same_plan, distinct_logits

LAYERS, LAYER = 3, 1  # the call routes layer 1 of 3: strided views


def test_kernel_cases_in_a_fresh_process() -> None:
    run_interpreter_cases(__file__)


def batch_routes(  # noqa: PLR0917
    rows: int,
    k: int,
    experts: int,
    seed: int,
    given: bool,
    device: str = "cpu",
    own: torch.Tensor | None = None,
) -> BatchRoutes:
    """Routes over `rows` rows: random distinct given ids (uint8) at every other block of 5 rows (or
    `own` [rows, k], the router's top-k, at layer LAYER), fresh buffers filled with a sentinel."""
    used = torch.full((rows, LAYERS, k), -7, dtype=torch.int32, device=device)
    if not given:
        return BatchRoutes(used)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(rows * LAYERS)])
    ids = ids.view(rows, LAYERS, k)
    if own is not None:
        ids[:, LAYER] = own.cpu()
    covered = (torch.arange(rows) // 5) % 2 == 0
    matches = torch.full((rows, LAYERS), -3, dtype=torch.int8, device=device)
    return BatchRoutes(
        used, ids.to(device, torch.uint8), covered.to(device), torch.full_like(used, -5), matches
    )


def both(  # noqa: PLR0917
    logits: torch.Tensor,
    rule: routing_rule.Routing,
    given: bool,
    first: int,
    rows: int,
    own: torch.Tensor | None = None,
) -> tuple[dispatch.Plan, dispatch.Plan, BatchRoutes, BatchRoutes]:
    """The kernel's and the twin's plans of logits (the router an identity) as rows first .. of a row
    of `rows`, each writing its own copy of the same routes."""
    experts = logits.shape[1]
    device = str(logits.device)
    kernel = batch_routes(rows, rule.top_k, experts, rows, given, device, own)
    twin = batch_routes(rows, rule.top_k, experts, rows, given, device, own)
    router = torch.eye(experts, device=logits.device, dtype=logits.dtype)
    got = dispatch.plan_kernel(logits, router, rule, routes=kernel.layer(LAYER), first=first)
    want = dispatch.plan(logits, router, rule, routes=twin.layer(LAYER), first=first)
    return got, want, kernel, twin


def assert_same_records(kernel: BatchRoutes, twin: BatchRoutes) -> None:
    assert torch.equal(kernel.used, twin.used)
    for got, want in ((kernel.live, twin.live), (kernel.matches, twin.matches)):
        assert (got is None) == (want is None)
        if got is not None and want is not None:
            assert torch.equal(got, want)


@only_interpreted
@pytest.mark.parametrize("rule", RULES, ids=["qwen3", "mixtral", "qwen2_top8"])
@pytest.mark.parametrize("given", [True, False], ids=["replay", "record"])
@pytest.mark.parametrize(("tokens", "experts", "first"), [(1, 8, 0), (31, 8, 4), (77, 12, 9), (100, 128, 0)])
def test_interpreter_replay_kernel_equals_the_twin(
    rule: routing_rule.Routing, given: bool, tokens: int, experts: int, first: int
) -> None:
    """Covered and uncovered tokens in one block and across blocks, E a power of two and not, a call
    from row `first` of a longer row: the same plan and the same records."""
    if rule.top_k > experts:
        pytest.skip("top-k over the experts")
    logits = distinct_logits(tokens, experts, seed=tokens) + torch.randn(tokens, experts) * 1e-3
    got, want, kernel, twin = both(logits, rule, given, first, first + tokens + 3)
    assert_same_plan(got, want)
    assert torch.equal(got.experts.long(), want.experts)
    assert_same_records(kernel, twin)
    rows = slice(first, first + tokens)
    assert torch.equal(kernel.used[:first], twin.used[:first])  # the rows before the call untouched
    assert (kernel.used[:first] == -7).all()
    assert (kernel.used[rows.stop :] == -7).all()
    if given:
        assert kernel.covered is not None
        assert kernel.given is not None
        assert kernel.matches is not None
        covered = kernel.covered[rows]
        taken = torch.where(covered[:, None], kernel.given[rows, LAYER].long(), rule(logits)[1])
        assert torch.equal(kernel.used[rows, LAYER].long(), taken)
        assert (kernel.matches[rows, LAYER][~covered] == 0).all()
        assert (kernel.matches[:, 0] == -3).all()  # another layer's column untouched


@only_interpreted
@pytest.mark.parametrize("rule", RULES, ids=["qwen3", "mixtral", "qwen2_top8"])
def test_interpreter_given_live_routes_replay_as_live(rule: routing_rule.Routing) -> None:
    """Given ids equal to the router's own top-k (in its slot order): the live plan exactly, the same
    weights bit for bit, full agreement at covered tokens."""
    tokens, experts = 70, 16
    logits = distinct_logits(tokens, experts, seed=3) + torch.randn(tokens, experts) * 1e-3
    router = torch.eye(experts)
    live = dispatch.plan_kernel(logits, router, rule)
    got, _, kernel, _ = both(logits, rule, True, 0, tokens, own=live.experts.long())
    assert torch.equal(got.weights, live.weights)
    assert torch.equal(got.slots, live.slots)
    assert torch.equal(got.rows, live.rows)
    assert kernel.covered is not None
    assert kernel.matches is not None
    assert (kernel.matches[:, LAYER][kernel.covered] == rule.top_k).all()


def test_agreement_counts_from_matches() -> None:
    """BatchRoutes.agreement from the int8 matches [N, layers]: the layers at k, the sum."""
    used = torch.zeros((3, 2, 4), dtype=torch.int32)
    matches = torch.tensor([[4, 4], [4, 2], [0, 1]], dtype=torch.int8)
    routes = BatchRoutes(
        used, torch.zeros((3, 2, 4), dtype=torch.uint8), torch.ones(3, dtype=torch.bool), used, matches
    )
    agreement = routes.agreement()
    assert agreement is not None
    assert agreement[0].tolist() == [2, 1, 0]
    assert agreement[1].tolist() == [8, 6, 1]


@pytest.mark.gpu
@pytest.mark.parametrize("rule", RULES, ids=["qwen3", "mixtral", "qwen2_top8"])
@pytest.mark.parametrize("given", [True, False], ids=["replay", "record"])
def test_replay_kernel_equals_the_twin_on_cuda(rule: routing_rule.Routing, given: bool) -> None:
    """Qwen3-30B-A3B's router shape, 4k + 5 tokens from row 100 of a longer row, bf16, no ties."""
    logits = distinct_logits(4101, 128, seed=1, device="cuda").to(torch.bfloat16)
    got, want, kernel, twin = both(logits, rule, given, 100, 4301)
    assert_same_plan(got, want)
    assert_same_records(kernel, twin)

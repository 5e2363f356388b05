"""The prefix cache through the whole service: a prompt computed once whichever request brings it.

GRPO groups split over requests (posted one after another, and at once), an agent's trajectory
scored step by step (whole, and in chunks of a small budget), a critic and a reference model, top-K
asks over actions inside a cached prefix; each against the float32 per-sequence reference, with
usage.computed_tokens and usage.cached_tokens asserted exactly where the order is fixed. Eviction
under a small bound, a reload and a flush between two requests of one prefix (the second scores under
what serves then), batch-invariant bits with and without hits, and MoE routes given by the rollout.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from service.core.cache_plan import BLOCK
from service.core.prefixes import share
from service.http.weight_sync import FLUSHED
from tests.support import critics, models
from tests.support.device import DTYPE, TOLERANCE, VALUE_RTOL, eager, settings_for
from tests.support.launches import serve
from tests.support.reference import assert_values_close, check_reply, expected, max_diff
from tests.support.servers import running

ADMIN = "admin-key"
AS_ADMIN = {"Authorization": f"Bearer {ADMIN}"}


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, models.VOCAB) for _ in range(n)]


def _groups(rng: random.Random, count: int, samples: int) -> list[tuple[list[int], list[list[int]]]]:
    """GRPO groups: a prompt (its length off the block boundary) and `samples` responses, each response
    starting with its own token (no two samples share a block past the prompt)."""
    out = []
    for _ in range(count):
        prompt = _tokens(rng, rng.choice([BLOCK * k + r for k in (2, 3) for r in (3, 7, 11)]))
        out.append((prompt, [[3 + s, *_tokens(rng, rng.randint(4, 12))] for s in range(samples)]))
    return out


def _request(rows: list[tuple[list[int], list[int]]], **options: Any) -> dict[str, Any]:
    return {
        "input_ids": [p + r for p, r in rows],
        "num_actions": [len(r) for _, r in rows],
        "return_entropy": True,
        **options,
    }


def _usage(reply: Any) -> tuple[int, int]:
    usage = reply.json()["usage"]
    return usage["computed_tokens"], usage["cached_tokens"]


@pytest.fixture(scope="module")
def qwen2(model_dirs: dict[str, Path]) -> Path:
    return model_dirs["qwen2"]


@pytest.mark.parametrize("name", models.ARCHITECTURES)
def test_split_groups_posted_one_after_another_compute_each_prompt_once(
    model_dirs: dict[str, Path], reference_models: dict[str, Any], name: str
) -> None:
    """Rank s posts sample s of every group (verl's balance_batch): the first request computes every
    prompt, each later one reads the prompt's whole blocks and computes the rest of each row; every
    architecture (sliding windows, soft-capping, the transformers decoder for gemma2 and phi3)."""
    rng = random.Random(f"split-sequential-{name}")
    groups = _groups(rng, 4, 4)
    with serve(settings_for(model_dirs[name], share_min_tokens=8)) as s:
        for sample in range(4):
            rows = [(prompt, responses[sample]) for prompt, responses in groups]
            request = _request(rows)
            reply = s.client.post("/logprobs", json=request)
            check_reply(reply, request, reference_models[name])
            cached = 0 if sample == 0 else sum(len(p) // BLOCK * BLOCK for p, _ in rows)
            assert _usage(reply) == (sum(len(p + r) for p, r in rows) - cached, cached)
        metrics = s.client.get("/metrics").text
        hits = sum(len(p) // BLOCK * BLOCK for p, _ in groups) * 3
        assert f"logprobd_prefix_cache_hit_tokens_total {float(hits)}" in metrics


def test_split_groups_posted_at_once_compute_about_the_unique_tokens(
    qwen2: Path, reference_models: dict[str, Any]
) -> None:
    """The four ranks' requests at once: each prompt is computed once, shared in a micro-batch or read
    from the cache (at most a block of it again per row); what the requests report sums to what ran."""
    rng = random.Random("split-concurrent")
    groups = _groups(rng, 4, 4)
    requests = [_request([(p, responses[s]) for p, responses in groups]) for s in range(4)]
    with serve(settings_for(qwen2, share_min_tokens=8, batch_wait_ms=1.0, max_batch_tokens=256)) as s:
        with ThreadPoolExecutor(max_workers=4) as pool:
            replies = list(pool.map(lambda r: s.client.post("/logprobs", json=r), requests))
        for request, reply in zip(requests, replies, strict=True):
            check_reply(reply, request, reference_models["qwen2"])
        computed = sum(_usage(r)[0] for r in replies)
        cached = sum(_usage(r)[1] for r in replies)
        assert cached == sum(launch.cache.cached_tokens for launch in s.launches if launch.cache)
        metrics = s.client.get("/metrics").text
        ran = next(
            float(line.split()[1])
            for line in metrics.splitlines()
            if line.startswith("logprobd_computed_tokens_total")
        )
        assert abs(computed - ran) <= len(requests)  # each request's part of a shared prefix, rounded
        rows = [np.asarray(row) for r in requests for row in r["input_ids"]]
        unique = share(rows, 1).computed_tokens
        assert unique <= ran <= unique + len(rows) * BLOCK
        assert computed + cached <= sum(len(row) for row in rows)


@pytest.fixture(scope="module")
def long_qwen2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """qwen2 with 512 positions, and its reference."""
    directory = models.save("qwen2", tmp_path_factory.mktemp("long") / "qwen2", max_position_embeddings=512)
    return directory, eager(directory)


@pytest.mark.parametrize("budget", [16384, 64], ids=["whole", "chunked"])
def test_a_trajectory_scored_step_by_step_computes_each_step_once(
    long_qwen2: tuple[Path, Any], budget: int
) -> None:
    """Step s is step s - 1's sequence, a tool result and an answer (the actions): it reads every
    whole block of step s - 1; past a budget of 64 its new tokens go in chunks, the first reading the
    cached context into its store and every chunk writing its whole blocks."""
    directory, reference = long_qwen2
    rng = random.Random(f"trajectory-{budget}")
    with serve(settings_for(directory, max_batch_tokens=budget)) as s:
        for _ in range(2):
            context = _tokens(rng, 40)
            previous = 0
            for step in range(4):
                answer = _tokens(rng, rng.randint(30, 50))
                context = context + _tokens(rng, rng.randint(20, 40)) + answer
                request = {"input_ids": [context], "num_actions": len(answer), "return_entropy": True}
                reply = s.client.post("/logprobs", json=request)
                check_reply(reply, request, reference)
                cached = previous // BLOCK * BLOCK if step else 0
                assert _usage(reply) == (len(context) - cached, cached)
                previous = len(context)
        if budget == 64:
            assert any(chunk.cached and chunk.start == chunk.cached for chunk in s.chunks())


def test_values_and_reference_log_probs_read_their_own_models_cache(
    model_dirs: dict[str, Path],
    ref_dir: Path,
    ref_model: Any,
    reference_models: dict[str, Any],
    tmp_path: Path,
) -> None:
    critic_dir = critics.save("trl", tmp_path / "trl")
    rng = random.Random("ppo-cache")
    groups = _groups(rng, 3, 3)
    settings = settings_for(model_dirs["qwen2"], critic=critic_dir, ref_model=ref_dir)
    with serve(settings) as s:
        # the first request runs the policy alone: its blocks are not the reference's or the critic's
        first = _request([(p, responses[0]) for p, responses in groups])
        assert _usage(s.client.post("/logprobs", json=first))[1] == 0
        for sample in (1, 2):
            rows = [(p, responses[sample]) for p, responses in groups]
            request = _request(rows, return_values=True, return_ref_logprobs=True)
            reply = s.client.post("/logprobs", json=request)
            check_reply(reply, request, reference_models["qwen2"])
            body = reply.json()
            assert max_diff(body["ref_logprobs"], expected(ref_model, request).logprobs) <= TOLERANCE
            values = critics.window_values(critic_dir, request, body["action_mask"])
            assert_values_close(body["values"], values, TOLERANCE, VALUE_RTOL)
            cached = 0 if sample == 1 else sum(len(p) // BLOCK * BLOCK for p, _ in rows)
            assert _usage(reply)[1] == cached


def test_top_k_over_actions_inside_a_cached_prefix_reads_its_hidden_states(
    qwen2: Path, reference_models: dict[str, Any]
) -> None:
    """Every position an action, as a teacher's prompt_logprobs: the second row's actions inside the
    shared prefix are scored from the hidden states the first kept, top-K included."""
    rng = random.Random("topk-cache")
    prefix = _tokens(rng, 3 * BLOCK + 5)
    rows = [prefix + _tokens(rng, 9), [*prefix, 4, *_tokens(rng, 7)]]
    answers = []
    for cache in (True, False):
        with running(settings_for(qwen2, prefix_cache=cache)) as client:
            replies = []
            for row in rows:
                request = {"input_ids": [row], "num_actions": len(row) - 1, "top_logprobs": 3}
                reply = client.post("/logprobs", json=request)
                check_reply(reply, request, reference_models["qwen2"])
                replies.append(reply.json())
            answers.append(replies)
            assert replies[1]["usage"]["cached_tokens"] == (3 * BLOCK if cache else 0)
    (hit, plain) = answers
    if DTYPE == "float32":  # in a half precision a near-tie may order two ids either way
        assert hit[1]["top_ids"] == plain[1]["top_ids"]
    assert max_diff(hit[1]["top_logprobs"][0], plain[1]["top_logprobs"][0]) <= TOLERANCE


def test_a_small_cache_evicts_the_least_recently_used_blocks(qwen2: Path) -> None:
    rng = random.Random("evict")
    a, b = _tokens(rng, 3 * BLOCK + 4), _tokens(rng, 3 * BLOCK + 4)
    with running(settings_for(qwen2, prefix_cache_tokens=4 * BLOCK)) as client:
        assert client.get("/info").json()["prefix_cache_tokens"] == 4 * BLOCK

        def post(row: list[int]) -> tuple[int, int]:
            return _usage(client.post("/logprobs", json={"input_ids": [row], "num_actions": 2}))

        assert post([*a, 5]) == (len(a) + 1, 0)  # 3 blocks written
        assert post([*b, 5]) == (len(b) + 1, 0)  # 3 more: a's last two go
        assert post([*a, 6]) == (len(a) + 1 - BLOCK, BLOCK)
        metrics = client.get("/metrics").text
        # a's last two went for b's, then b's last two for a's again
        assert f"logprobd_prefix_cache_evicted_tokens_total {float(4 * BLOCK)}" in metrics
        assert "logprobd_prefix_cache_held_bytes" in metrics


def test_new_weights_and_a_flush_drop_what_was_cached(
    weight_versions: dict[str, Path], version_models: dict[str, Any]
) -> None:
    """The same prefix before and after a reload, and after POST /flush_cache: the later request reads
    nothing and scores under the weights then served."""
    rng = random.Random("stale")
    prompt = _tokens(rng, 4 * BLOCK + 3)
    requests = [_request([(prompt, [3 + k, *_tokens(rng, 6)])]) for k in range(4)]
    settings = settings_for(weight_versions["v10"], admin_api_keys=ADMIN, weights_version="v10")
    with running(settings) as client:

        def post(request: dict[str, Any]) -> Any:
            return client.post("/logprobs", json=request)

        check_reply(post(requests[0]), requests[0], version_models["v10"])
        reply = post(requests[1])
        assert _usage(reply)[1] == 4 * BLOCK
        reloaded = client.post(
            "/admin/weights", json={"path": str(weight_versions["v11"]), "version": "v11"}, headers=AS_ADMIN
        )
        assert reloaded.status_code == 200, reloaded.text
        reply = post(requests[2])
        check_reply(reply, requests[2], version_models["v11"])
        assert _usage(reply)[1] == 0
        assert client.post("/flush_cache").status_code == 401
        flushed = client.get("/flush_cache", headers=AS_ADMIN)
        assert (flushed.status_code, flushed.text) == (200, FLUSHED)
        assert flushed.headers["content-type"].startswith("text/plain")
        reply = post(requests[3])
        check_reply(reply, requests[3], version_models["v11"])
        assert _usage(reply)[1] == 0
        assert client.post("/flush_cache", headers=AS_ADMIN).text == FLUSHED


def test_batch_invariant_bits_are_the_same_with_and_without_hits(qwen2: Path) -> None:
    rng = random.Random("invariant-cache")
    prompt = _tokens(rng, 3 * BLOCK + 9)
    first = _request([(prompt, [3, *_tokens(rng, 10)])], temperature=0.7)
    second = _request(
        [(prompt, [4, *_tokens(rng, 12)]), (_tokens(rng, 30), _tokens(rng, 5))], temperature=0.7
    )
    bits = []
    for cache in (True, False):
        with running(settings_for(qwen2, batch_invariant=True, prefix_cache=cache)) as client:
            client.post("/logprobs", json=first)
            reply = client.post("/logprobs", json=second).json()
            assert reply["usage"]["cached_tokens"] == (3 * BLOCK if cache else 0)
            bits.append((reply["logprobs"], reply["entropy"]))
    assert bits[0] == bits[1]


def test_sequences_that_give_moe_routes_are_not_cached(
    model_dirs: dict[str, Path], reference_models: dict[str, Any]
) -> None:
    """Routing replay: the rollout's routes decide the keys, so those sequences neither read nor write
    the cache (docs/semantics.md); a live-routed one after them reads nothing they computed."""
    rng = random.Random("routes-cache")
    prompt = _tokens(rng, 3 * BLOCK + 2)
    with running(settings_for(model_dirs["qwen3_moe"])) as client:
        live = _request([(prompt, [3, 5, 6])], return_routed_experts=True)
        recorded = client.post("/logprobs", json=live)
        assert recorded.status_code == 200, recorded.text
        assert _usage(recorded)[1] == 0
        replayed = {**live, "routed_experts": recorded.json()["routed_experts"]}
        reply = client.post("/logprobs", json=replayed)
        assert reply.status_code == 200, reply.text
        assert _usage(reply)[1] == 0  # read nothing, though the recording wrote its live keys
        assert reply.json()["logprobs"] == recorded.json()["logprobs"]
        live_again = _request([(prompt, [4, 5, 6])])
        after = client.post("/logprobs", json=live_again)
        check_reply(after, live_again, reference_models["qwen3_moe"])  # the live router over cached keys
        assert _usage(after)[1] == 3 * BLOCK  # the recording one's live keys; the replay wrote none

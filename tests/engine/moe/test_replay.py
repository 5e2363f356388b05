"""Routing replay (R3), recorded routes (R2) and route agreement, through the engine, against
transformers' own Qwen3-MoE, Qwen2-MoE and Mixtral forward with its routers' selection forced to the
given experts (the reference's routers patched here, written apart from the engine's code).

CPU, float32: log-probs within 1e-4 for the fused and the transformers decoder, ragged rows, routes
from a later position, partial coverage, shared prefixes (one group's routes differing over the shared
prompt), chunked sequences, with a reference model and a critic served beside the policy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from service.core.jobs import Chunk, GivenRoutes, RouteAgreement, SequenceJob, SequenceScores
from service.core.prefixes import share
from service.engine.decoder import FusedDecoder, graphs
from service.engine.decoder.graphs import EagerRecorder, GraphedDecoder
from service.engine.scorer.engine import PackedScorer
from tests.support import critics, models
from tests.support.device import eager, settings_for
from tests.support.recorders import Counting

pytestmark = pytest.mark.parity  # make test-gpu runs it again on cuda in each dtype

MOE = models.MOE_ARCHITECTURES
DECODERS = ("fused", "transformers")
TOL = 1e-4


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {name: models.save(name, root / name) for name in MOE}


@pytest.fixture(scope="module")
def extras(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A Qwen3-MoE reference policy (other weights) and a critic, served beside the policy."""
    root = tmp_path_factory.mktemp("extras")
    return {
        "reference": models.save("qwen3_moe", root / "ref", seed=5),
        "critic": critics.save("openrlhf", root / "critic"),
    }


_ENGINES: dict[tuple[str, str, bool], PackedScorer] = {}


def engine(path: Path, decoder: str, *, batch_invariant: bool = False, **more: Any) -> PackedScorer:
    key = (str(path), decoder, batch_invariant)
    if key not in _ENGINES or more:
        settings = settings_for(path, decoder=decoder, batch_invariant=batch_invariant, **more)
        built = PackedScorer.from_config(settings.engine_config())
        if more:
            return built
        _ENGINES[key] = built
    return _ENGINES[key]


# ---- the reference: transformers' forward, one sequence alone, routers forced ------------------------


def _sparse_blocks(model: Any) -> list[Any]:
    return [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts")]


def _renormalises(model: Any) -> bool:
    return model.config.model_type == "mixtral" or bool(model.config.norm_topk_prob)


@contextlib.contextmanager
def forced(model: Any, routes: GivenRoutes | None, live: list[torch.Tensor]) -> Iterator[None]:
    """Every sparse block's router picks the given experts at positions start..end-1 (the slot order
    given), weighted by softmax(logits) in float32 gathered there and renormalised where the model's
    router renormalises; elsewhere its own top-k. Appends each router's own top-k ids to `live`."""
    originals = []
    for layer, block in enumerate(_sparse_blocks(model)):
        gate = block.gate

        def forward(hidden: torch.Tensor, gate: Any = gate, layer: int = layer) -> Any:
            hidden = hidden.reshape(-1, gate.weight.shape[1])
            logits = hidden @ gate.weight.T  # [L, E]
            probs = torch.softmax(logits.float(), dim=-1)
            own = torch.topk(probs, gate.top_k, dim=-1).indices
            live.append(own)
            ids = own.clone()
            if routes is not None:
                ids[routes.start : routes.end] = torch.from_numpy(routes.experts[:, layer]).long()
            weights = probs.gather(1, ids)
            if _renormalises(model):
                weights = weights / weights.sum(dim=-1, keepdim=True)
            if model.config.model_type != "mixtral":
                weights = weights.to(logits.dtype)
            return logits, weights, ids

        originals.append((gate, gate.forward))
        gate.forward = forward
    try:
        yield
    finally:
        for gate, original in originals:
            gate.forward = original


def reference(model: Any, job: SequenceJob) -> tuple[np.ndarray, np.ndarray]:
    """log-probs [A] of the job's actions, and the routes [L, layers, k] its forward used."""
    live: list[torch.Tensor] = []
    with torch.no_grad(), forced(model, job.routes, live):
        logits = model(input_ids=torch.from_numpy(job.tokens)[None]).logits[0]
    logp = torch.log_softmax(logits.double() / job.temperature, dim=-1)
    logprobs = logp[torch.from_numpy(job.actions - 1), torch.from_numpy(job.tokens[job.actions])].numpy()
    used = torch.stack(live, dim=1).numpy()  # [L, layers, k]
    if job.routes is not None:
        used[job.routes.start : job.routes.end] = job.routes.experts
    return logprobs, used


def random_routes(rng: np.random.Generator, model: Any, positions: int, start: int = 0) -> GivenRoutes:
    blocks = _sparse_blocks(model)
    experts, k = blocks[0].gate.weight.shape[0], blocks[0].gate.top_k
    ids = [[rng.permutation(experts)[:k] for _ in blocks] for _ in range(positions)]
    return GivenRoutes(start, np.asarray(ids, dtype=np.int64).reshape(positions, len(blocks), k))


def job(
    tokens: np.ndarray, routes: GivenRoutes | None = None, *, return_routes: bool = True, **more: Any
) -> SequenceJob:
    n = tokens.shape[0]
    return SequenceJob(
        tokens=tokens,
        actions=np.arange(max(1, n // 3), n, dtype=np.int64),
        temperature=1.0,
        return_entropy=False,
        routes=routes,
        return_routes=return_routes,
        **more,
    )


def check(model: Any, jobs: list[SequenceJob], got: list[SequenceScores]) -> None:
    """Each job's scores within TOL of the forced reference; its routes those the reference used
    (up to near-ties of the live router); its agreement the reference's."""
    for i, (j, scores) in enumerate(zip(jobs, got, strict=True)):
        want, used = reference(model, j)
        np.testing.assert_allclose(scores.logprobs, want, atol=TOL, err_msg=f"sequence {i}")
        assert scores.routes is not None
        assert scores.routes.shape == used.shape
        same = np.sort(scores.routes, axis=-1) == np.sort(used, axis=-1)
        assert same.mean() >= 0.99, f"sequence {i}: {same.mean():.3f} of the routes as the reference's"
        if j.routes is None:
            assert scores.route_agreement is None
            continue
        assert scores.route_agreement is not None
        positions = j.routes.experts.shape[0]
        assert scores.route_agreement.compared == positions * j.routes.experts.shape[1]


def ragged(rng: np.random.Generator, model: Any) -> list[SequenceJob]:
    """Rows of 9, 23, 40 and 17 tokens: routes over all of one, from position 5 to 15 of the next (start
    > 0, partial), none for the third, every position but the last for the fourth (as a rollout gives)."""
    tokens = [rng.integers(3, models.VOCAB, n) for n in (9, 23, 40, 17)]
    return [
        job(tokens[0], random_routes(rng, model, 9)),
        job(tokens[1], random_routes(rng, model, 10, start=5)),
        job(tokens[2]),
        job(tokens[3], random_routes(rng, model, 16)),
    ]


@pytest.mark.parametrize("decoder", DECODERS)
@pytest.mark.parametrize("name", MOE)
def test_replay_matches_the_forced_reference_on_ragged_rows(
    moe_dirs: dict[str, Path], name: str, decoder: str
) -> None:
    model = eager(moe_dirs[name])
    rng = np.random.default_rng(1)
    jobs = ragged(rng, model)
    check(model, jobs, engine(moe_dirs[name], decoder).score(jobs))


@pytest.mark.parametrize("decoder", DECODERS)
@pytest.mark.parametrize("name", MOE)
def test_shared_prefixes_split_where_the_routes_differ(
    moe_dirs: dict[str, Path], name: str, decoder: str
) -> None:
    """A group of four answers to one 20-token prompt: two with the same prompt routes, one with other
    routes over the prompt, one with none; they share the prompt only with equal routes."""
    model = eager(moe_dirs[name])
    rng = np.random.default_rng(2)
    prompt = rng.integers(3, models.VOCAB, 20)
    tokens = [np.concatenate([prompt, rng.integers(3, models.VOCAB, n)]) for n in (7, 12, 9, 5)]
    same = random_routes(rng, model, 20)
    other = random_routes(rng, model, 20)
    answers = [random_routes(rng, model, n) for n in (7, 12, 9)]

    def joined(prompt_routes: GivenRoutes, answer: GivenRoutes) -> GivenRoutes:
        return GivenRoutes(0, np.concatenate([prompt_routes.experts, answer.experts]))

    jobs = [
        job(tokens[0], joined(same, answers[0])),
        job(tokens[1], joined(same, answers[1])),
        job(tokens[2], joined(other, answers[2])),
        job(tokens[3]),
    ]
    forest = share([j.tokens for j in jobs], 4, [j.routes for j in jobs])
    nodes = [forest.nodes[p[0]] for p in forest.paths]
    assert forest.paths[0][0] == forest.paths[1][0]  # the first two share the prompt
    assert nodes[0].end == 20
    assert len({p[0] for p in forest.paths}) == 3  # the third and fourth compute it apart
    assert forest.computed_tokens == sum(j.num_tokens for j in jobs) - 20
    check(model, jobs, engine(moe_dirs[name], decoder).launch(jobs, forest=forest).result())
    # a forest built without the routes is refused, not scored wrong
    with pytest.raises(ValueError, match="routes differ"):
        engine(moe_dirs[name], decoder).launch(jobs, forest=share([j.tokens for j in jobs], 4))


@pytest.mark.parametrize("decoder", DECODERS)
@pytest.mark.parametrize("name", MOE)
def test_chunked_sequences_replay_and_record_per_chunk(
    moe_dirs: dict[str, Path], name: str, decoder: str
) -> None:
    """A 300-token sequence in chunks of 128 beside whole rows: routes from position 50 to 270 cross
    every chunk boundary; the chunks' scores, routes and agreements join to the sequence's."""
    model = eager(moe_dirs[name])
    rng = np.random.default_rng(3)
    long = job(rng.integers(3, models.VOCAB, 300), random_routes(rng, model, 220, start=50))
    others = ragged(rng, model)[:2]
    scorer = engine(moe_dirs[name], decoder)
    parts = []
    for start in range(0, 300, 128):
        chunk = Chunk(long, sequence=7, start=start, end=min(start + 128, 300))
        scored = scorer.launch(others if start == 0 else [], chunk).result()
        if start == 0:
            check(model, others, scored[:2])
        parts.append(scored[-1])
    whole = SequenceScores.join(parts)
    check(model, [long], [whole])
    assert whole.route_agreement is not None
    assert whole.route_agreement.compared == 220 * long.routes.experts.shape[1]  # type: ignore[union-attr]


@pytest.mark.parametrize("decoder", DECODERS)
def test_the_reference_model_and_the_critic_route_live(
    moe_dirs: dict[str, Path], extras: dict[str, Path], decoder: str
) -> None:
    """Replay is the policy's: a MoE reference model's log-probs are its own forward's, the critic's
    values its own, whatever routes the sequence gives."""
    path = moe_dirs["qwen3_moe"]
    scorer = engine(path, decoder, ref_model=extras["reference"], critic=extras["critic"])
    model, ref = eager(path), eager(extras["reference"])
    rng = np.random.default_rng(4)
    jobs = [job(j.tokens, j.routes, return_ref=True, return_values=True) for j in ragged(rng, model)]
    got = scorer.score(jobs)
    check(model, jobs, got)
    for j, scores in zip(jobs, got, strict=True):
        own = reference(ref, job(j.tokens))[0]
        assert scores.ref_logprobs is not None
        np.testing.assert_allclose(scores.ref_logprobs, own, atol=TOL)
        values = critics.expected_values(extras["critic"], j.tokens.tolist())
        assert scores.values is not None
        np.testing.assert_allclose(scores.values, np.asarray(values)[j.actions - 1], atol=TOL)


@pytest.mark.parametrize("decoder", DECODERS)
@pytest.mark.parametrize("name", MOE)
def test_live_routes_given_back_reproduce_the_scores(
    moe_dirs: dict[str, Path], name: str, decoder: str
) -> None:
    """R2 round trip: the routes recorded without replay, given back, give the same scores (1e-5)
    with agreement 1; random routes move them."""
    rng = np.random.default_rng(5)
    scorer = engine(moe_dirs[name], decoder)
    tokens = [rng.integers(3, models.VOCAB, n) for n in (33, 12, 50)]
    plain = scorer.score([job(t, return_routes=False) for t in tokens])
    recorded = scorer.score([job(t) for t in tokens])
    given = [GivenRoutes(0, np.asarray(r.routes, dtype=np.int64)) for r in recorded]
    replayed = scorer.score([job(t, g) for t, g in zip(tokens, given, strict=True)])
    for p, r, again in zip(plain, recorded, replayed, strict=True):
        assert p.routes is None
        assert p.route_agreement is None
        np.testing.assert_allclose(r.logprobs, p.logprobs, atol=1e-5)
        np.testing.assert_allclose(again.logprobs, p.logprobs, atol=1e-5)
        assert again.route_agreement is not None
        n = again.route_agreement.compared
        assert again.route_agreement == RouteAgreement(compared=n, exact=n, overlap=float(n))
        np.testing.assert_array_equal(again.routes, r.routes)
    model = eager(moe_dirs[name])
    moved = scorer.score([job(t, random_routes(rng, model, t.shape[0])) for t in tokens])
    for p, m in zip(plain, moved, strict=True):
        assert float(np.abs(m.logprobs - p.logprobs).max()) > 1e-2
        assert m.route_agreement is not None
        assert m.route_agreement.exact < m.route_agreement.compared


@pytest.mark.parametrize("decoder", DECODERS)
def test_the_round_trip_is_bitwise_in_batch_invariant_mode(moe_dirs: dict[str, Path], decoder: str) -> None:
    """Recorded alone, replayed among other rows: the same bits."""
    path = moe_dirs["qwen2_moe"]
    scorer = engine(path, decoder, batch_invariant=True)
    rng = np.random.default_rng(6)
    tokens = rng.integers(3, models.VOCAB, 45)
    recorded = scorer.score([job(tokens)])[0]
    assert recorded.routes is not None
    others = ragged(rng, eager(path))
    replayed = scorer.score([*others, job(tokens, GivenRoutes(0, recorded.routes.astype(np.int64)))])[-1]
    np.testing.assert_array_equal(replayed.logprobs, recorded.logprobs)
    assert replayed.route_agreement is not None
    assert replayed.route_agreement.exact == replayed.route_agreement.compared


def test_routes_for_a_dense_policy_are_refused(tmp_path: Path) -> None:
    scorer = PackedScorer.from_config(settings_for(models.save("qwen3", tmp_path / "dense")).engine_config())
    assert scorer.info.moe is None
    tokens = np.arange(3, 13, dtype=np.int64)
    with pytest.raises(ValueError, match="no MoE layers"):
        scorer.score([job(tokens)])


@pytest.mark.parametrize("name", MOE)
def test_engine_info_describes_the_sparse_layers(moe_dirs: dict[str, Path], name: str) -> None:
    model = eager(moe_dirs[name])
    blocks = _sparse_blocks(model)
    shape = engine(moe_dirs[name], "fused").info.moe
    assert shape is not None
    assert (shape.layers, shape.experts, shape.top_k) == (
        len(blocks),
        blocks[0].gate.weight.shape[0],
        blocks[0].gate.top_k,
    )


def test_the_warm_up_leaves_every_routed_graph_for_the_idle_time(
    moe_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CPU twin of a CUDA engine's routed graphs (EagerRecorder, flash-attn 4's one graph per size):
    the warm-up leaves the routed modes unchecked (nothing routed captured before ready); the first
    `tend` checks recording on the warm-up's probe (256 tokens), the second replaying those records,
    and queues the other sizes of a 512-token budget; each later one captures one; routed micro-batches
    then replay them, as the forced reference scores them."""
    recorder = Counting()

    def wrap(forward: Any, *args: Any, **_: Any) -> Any:  # (forward, setting, backend, device, recorder, ...)
        tokens, limit = args[4], args[5]
        if not isinstance(forward, FusedDecoder):
            return forward
        return GraphedDecoder(forward, recorder, tokens, True, limit)

    monkeypatch.setattr(graphs, "wrap", wrap)
    scorer = engine(moe_dirs["qwen3_moe"], "fused", max_batch_tokens=512, prefix_cache=False)
    scorer.warm_up()
    live = recorder.captures  # the live graphs: no routed one before ready, their check waits for idle time
    assert scorer.pending_graphs == 2  # the routed modes' first graphs, checked by the first two tends
    during: list[int] = []  # what another thread reads while a step scores (a benchmark's wait for them)
    score = scorer.score

    def watched(jobs: list[SequenceJob]) -> list[SequenceScores]:
        during.append(scorer.pending_graphs)
        return score(jobs)

    monkeypatch.setattr(scorer, "score", watched)
    assert scorer.tend() == 1  # recording checked on the probe (256 tokens); replaying waits
    assert recorder.captures == live + 1
    assert scorer.tend() == 6  # replaying checked; 512, 384 and 128, recording and replaying, queued
    assert recorder.captures == live + 2
    assert during == [2, 1]  # never 0 while a check runs
    monkeypatch.setattr(scorer, "score", score)
    left = [scorer.tend() for _ in range(6)]
    assert left == [5, 4, 3, 2, 1, 0]
    captured = recorder.captures
    model = eager(moe_dirs["qwen3_moe"])
    rng = np.random.default_rng(3)
    jobs = ragged(rng, model)  # 89 tokens: 128 with its filler, replaying
    check(model, jobs, scorer.score(jobs))
    check(model, [job(j.tokens) for j in jobs], scorer.score([job(j.tokens) for j in jobs]))  # recording
    assert recorder.captures == captured  # both replayed graphs captured while idle
    assert scorer.pending_graphs == 0  # a routed size met before its capture would wait here


@pytest.mark.parametrize("failing_mode", ["record", "replay"])
def test_a_routed_check_that_fails_leaves_the_graphs_to_be_captured_as_met(
    moe_dirs: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    failing_mode: str,
) -> None:
    def wrap(forward: Any, *args: Any, **_: Any) -> Any:
        return GraphedDecoder(forward, EagerRecorder(), args[4], True, args[5])

    monkeypatch.setattr(graphs, "wrap", wrap)
    scorer = engine(moe_dirs["mixtral"], "fused", max_batch_tokens=512, prefix_cache=False)
    score = scorer.score

    def failing(jobs: list[SequenceJob], forest: Any = None) -> list[SequenceScores]:
        routed = {"record": any(j.return_routes for j in jobs), "replay": any(j.routes for j in jobs)}
        if routed[failing_mode]:
            raise RuntimeError("a routed forward failed")
        return score(jobs, forest)

    monkeypatch.setattr(scorer, "score", failing)
    scorer.warm_up()  # the start goes on
    with caplog.at_level("WARNING"):
        if failing_mode == "replay":
            assert scorer.tend() == 1  # recording checked; the replay's check fails next
        assert scorer.tend() == 0  # serving goes on too: nothing queued
    assert "left to be captured as met: a routed forward failed" in caplog.text
    assert scorer.pending_graphs == 0

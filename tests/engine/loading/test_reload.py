"""Hot weight reload in the engine: staged checkpoints give exactly the new model's scores, in both
modes, for the policy, the reference and every critic format; anything that is not the same model
with other values is refused and the served weights stay as they were."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from service.core.jobs import SequenceJob
from service.engine.contract import ReloadOrder, WeightsRejected
from service.engine.loading.staging import Staged
from service.engine.scorer.engine import PackedScorer
from tests.support import critics, models
from tests.support.device import TOLERANCE, eager, settings_for
from tests.support.reference import expected

pytestmark = pytest.mark.parity  # make test-gpu runs it again on cuda in each dtype

LENGTHS = (9, 23, 40)


def _jobs(**flags: Any) -> list[SequenceJob]:
    rng = random.Random(5)
    return [
        SequenceJob(
            tokens=np.asarray([rng.randrange(3, models.VOCAB) for _ in range(n)], dtype=np.int64),
            actions=np.arange(1, n, dtype=np.int64),
            temperature=1.0,
            return_entropy=False,
            **flags,
        )
        for n in LENGTHS
    ]


def _reference(model: Any, jobs: list[SequenceJob]) -> list[list[float]]:
    request = {"input_ids": [job.tokens.tolist() for job in jobs]}  # ragged: window 1..L-1
    return expected(model, request).logprobs


def _close(got: list[np.ndarray], want: list[list[float]]) -> None:
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=TOLERANCE)


@pytest.fixture(scope="module")
def checkpoints(weight_versions: dict[str, Path]) -> dict[str, Path]:
    return weight_versions


@pytest.fixture
def engine(checkpoints: dict[str, Path]) -> PackedScorer:
    return PackedScorer.from_config(settings_for(checkpoints["v10"], weights_version="v10").engine_config())


@pytest.mark.parametrize("mode", ["copy", "swap"])
def test_staged_weights_serve_only_once_applied(
    engine: PackedScorer, checkpoints: dict[str, Path], mode: str
) -> None:
    jobs = _jobs()
    old, new = _reference(eager(checkpoints["v10"]), jobs), _reference(eager(checkpoints["v11"]), jobs)
    _close([s.logprobs for s in engine.score(jobs)], old)

    staged = engine.stage(ReloadOrder("policy", checkpoints["v11"], "v11", mode))  # type: ignore[arg-type]
    assert staged.mode == mode
    served = list(engine.served.policy.model.parameters())
    assert staged.nbytes == sum(p.numel() * p.element_size() for p in served)
    _close([s.logprobs for s in engine.score(jobs)], old)  # staged is not serving
    state = engine.apply(staged)
    _close([s.logprobs for s in engine.score(jobs)], new)
    assert (state.version, state.mode, state.reloads, state.source) == (
        "v11",
        mode,
        1,
        str(checkpoints["v11"]),
    )
    assert engine.weights["policy"] == state

    engine.apply(engine.stage(ReloadOrder("policy", checkpoints["v10"], "v10", mode)))  # type: ignore[arg-type]
    _close([s.logprobs for s in engine.score(jobs)], old)
    assert engine.weights["policy"].reloads == 2


@pytest.mark.parametrize("mode", ["copy", "swap"])
def test_staged_tensors_live_where_the_mode_says(
    engine: PackedScorer, checkpoints: dict[str, Path], mode: str
) -> None:
    """swap stages on the serving device; copy in host memory, pinned when the device is a GPU."""
    staged = engine.stage(ReloadOrder("policy", checkpoints["v11"], "v11", mode))  # type: ignore[arg-type]
    assert isinstance(staged, Staged)
    for slot in staged.slots:
        assert slot.new.shape == slot.served.shape
        assert slot.new.dtype == slot.served.dtype
        if mode == "swap":
            assert slot.new.device == slot.served.device
        else:
            assert slot.new.device.type == "cpu"
            assert slot.new.is_pinned() == (slot.served.device.type == "cuda")


def test_auto_mode_swaps_when_there_is_room(engine: PackedScorer, checkpoints: dict[str, Path]) -> None:
    # a tiny model: a second copy fits beside the working memory on any device
    assert engine.stage(ReloadOrder("policy", checkpoints["v11"], "v11")).mode == "swap"


def test_single_file_and_sharded_checkpoints(
    engine: PackedScorer, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    jobs = _jobs()
    new = _reference(eager(checkpoints["v11"]), jobs)
    sharded = tmp_path / "sharded"
    eager(checkpoints["v11"]).save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    for path in (checkpoints["v11"] / "model.safetensors", sharded):
        engine.apply(engine.stage(ReloadOrder("policy", checkpoints["v10"], "v10")))
        engine.apply(engine.stage(ReloadOrder("policy", path, "v11")))
        _close([s.logprobs for s in engine.score(jobs)], new)


def test_a_half_precision_checkpoint_is_cast_to_the_serving_dtype(
    engine: PackedScorer, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    tensors = load_file(str(checkpoints["v11"] / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, str(tmp_path / "bf16.safetensors"))
    engine.apply(engine.stage(ReloadOrder("policy", tmp_path / "bf16.safetensors", "bf16")))
    served = dict(engine.served.policy.model.named_parameters())
    weight = served["model.layers.0.mlp.up_proj.weight"]
    assert weight.dtype == next(iter(served.values())).dtype
    want = tensors["model.layers.0.mlp.up_proj.weight"].to(torch.bfloat16).to(weight.dtype)
    torch.testing.assert_close(weight.cpu(), want, rtol=0, atol=0)


def _edit(source: Path, target: Path, change: Callable[[dict[str, torch.Tensor]], object]) -> Path:
    """A single-file copy of `source`'s tensors, changed."""
    tensors = load_file(str(source / "model.safetensors"))
    change(tensors)
    target.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(target))
    return target


def _config_edit(source: Path, target: Path, **changes: Any) -> Path:
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config.update(changes)
    (target / "config.json").write_text(json.dumps(config))
    return target


def _nan(tensors: dict[str, torch.Tensor]) -> None:
    tensors["model.norm.weight"][3] = float("nan")


def _wrong_shape(tensors: dict[str, torch.Tensor]) -> None:
    tensors["model.layers.1.mlp.down_proj.weight"] = tensors["model.layers.1.mlp.down_proj.weight"][
        :, :-1
    ].contiguous()


def _untied(tensors: dict[str, torch.Tensor]) -> None:
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"] + 1.0


def _corrupt(source: Path, target: Path) -> Path:
    data = (source / "model.safetensors").read_bytes()
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data[: len(data) // 2])
    return target


BAD: dict[str, tuple[Callable[[Path, Path, Path], Path], str]] = {
    "another architecture": (lambda v, t, other: other, "another model"),
    "another rope_theta": (
        lambda v, t, o: _config_edit(
            v, t / "rope", rope_parameters={"rope_theta": 1234.0, "rope_type": "default"}
        ),
        "rope",
    ),
    "missing tensor": (
        lambda v, t, o: _edit(
            v, t / "m.safetensors", lambda x: x.pop("model.layers.0.input_layernorm.weight")
        ),
        "missing",
    ),
    "unknown tensor": (
        lambda v, t, o: _edit(v, t / "u.safetensors", lambda x: x.update(extra=torch.zeros(2))),
        "does not have",
    ),
    "wrong shape": (lambda v, t, o: _edit(v, t / "s.safetensors", _wrong_shape), "shape"),
    "non-finite value": (lambda v, t, o: _edit(v, t / "n.safetensors", _nan), "non-finite"),
    "untied head": (lambda v, t, o: _edit(v, t / "t.safetensors", _untied), "ties"),
    "truncated file": (lambda v, t, o: _corrupt(v, t / "c.safetensors"), "safetensors"),
    "no such path": (lambda v, t, o: t / "nothing-here", "no such file"),
    "directory without config": (lambda v, t, o: t, "config.json"),
}


@pytest.fixture(scope="module")
def other_architecture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return models.save("llama", tmp_path_factory.mktemp("llama") / "llama")


@pytest.mark.parametrize("case", BAD)
def test_anything_but_the_same_model_is_refused_and_nothing_changes(
    engine: PackedScorer, checkpoints: dict[str, Path], other_architecture: Path, tmp_path: Path, case: str
) -> None:
    jobs = _jobs()
    before = [s.logprobs for s in engine.score(jobs)]
    make, reason = BAD[case]
    path = make(checkpoints["v11"], tmp_path, other_architecture)
    with pytest.raises(WeightsRejected, match=reason):
        engine.stage(ReloadOrder("policy", path, "bad"))
    after = [s.logprobs for s in engine.score(jobs)]
    for b, a in zip(before, after, strict=True):
        np.testing.assert_array_equal(a, b)
    assert engine.weights["policy"].version == "v10"


def test_a_target_the_server_lacks_is_refused(engine: PackedScorer, checkpoints: dict[str, Path]) -> None:
    for target in ("critic", "reference"):
        with pytest.raises(WeightsRejected, match=f"no {target}"):
            engine.stage(ReloadOrder(target, checkpoints["v11"], "x"))


@pytest.fixture(scope="module", params=critics.FORMATS)
def critic_pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp(f"critic-{request.param}")
    return critics.save(request.param, root / "c3", seed=3), critics.save(request.param, root / "c4", seed=4)


@pytest.mark.parametrize("mode", ["copy", "swap"])
def test_critic_reload_serves_the_new_backbone_and_head(
    critic_pair: tuple[Path, Path], checkpoints: dict[str, Path], mode: str
) -> None:
    old, new = critic_pair
    engine = PackedScorer.from_config(settings_for(checkpoints["v10"], critic=old).engine_config())
    jobs = _jobs(return_values=True)
    order = ReloadOrder("critic", new, "c4", mode)  # type: ignore[arg-type]
    engine.apply(engine.stage(order))
    for job, scores in zip(jobs, engine.score(jobs), strict=True):
        assert scores.values is not None
        np.testing.assert_allclose(
            scores.values, critics.expected_values(new, job.tokens.tolist()), atol=TOLERANCE
        )
    assert engine.weights["critic"].version == "c4"
    assert engine.weights["policy"].version == "initial"
    policy = _reference(eager(checkpoints["v10"]), jobs)
    _close([s.logprobs for s in engine.score(jobs)], policy)  # the policy is untouched


def test_critic_reload_refuses_a_policy_checkpoint(
    critic_pair: tuple[Path, Path], checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    engine = PackedScorer.from_config(settings_for(checkpoints["v10"], critic=critic_pair[0]).engine_config())
    with pytest.raises(WeightsRejected, match="value head"):
        engine.stage(ReloadOrder("critic", checkpoints["v11"], "x"))
    with pytest.raises(WeightsRejected, match="directory"):
        engine.stage(ReloadOrder("critic", critic_pair[1] / "model.safetensors", "x"))


def test_reference_reload(checkpoints: dict[str, Path], ref_dir: Path) -> None:
    engine = PackedScorer.from_config(settings_for(checkpoints["v10"], ref_model=ref_dir).engine_config())
    jobs = _jobs(return_ref=True)
    engine.apply(engine.stage(ReloadOrder("reference", checkpoints["v11"], "r1")))
    got = [s.ref_logprobs for s in engine.score(jobs)]
    assert all(g is not None for g in got)
    _close(got, _reference(eager(checkpoints["v11"]), jobs))  # type: ignore[arg-type]
    _close([s.logprobs for s in engine.score(jobs)], _reference(eager(checkpoints["v10"]), jobs))
    assert {t: w.version for t, w in engine.weights.items()} == {"policy": "initial", "reference": "r1"}

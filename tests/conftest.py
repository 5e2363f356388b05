"""Fixtures: tiny checkpoints of every architecture on disk, and the reference models that score them.

What a test needs from the host (a GPU, hopper, quack, liger, two GPUs) is a marker registered by
tests/support/needs.py, loaded here; the helpers the tests import are in tests/support/.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import models, teacher
from tests.support.device import eager

pytest_plugins = ("tests.support.needs",)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {name: models.save(name, root / name) for name in models.EVERY}


@pytest.fixture(scope="session")
def reference_models(model_dirs: dict[str, Path]) -> dict[str, Any]:
    return {name: eager(path) for name, path in model_dirs.items()}


REF_SEED = 7  # the reference policy: the qwen2 architecture, other weights than the policy's


@pytest.fixture(scope="session")
def ref_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return models.save("qwen2", tmp_path_factory.mktemp("ref") / "qwen2-ref", seed=REF_SEED)


@pytest.fixture(scope="session")
def ref_model(ref_dir: Path) -> Any:
    return eager(ref_dir)


VERSION_SEEDS = {"v10": 10, "v11": 11, "v12": 12}  # policy weights a trainer might push, in turn


@pytest.fixture(scope="session")
def weight_versions(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Checkpoints of the same qwen2 model with other weights, by version label."""
    root = tmp_path_factory.mktemp("versions")
    return {
        version: models.save("qwen2", root / version, seed=seed) for version, seed in VERSION_SEEDS.items()
    }


@pytest.fixture(scope="session")
def version_models(weight_versions: dict[str, Path]) -> dict[str, Any]:
    return {version: eager(path) for version, path in weight_versions.items()}


@pytest.fixture(scope="session")
def teacher_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The /v1/completions tests' teacher: a tiny qwen2 with a tokenizer saved beside it."""
    return teacher.save(tmp_path_factory.mktemp("teacher") / "teacher")


@pytest.fixture(scope="session")
def teacher_reference(teacher_dir: Path) -> teacher.Reference:
    return teacher.Reference.of(teacher_dir)


@pytest.fixture(scope="session")
def teacher_server(teacher_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`python -m service serve --model <teacher_dir>` on loopback; its base URL once ready."""
    with teacher.serving(teacher_dir, tmp_path_factory.mktemp("served") / "server.log") as url:
        yield url


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`pytest -n 2` (make pytest): each worker runs a fixed half of the suite (tests/support/workers.py);
    another `--dist` is xdist's own."""
    if config.getvalue("dist") != "load":
        return None
    from tests.support.workers import Halves  # pytest-xdist, there only when -n asks for workers

    return Halves(config, log)

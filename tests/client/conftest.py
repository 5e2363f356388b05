"""Real logprobd servers on loopback (uvicorn in a thread) for the client tests.

Servers are session-scoped: a qwen2 pair (two replicas of one checkpoint, for sharding), a gemma2
one (final-logit soft-capping), a qwen2 one that wants an API key, and qwen2 ones with a critic
(`--critic`, one per critic format asked for) and a reference model (`--ref-model`, another qwen2
of another seed), all on the tiny checkpoints of tests/support/models.py and critics.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import critics, pushing
from tests.support.servers import PpoServer, free_port, serving


@pytest.fixture(scope="session")
def qwen2_replicas(model_dirs: dict[str, Path]) -> Iterator[tuple[str, str]]:
    with serving(model_dirs["qwen2"]) as a, serving(model_dirs["qwen2"]) as b:
        yield a, b


@pytest.fixture(scope="session")
def gemma2_server(model_dirs: dict[str, Path]) -> Iterator[str]:
    with serving(model_dirs["gemma2"]) as url:
        yield url


@pytest.fixture(scope="session")
def servers(qwen2_replicas: tuple[str, str], gemma2_server: str) -> dict[str, str]:
    """Architecture -> the base URL of a server of it."""
    return {"qwen2": qwen2_replicas[0], "gemma2": gemma2_server}


@pytest.fixture(scope="session")
def keyed_server(model_dirs: dict[str, Path]) -> Iterator[str]:
    """A qwen2 server that wants `Authorization: Bearer sk-client-test` on its scoring route."""
    with serving(model_dirs["qwen2"], api_keys="sk-client-test") as url:
        yield url


@pytest.fixture(scope="session")
def ppo_server(
    request: pytest.FixtureRequest,
    model_dirs: dict[str, Path],
    ref_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[PpoServer]:
    """`--critic` of the format `with_critics` names (default: OpenRLHF's) and `--ref-model`."""
    fmt: str = getattr(request, "param", "openrlhf")
    critic_dir = critics.save(fmt, tmp_path_factory.mktemp("critic") / fmt)
    with serving(model_dirs["qwen2"], critic=critic_dir, ref_model=ref_dir) as url:
        yield PpoServer(url=url, critic_format=fmt, critic_dir=critic_dir)


@pytest.fixture
def dead_url() -> str:
    """A loopback URL where nothing listens: every connection is refused."""
    return f"http://127.0.0.1:{free_port()}"


@pytest.fixture(scope="session")
def push_replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[pushing.Replicas]:
    """Two replica processes that take pushed weights (tests/support/pushing.py)."""
    with pushing.replicas(tmp_path_factory.mktemp("push")) as started:
        yield started

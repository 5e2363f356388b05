"""The client installed alone, as a trainer installs it: `pip install logprobd` into a fresh venv,
with its declared dependencies from the package index, and no C compiler.

That environment has no server stack (no torch, transformers, fastapi, pydantic, ...), `pip check`
finds nothing broken, `python -m service serve` says in one line to install `logprobd[server]`, and
its client scores against a real server (the demo model, started from this environment) exactly as
this environment's client does: JSON and frames, top-K blocks, and the OpenRLHF adapter once a
trainer's torch is beside it (this environment's torch and what torch requires, nothing else).

Self-contained on purpose: it starts its own server and needs nothing of the other tests' helpers.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.support import ROOT
from tests.support.servers import free_port, server_process

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

pytestmark = pytest.mark.slow  # a venv and a pip install: 15-30 s

# Run in both environments with `-c`: here from the repository (cwd), there from the venv's
# site-packages (`-I`: no cwd, no PYTHONPATH). argv: the server's URL, then a directory holding a
# trainer's torch or "" for none. Prints what the client got, as JSON.
PROBE = """
import json, sys
if sys.argv[2]:
    sys.path.insert(0, sys.argv[2])
import service
from service.client import Client

def plain(x):
    if hasattr(x, "tolist"):
        return x.tolist()
    return [plain(v) for v in x] if isinstance(x, (list, tuple)) else x

url = sys.argv[1]
rows = [[5, 17, 300, 42, 9, 1000], [5, 17, 300, 7], [88, 3, 512, 640, 2]]
out = {"service": service.__file__}
for frames in (True, False):
    with Client(url, frames=frames) as client:
        s = client.score(rows, num_actions=[3, 1, 2], return_entropy=True, top_logprobs=2)
    out["frames" if frames else "json"] = {
        "logprobs": plain(s.logprobs), "entropy": plain(s.entropy), "action_mask": plain(s.action_mask),
        "top_ids": plain(s.top_ids), "top_logprobs": plain(s.top_logprobs),
    }
if sys.argv[2]:
    import torch
    from service.client.adapters import openrlhf_log_probs

    sequences = torch.tensor([[0, 0, 5, 17, 300, 42], [5, 17, 300, 7, 9, 11]])
    attention_mask = (torch.arange(6) >= torch.tensor([[2], [0]])).long()
    action_mask = torch.tensor([[0, 0, 0, 1, 1], [0, 0, 1, 1, 1]], dtype=torch.bool)
    with Client(url) as client:
        t = openrlhf_log_probs(client, sequences, attention_mask, action_mask, return_entropy=True,
                               tempered_entropy=True)
        plain_rows = client.score([[5, 17, 300, 42], [5, 17, 300, 7, 9, 11]], num_actions=[2, 3])
    out["openrlhf"] = {"log_probs": t.log_probs.tolist(), "entropy": t.entropy.tolist(),
                       "dtype": str(t.log_probs.dtype), "rows": plain(plain_rows.logprobs)}
out["modules"] = sorted({m.partition(".")[0] for m in sys.modules})
print(json.dumps(out))
"""


def server_distributions() -> set[str]:
    """What the `server` extra adds: none of it may be in the client's environment."""
    return {
        canonicalize_name(Requirement(line).name) for line in PYPROJECT["optional-dependencies"]["server"]
    }


def run(
    command: list[str], *, cwd: Path, timeout: float = 600, **env: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command,
        cwd=cwd,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`python -m service serve` from this environment, the demo model, on a free loopback port."""
    port = free_port()
    with server_process(
        [sys.executable, "-m", "service", "serve", "--host", "127.0.0.1", "--port", str(port)],
        port,
        env={**os.environ, "LOGPROBD_DRAIN_SECONDS": "0"},
        log=tmp_path_factory.mktemp("server") / "server.log",
        timeout=180,
        what="the demo server",
    ) as url:
        yield url


@pytest.fixture(scope="module")
def client_env(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with `pip install <the project>` in it (its declared dependencies from the index),
    built with no C compiler (CC=false): the native JSON reader is skipped, the install goes on. The
    project is a copy of the files a source distribution holds, so nothing is built in the checkout."""
    root = tmp_path_factory.mktemp("client-alone")
    source = root / "logprobd"
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    shutil.copytree(
        ROOT / "service", source / "service", ignore=shutil.ignore_patterns("__pycache__", "*.so")
    )
    venv = root / "venv"
    made = run([sys.executable, "-m", "venv", str(venv)], cwd=root)
    assert made.returncode == 0, made.stderr
    installed = run([str(venv / "bin" / "python"), "-m", "pip", "install", str(source)], cwd=root, CC="false")
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]
    return venv


def python(venv: Path) -> str:
    return str(venv / "bin" / "python")


def test_the_client_installs_alone_with_nothing_of_the_server(client_env: Path, tmp_path: Path) -> None:
    checked = run([python(client_env), "-m", "pip", "check"], cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    names_script = (
        "import importlib.metadata as m; print('\\n'.join(d.metadata['Name'] for d in m.distributions()))"
    )
    listed = run([python(client_env), "-I", "-c", names_script], cwd=tmp_path)
    names = {canonicalize_name(name) for name in listed.stdout.split()}
    assert "logprobd" in names
    assert {"httpx", "h11", "numpy"} <= names
    assert not names & server_distributions(), sorted(names)
    assert len(names) <= 12, sorted(names)  # the client's dependencies with theirs, pip and setuptools
    site = next((client_env / "lib").glob("python3*/site-packages"))
    assert not list((site / "service" / "wire").glob("_jsonrows*.so")), "built without a compiler?"
    no_torch = run([python(client_env), "-I", "-c", "import torch"], cwd=tmp_path)
    assert no_torch.returncode == 1
    assert "No module named 'torch'" in no_torch.stderr


def test_serve_without_the_server_says_what_to_install(client_env: Path, tmp_path: Path) -> None:
    for args in (["serve", "--port", "0"], ["openapi"], ["--help"]):
        done = run([python(client_env), "-I", "-m", "service", *args], cwd=tmp_path, timeout=60)
        assert done.returncode == 2, done.stderr
        assert done.stdout == ""
        (line,) = done.stderr.splitlines()
        assert line.startswith("python -m service: the server is not installed here (No module named")
        assert "pip install 'logprobd[server]'" in line


def trainer_torch(target: Path) -> Path:
    """torch as a trainer's environment has it: links to this environment's torch and to the
    distributions it requires (recursively, markers evaluated), nothing else."""
    target.mkdir()
    wanted, seen = ["torch"], set()
    while wanted:
        name = canonicalize_name(wanted.pop())
        if name in seen:
            continue
        seen.add(name)
        dist = importlib.metadata.distribution(name)
        wanted += [
            r.name
            for r in map(Requirement, dist.requires or [])
            if r.marker is None or r.marker.evaluate({"extra": ""})
        ]
        for top in {f.parts[0] for f in dist.files or [] if f.parts[0] not in ("..", "__pycache__")}:
            if not (target / top).exists():
                (target / top).symlink_to(Path(str(dist.locate_file(top))))
    assert not seen & server_distributions() - {"torch"}, seen
    return target


def probe(command: list[str], url: str, cwd: Path, torch_dir: Path) -> dict[str, Any]:
    done = run([*command, "-c", PROBE, url, str(torch_dir)], cwd=cwd, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    found: dict[str, Any] = json.loads(done.stdout)
    return found


def test_the_client_alone_scores_as_this_environments_client(
    client_env: Path, demo_server: str, tmp_path: Path
) -> None:
    torch_dir = trainer_torch(tmp_path / "trainer")
    alone = probe([python(client_env), "-I"], demo_server, tmp_path, torch_dir)
    here = probe([sys.executable], demo_server, ROOT, torch_dir)
    assert Path(alone["service"]).is_relative_to(client_env)
    assert Path(here["service"]).is_relative_to(ROOT / "service")
    server_modules = {"fastapi", "starlette", "uvicorn", "pydantic", "pydantic_settings", "prometheus_client",
                      "orjson", "transformers", "safetensors", "yaml"}  # fmt: skip
    assert not set(alone["modules"]) & server_modules
    for form in ("frames", "json", "openrlhf"):
        assert alone[form] == here[form], form
    scores = alone["frames"]
    assert [len(row) for row in scores["logprobs"]] == [3, 1, 2]
    assert all(-12.0 < lp < -3.0 for row in scores["logprobs"] for lp in row)  # demo: near -ln 1024
    assert [[len(k) for k in row] for row in scores["top_ids"]] == [[2] * 3, [2], [2] * 2]
    adapter = alone["openrlhf"]
    assert adapter["dtype"] == "torch.float32"
    # OpenRLHF's [B, A] layout: row 0 (left-padded by 2) acts at columns 4-5, row 1 at 3-5; the rest is
    # 0.0, and the actions score as the plain client scores the unpadded sequences
    first, second = adapter["rows"]
    assert adapter["log_probs"][0] == pytest.approx([0.0, 0.0, 0.0, *first], abs=1e-5)
    assert adapter["log_probs"][1] == pytest.approx([0.0, 0.0, *second], abs=1e-5)
    assert adapter["log_probs"][0][:3] == [0.0, 0.0, 0.0]

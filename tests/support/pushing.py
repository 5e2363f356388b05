"""Replicas a trainer pushes weights to, for the client's push tests: real `python -m service serve`
processes on loopback (a push group joins torch's process-group registry of the server's process,
which the test process, rank 0, must not share), started together, with an admin key.

- "main": a Qwen3-MoE policy (per-expert checkpoint names, transformers 5's fused experts in memory),
  a tied Qwen2 reference (`--ref-model`) and an OpenRLHF critic (`--critic`);
- "second": the same policy alone (a fleet of two, ranks 1 and 2 of 3).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.support import ROOT, critics, models
from tests.support.servers import free_port, stop, wait_served

ADMIN = "push-admin-key"
PUSH_TIMEOUT_S = 15  # the replicas' --weight-push-timeout-s
BODY: dict[str, Any] = {
    "input_ids": [[5, 6, 7, 8, 9, 40, 41], [10, 11, 12, 13]],
    "num_actions": [5, 2],
    "return_entropy": True,
}


@dataclass(frozen=True)
class Replicas:
    main: str
    second: str
    checkpoints: dict[str, Path]


def checkpoints(root: Path) -> dict[str, Path]:
    return {
        "policy": models.save("qwen3_moe", root / "policy", seed=0),
        "reference": models.save("qwen2", root / "reference", seed=7),
        "critic": critics.save("openrlhf", root / "critic", seed=3),
    }


def command(port: int, policy: Path, *extra: str, device: str = "cpu") -> list[str]:
    return [
        sys.executable, "-m", "service", "serve", "--port", str(port), "--device", device,
        "--model", str(policy), "--batch-wait-ms", "0", "--drain-seconds", "0",
        "--weight-push-timeout-s", str(PUSH_TIMEOUT_S), "--weights-version", "start", *extra,
    ]  # fmt: skip


@contextmanager
def started(root: Path, commands: dict[int, list[str]], **env: str) -> Iterator[list[str]]:
    """A server process per port, started at once, with the admin key (and `env`); their URLs once
    all are ready; stopped on the way out."""
    environment = {**os.environ, "LOGPROBD_ADMIN_API_KEYS": ADMIN, **env}
    with ExitStack() as stack:
        processes = []
        for port, argv in commands.items():
            log = root / f"replica-{port}.log"
            sink = stack.enter_context(log.open("wb"))
            process = subprocess.Popen(argv, cwd=ROOT, env=environment, stdout=sink, stderr=subprocess.STDOUT)
            stack.callback(stop, process)
            processes.append((f"http://127.0.0.1:{port}", process, log))
        for url, process, log in processes:
            wait_served(url, process, log, timeout=300, what="a replica")
        yield [url for url, _, _ in processes]


@contextmanager
def replicas(root: Path) -> Iterator[Replicas]:
    """Both replicas, started at once; stopped on the way out."""
    made = checkpoints(root / "checkpoints")
    main, second = free_port(), free_port()
    commands = {
        main: command(
            main, made["policy"], "--ref-model", str(made["reference"]), "--critic", str(made["critic"]),
            "--ref-weights-version", "start", "--critic-weights-version", "start",
        ),
        second: command(second, made["policy"]),
    }  # fmt: skip
    with started(root, commands) as urls:
        yield Replicas(urls[0], urls[1], made)


def score(url: str, **extra: Any) -> httpx.Response:
    return httpx.post(f"{url}/logprobs", json={**BODY, **extra}, timeout=60)


def version(url: str, target: str = "policy") -> str:
    info = httpx.get(f"{url}/info", timeout=30).json()
    return str(info["weights"][target]["version"])

"""The image built from the Dockerfile serves: the demo model runs inside the built image (buildah, no
Docker daemon) and a request sent from outside, on loopback, gets the scores this checkout's own
service computes in-process for it.

The image is docker/ci-image.sh's (the production Dockerfile with a Debian base, the CPU torch and no
GPU extras), named by LOGPROBD_IMAGE. Without it the test skips, naming the script; .ci/run builds it
and sets LOGPROBD_REQUIRE_IMAGE=1, which turns the skip into a failure.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.settings import Settings
from tests.support import ROOT
from tests.support.needs import skip_or_fail
from tests.support.servers import free_port, running, wait_served

REQUEST = {
    "input_ids": [[1, 2, 3, 4, 5, 6, 7], [1, 2, 6], [9, 8]],
    "num_actions": [3, 1, 1],
    "return_entropy": True,
}


def constraints() -> dict[str, str]:
    lines = (ROOT / "docker" / "constraints.txt").read_text().splitlines()
    pins = [line.split("==") for line in lines if line and not line.startswith("#")]
    return dict(pins)


def image() -> str:
    name = os.environ.get("LOGPROBD_IMAGE", "")
    problem = None
    if not name:
        problem = "LOGPROBD_IMAGE is not set (bash docker/ci-image.sh builds localhost/logprobd:ci)"
    elif shutil.which("buildah") is None:
        problem = "buildah is not installed (apt-get install buildah)"
    elif subprocess.run(
        ["buildah", "inspect", "--type", "image", name], capture_output=True, check=False
    ).returncode:
        problem = f"no image {name} (bash docker/ci-image.sh)"
    if problem is not None:
        skip_or_fail(problem, "LOGPROBD_REQUIRE_IMAGE")
    return name


@contextmanager
def served(name: str, log: Path) -> Iterator[str]:
    """`python -m service serve` (the image's command, on loopback) in a container of `name`; yields
    its URL once ready. chroot isolation shares the host's network, so the port is the host's."""
    container = subprocess.run(
        ["buildah", "from", "--quiet", name], capture_output=True, text=True, check=True
    ).stdout.strip()
    port = free_port()
    command = ["python", "-m", "service", "serve", "--host", "127.0.0.1", "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    with log.open("wb") as sink:
        process = subprocess.Popen(
            ["buildah", "run", "--isolation", "chroot", "--env", "LOGPROBD_DRAIN_SECONDS=0", container,
             "--", *command],
            stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        wait_served(url, process, log, 300, "the image's server")
        yield url
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        subprocess.run(["buildah", "rm", container], capture_output=True, check=False)


def close(got: Any, want: Any, tolerance: float = 1e-5) -> None:
    assert len(got) == len(want)
    for g_row, w_row in zip(got, want, strict=True):
        assert len(g_row) == len(w_row)
        for g, w in zip(g_row, w_row, strict=True):
            assert abs(g - w) <= tolerance, (got, want)


@pytest.mark.slow
def test_the_built_image_serves_the_demo_and_scores_a_request_from_outside(tmp_path: Path) -> None:
    name = image()
    with served(name, tmp_path / "server.log") as url:
        info = httpx.get(f"{url}/info").json()
        got = httpx.post(f"{url}/logprobs", json=REQUEST, timeout=60)
        metrics = httpx.get(f"{url}/metrics").text
    assert got.status_code == 200, got.text
    assert info["demo"] is True
    assert info["device"] == "cpu"
    # the build arguments' stack: the CPU torch and docker/constraints.txt's transformers
    assert info["versions"]["torch"] == "2.13.0+cpu"
    assert info["versions"]["transformers"] == constraints()["transformers"]
    assert 'logprobd_requests_total{outcome="ok"} 1.0' in metrics
    with running(Settings()) as client:  # the same request, this checkout's service, in-process
        want = client.post("/logprobs", json=REQUEST)
    assert want.status_code == 200, want.text
    body, reference = got.json(), want.json()
    assert body["model"] == reference["model"] == "logprobd-demo-qwen2"
    assert [len(row) for row in body["logprobs"]] == [3, 1, 1]
    close(body["logprobs"], reference["logprobs"])
    close(body["entropy"], reference["entropy"])
    assert body["usage"] == reference["usage"]

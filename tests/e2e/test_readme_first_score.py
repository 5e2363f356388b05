"""A newcomer's path through README.md, followed literally against a real `python -m service serve`
(the demo model, as `make serve` starts it) from the moment it is started: the README's wait for
the ready line, then its curl, which prints exactly what the README shows (no 503 `not_ready` on
the way); the server's ready line is the one the README shows. docs/api.md's /v1/completions
examples print what they show too (but the `id` and `created` every answer has afresh)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import ROOT
from tests.support.docs import blocks, console_commands
from tests.support.servers import free_port

README = (ROOT / "README.md").read_text()


@pytest.fixture(scope="module")
def starting(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    """The demo server just started, not yet ready: its port and its log."""
    port = free_port()
    log = tmp_path_factory.mktemp("walk") / "server.log"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("LOGPROBD_")}, "PYTHONUNBUFFERED": "1"}
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "service", "serve", "--port", str(port)],
            cwd=ROOT,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    try:
        yield port, log
    finally:
        process.terminate()
        process.wait(timeout=30)


def on(port: int, text: str) -> str:
    """`text` with the default address (the README's and docs' examples) made the test server's."""
    return text.replace("localhost:8000", f"127.0.0.1:{port}").replace("127.0.0.1:8000", f"127.0.0.1:{port}")


def run(command: str) -> str:
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=300, check=True)
    return done.stdout


def test_the_readme_path_reaches_a_score_with_no_503(starting: tuple[int, Path]) -> None:
    port, log = starting
    (wait,) = [block for block in blocks(README, "bash") if "/health/ready" in block]
    run(on(port, wait))  # at once: the server has only just been started
    section = README.split("## Try it", 1)[1].split("\n## ", 1)[0]
    ((command, shown),) = console_commands(blocks(section, "console")[0])
    assert run(on(port, command)) == shown
    (ready,) = [line for line in log.read_text().splitlines() if ": ready: " in line]
    (text,) = [block for block in blocks(README, "text") if ": ready: " in block]
    assert re.sub(r"^\S+ \S+ ", "... ", ready) == on(port, text.strip())
    assert '"POST /logprobs HTTP/1.1" 503' not in log.read_text()


def without_fresh_fields(text: str) -> Any:
    answer = json.loads(text)
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", answer.pop("id"))
    assert isinstance(answer.pop("created"), int)
    return answer


def test_the_completions_examples_print_what_they_show(starting: tuple[int, Path]) -> None:
    port, _ = starting
    run(on(port, "until curl -sf localhost:8000/health/ready > /dev/null; do sleep 1; done"))
    page = (ROOT / "docs" / "api.md").read_text()
    found = [
        pair
        for block in blocks(page, "console")
        for pair in console_commands(block)
        if pair[0].startswith("curl -s localhost:8000/v1/completions")
    ]
    assert len(found) >= 2
    for command, shown in found:
        assert without_fresh_fields(run(on(port, command))) == without_fresh_fields(shown), command

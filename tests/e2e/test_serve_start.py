"""`python -m service serve` as a newcomer meets it, a real process on loopback: a missing model or a
taken port ends the start at once in one line (exit 2, nothing loaded); the log is one format from
the first line to the last; the port is served from the start (503 `not_ready` while the model
loads, never a refused connection) and the ready line names the URL to send requests to; Ctrl-C on
an idle server exits promptly, idle keep-alive connections or not."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from service.http.listen import Refused, check_model_directories, listen
from service.settings import Settings
from tests.support import ROOT

LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) [\w.]+: .+$")


def serve(*argv: str, env: dict[str, str] | None = None, timeout: float = 60) -> tuple[int, str, float]:
    """Run serve to its end: exit status, stderr, seconds."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LOGPROBD_")}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "service", "serve", *argv],
        cwd=ROOT,
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.stdout == ""
    return done.returncode, done.stderr, time.monotonic() - started


@pytest.mark.parametrize(
    ("argv", "env", "line"),
    [
        (
            ["--model", "/nonexistent"],
            {},
            "argument --model: /nonexistent does not exist (a local model directory: nothing is downloaded)",
        ),
        (
            [],
            {"LOGPROBD_REF_MODEL": "/nonexistent/ref"},
            "LOGPROBD_REF_MODEL: /nonexistent/ref does not exist (a local model directory: nothing is "
            "downloaded)",
        ),
    ],
)
def test_a_missing_model_is_one_line_before_anything_loads(
    argv: list[str], env: dict[str, str], line: str
) -> None:
    status, stderr, _ = serve(*argv, "--port", "0", env=env)
    assert status == 2
    assert stderr == f"python -m service serve: error: {line}\n"


def test_a_directory_without_config_json_is_named(tmp_path: Path) -> None:
    status, stderr, _ = serve("--critic", str(tmp_path), "--port", "0")
    assert status == 2
    assert stderr == (
        f"python -m service serve: error: argument --critic: {tmp_path} is not a model directory: "
        "no config.json in it\n"
    )


def test_a_taken_port_is_one_line_before_the_model_loads() -> None:
    """Not after loading the demo model (16 s on 2 cores), as when uvicorn found out on binding."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        status, stderr, _ = serve("--port", str(port))
        assert status == 2
        assert stderr == (
            f"python -m service serve: error: argument --port: cannot listen on 127.0.0.1:{port}: address "
            "already in use (another server is there; choose a free port)\n"
        )
        status, stderr, _ = serve(env={"LOGPROBD_PORT": str(port)})
        assert status == 2
        assert stderr.startswith("python -m service serve: error: LOGPROBD_PORT: cannot listen on")


def test_the_checks_name_the_setting_they_refuse(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    check_model_directories(Settings(model=tmp_path, ref_model=tmp_path, critic=tmp_path))
    with pytest.raises(Refused) as refused:
        check_model_directories(Settings(model=tmp_path, ref_model=tmp_path / "config.json"))
    assert (refused.value.setting, refused.value.reason) == (
        "ref_model",
        f"{tmp_path / 'config.json'} is not a directory (a model directory holds config.json)",
    )
    first = listen("127.0.0.1", 0)
    try:
        port = first.socket.getsockname()[1]
        assert first.url == f"http://127.0.0.1:{port}"
        with pytest.raises(Refused) as refused:
            listen("127.0.0.1", port)
        assert refused.value.setting == "port"
    finally:
        first.socket.close()


@dataclass
class Run:
    """A serve process and its stderr, read line by line as it comes."""

    process: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)
    listening: threading.Event = field(default_factory=threading.Event)
    ready: threading.Event = field(default_factory=threading.Event)

    def read(self) -> None:
        for line in self.process.stderr or ():
            self.lines.append(line.rstrip("\n"))
            if " listening on " in line:
                self.listening.set()
            if ": ready: " in line:
                self.ready.set()

    def url(self) -> str:
        assert self.listening.wait(60), "\n".join(self.lines)
        found = re.search(r"listening on (http://\S+)", next(x for x in self.lines if " listening on " in x))
        assert found is not None
        return found.group(1)


@contextmanager
def demo() -> Iterator[Run]:
    """`python -m service serve --port 0`: the demo model, as `make serve` starts it."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LOGPROBD_")}
    command = [sys.executable, "-m", "service", "serve", "--port", "0"]
    env = {**clean, "PYTHONUNBUFFERED": "1"}
    with subprocess.Popen(command, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True) as process:
        run = Run(process)
        reader = threading.Thread(target=run.read, daemon=True)
        reader.start()
        try:
            yield run
        finally:
            if process.poll() is None:
                process.kill()
            process.wait()
            reader.join(timeout=10)


def test_from_first_line_to_last_one_format_a_served_port_and_a_prompt_exit() -> None:
    """`listening on` comes first and the port answers 503 not_ready (not a refused connection)
    until the ready line, which names the URL; Ctrl-C with an idle keep-alive connection open exits
    0 within 2.5 s (5.9 s before, with a KeyboardInterrupt traceback: the interpreter's last
    collection walked torch's and transformers' objects)."""
    with demo() as run:
        base = run.url()
        statuses = set()
        with httpx.Client(base_url=base, timeout=30) as client:  # one keep-alive connection throughout
            while not run.ready.is_set():
                answer = client.get("/health/ready")
                statuses.add(answer.status_code)
                if answer.status_code == 503:
                    assert answer.json()["status"] == "loading"
                    early = client.post("/logprobs", json={"input_ids": [[1, 2]], "num_actions": 1})
                    assert early.json()["error"]["type"] == "not_ready"
                assert run.process.poll() is None, "\n".join(run.lines)
                time.sleep(0.2)
            assert client.get("/health/ready").status_code == 200
            assert 503 in statuses  # the port was served while the model loaded
            (line,) = [x for x in run.lines if ": ready: " in x]
            assert line.endswith(f"; send requests to {base} (POST /logprobs, docs/api.md)")
            scored = client.post("/logprobs", json={"input_ids": [[1, 2, 3]], "num_actions": 1})
            assert scored.status_code == 200
            started = time.monotonic()
            run.process.send_signal(signal.SIGINT)
            assert run.process.wait(timeout=30) == 0
            took = time.monotonic() - started
    assert took < 2.5, f"Ctrl-C took {took:.1f} s"
    assert run.lines[-1].endswith(f"Finished server process [{run.process.pid}]")
    assert [line for line in run.lines if not LINE.match(line)] == []
    assert any('"GET /health/ready HTTP/1.1" 503' in line for line in run.lines)  # uvicorn's access lines
    assert not any("Uvicorn running on" in line for line in run.lines)

"""Every example of README.md runs, so it cannot drift: `make serve` and `make test` are what they
say, the curl against a real `python -m service serve` (the demo model, as `make serve` starts it)
prints exactly what the README shows (every digit, as a newcomer sees it), each framework's snippet
returns what that framework computes in-process, and the benchmark table is the H200 rows of
BENCHMARKS.md's standard workload (the files benchmarks/page/current.toml names). The demo-model
curl examples of docs/api.md run the same way."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support import ROOT, frameworks
from tests.support.docs import blocks, console_commands
from tests.support.frameworks import check, make_batch
from tests.support.servers import free_port, server_process

README = (ROOT / "README.md").read_text()


def demo_curl_blocks(text: str) -> list[list[tuple[str, str]]]:
    """Console blocks whose every command is a curl to the demo server's /logprobs."""
    found = [console_commands(b) for b in blocks(text, "console")]
    return [
        pairs for pairs in found if all(c.startswith("curl -s localhost:8000/logprobs") for c, _ in pairs)
    ]


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`python -m service serve`, the command `make serve` runs, with no model: the demo model."""
    port = free_port()
    log = tmp_path_factory.mktemp("demo") / "server.log"
    env = {**os.environ, "LOGPROBD_DRAIN_SECONDS": "0"}
    command = [sys.executable, "-m", "service", "serve", "--port", str(port)]
    with server_process(command, port, env=env, log=log, timeout=120, what="the demo server") as url:
        yield url


def test_the_two_commands_are_what_the_readme_says(tmp_path: Path) -> None:
    assert "make serve   #" in README
    assert "make test    #" in README
    venv = tmp_path / "venv"
    stamp = f"{venv}/.installed-x"  # -o: taken as up to date, so make prints the recipes only
    dry = ["make", "-n", "-o", stamp, f"VENV={venv}", "TRANSFORMERS=x"]
    serve = subprocess.run([*dry, "serve"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert f"{venv}/bin/python -m service serve" in serve
    gates = subprocess.run([*dry, "test"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for gate in (
        "-m ruff check",
        "-m ruff format --check",
        "-m mypy",
        "-m mkdocs build --strict",
        "-m pytest",
    ):
        assert gate in gates, gate


@pytest.mark.parametrize("page", ["README.md", "docs/api.md"])
def test_curl_examples_print_what_they_show(demo_server: str, page: str) -> None:
    found = demo_curl_blocks((ROOT / page).read_text())
    assert len(found) >= {"README.md": 1, "docs/api.md": 2}[page]
    port = demo_server.rsplit(":", 1)[1]
    for pairs in found:
        for command, shown in pairs:
            ran = subprocess.run(
                ["bash", "-c", command.replace("localhost:8000", f"127.0.0.1:{port}")],
                capture_output=True,
                text=True,
                check=True,
                timeout=60,
            )
            assert ran.stdout == shown, f"{page} shows\n{shown}\nthe demo server prints\n{ran.stdout}"


def demo_model() -> Any:
    """The demo model as the frameworks would run it: same seed and config, eager, float32."""
    from transformers import AutoModelForCausalLM

    from service.engine.loading.pretrained import DEMO_SEED, demo_config

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(DEMO_SEED)
        built: Any = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            demo_config(), attn_implementation="eager", dtype=torch.float32
        )
    return built.eval()


def test_framework_snippets_return_what_the_frameworks_compute(demo_server: str) -> None:
    client_block, openrlhf, verl, trl = blocks(README, "python")
    assert '"http://127.0.0.1:8000"' in client_block
    scope: dict[str, Any] = {}
    exec(client_block.replace("http://127.0.0.1:8000", demo_server), scope)
    model = demo_model()
    batch = make_batch("split", seed=5)
    try:
        ran = dict(scope, sequences=batch.input_ids, attention_mask=batch.attention_mask)
        ran["action_mask"] = batch.action_mask
        exec(openrlhf, ran)
        want = frameworks.openrlhf(model, batch, batch.action_mask, temperature=1.0)
        check(ran["action_log_probs"], want, batch.action_mask)

        responses = batch.input_ids[:, -batch.window :]
        ran = dict(scope, batch={**vars(batch), "responses": responses})
        exec(verl, ran)
        log_probs, entropy = frameworks.verl(model, batch, responses, temperature=1.0)
        response_mask = batch.attention_mask[:, -batch.window :].bool()
        check(ran["old_log_probs"], log_probs, response_mask)
        check(ran["entropys"], entropy, response_mask)

        ran = dict(scope, prompt_completion_ids=batch.input_ids, attention_mask=batch.attention_mask)
        ran["completion_ids"] = responses
        exec(trl, ran)
        log_probs, _ = frameworks.trl(model, batch, batch.window, temperature=1.0)
        check(ran["old_per_token_logps"], log_probs, response_mask)
    finally:
        scope["client"].close()


def h200_standard_rows() -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """Each model of BENCHMARKS.md's standard-workload table on an H200: the result file current.toml
    names for it, and the model's figures there."""
    current = tomllib.loads((ROOT / "benchmarks/page/current.toml").read_text())
    found: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}
    for entry in current["run"]:
        result = json.loads((ROOT / "benchmarks/results" / entry["file"]).read_text())
        if result["device"] == "NVIDIA H200":
            for name, figures in result["models"].items():
                if name in entry.get("models", [name]):
                    found.setdefault(name, (result, figures))
    return found


def test_benchmark_table_is_the_pages_h200_rows() -> None:
    section = README.split("## How fast", 1)[1].split("\n## ", 1)[0]
    assert "Latest runs on an NVIDIA H200, `python -m benchmarks.run`" in section
    rows = {
        cells[0]: cells[1:]
        for line in section.splitlines()
        if line.startswith("| ") and not line.startswith("| ---")
        for cells in [[c.strip() for c in line.strip("|").split("|")]]
    }
    pages = h200_standard_rows()
    shown = [pages[f"qwen2.5-{size.lower()}"] for size in rows[""]]
    for result, _ in shown:
        assert result["date"] in section
    models = [figures for _, figures in shown]

    def pct(x: float) -> str:
        return f"{x * 100:.1f} %"

    assert rows["fraction of the FLOP floor"] == [pct(m["floor_fraction_http"]) for m in models]
    assert rows["throughput vs a naive padded forward"] == [
        f"{m['speedup_vs_naive']:.2f}\N{MULTIPLICATION SIGN}" for m in models
    ]
    assert rows["peak GPU memory vs the naive forward"] == [pct(m["peak_memory_vs_naive"]) for m in models]
    assert rows["HTTP overhead vs the engine in-process"] == [pct(m["http_overhead"]) for m in models]


def test_the_gpu_install_pins_the_images_torch() -> None:
    """The README's CUDA torch is the one the image installs (the Dockerfile's TORCH build argument)."""
    image = re.search(r"^ARG TORCH=(\S+)$", (ROOT / "Dockerfile").read_text(), re.M)
    assert image is not None
    gpu = next(b for b in blocks(README, "bash") if ".venv-gpu" in b)
    assert re.search(rf"pip install {re.escape(image.group(1))}(\s|$)", gpu), gpu

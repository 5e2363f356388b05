"""GPU smoke test of the service as deployed: started the way the image's entrypoint starts it, with
the image's environment and the Helm chart's default settings, then health, /info, /metrics, one
scored request and a SIGTERM drain. Prints a short report; `--json PATH` writes it as JSON.

    python -m benchmarks.smoke_deployed --json smoke.json                  # the demo model
    python -m benchmarks.smoke_deployed --model /models/Qwen2.5-1.5B --json smoke.json

Run from the repository root on a CUDA host with the service's dependencies installed. ENV, COMMAND
and CHART_ENV are the Dockerfile's ENV and ENTRYPOINT + CMD and the chart's default container env
(the demo model when `model.path` is empty); tests/deploy/test_smoke_deployed.py checks that they
still are. Exit status 0 only when every check passes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

# The Dockerfile's runtime ENV (PATH and the build-only variables left out).
ENV = {
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONUNBUFFERED": "1",
    "HF_HUB_OFFLINE": "1",
    "HF_HOME": "/tmp/hf",
    "TRITON_CACHE_DIR": "/tmp/kernels/triton",
    "QUACK_CACHE_DIR": "/tmp/kernels/quack",
    "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED": "1",
    "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR": "/tmp/kernels/flash_attn_cute",
    "XDG_CACHE_HOME": "/tmp/cache",
}
# ENTRYPOINT ["python", "-m", "service"] + CMD (the chart passes the same args)
COMMAND = ["-m", "service", "serve", "--host", "0.0.0.0", "--port", "8000"]
# The chart's default container env (helm/logprobd/values.yaml)
CHART_ENV = {
    "LOGPROBD_DEVICE": "cuda",
    "LOGPROBD_DTYPE": "auto",
    "LOGPROBD_ATTENTION": "auto",
    "LOGPROBD_DECODER": "auto",
    "LOGPROBD_KERNELS": "auto",
    "LOGPROBD_MLP_KERNEL": "auto",
    "LOGPROBD_HEAD_KERNEL": "auto",
    "LOGPROBD_CUDA_GRAPHS": "auto",
    "LOGPROBD_LOG_LEVEL": "info",
    "LOGPROBD_DRAIN_SECONDS": "15",
    "LOGPROBD_WEIGHTS_VERSION": "initial",
    "LOGPROBD_REF_WEIGHTS_VERSION": "initial",
    "LOGPROBD_CRITIC_WEIGHTS_VERSION": "initial",
}
PORT = 8000
# the chart's startup probe allows 90 x 10 s; its grace period is 5 + 15 + 30 + 10 s
READY_TIMEOUT_S, EXIT_TIMEOUT_S = 900.0, 60.0


def sample(metrics: str, series: str) -> float | None:
    found = re.search(rf"^{re.escape(series)} (\S+)$", metrics, re.MULTILINE)
    return float(found.group(1)) if found else None


def smoke(  # noqa: PLR0915 (one scenario, in order)
    model: str | None, port: int, overrides: dict[str, str] | None = None
) -> dict[str, Any]:
    """The scenario; `overrides` (env) only for the CPU test of this script."""
    env = {**os.environ, **ENV, **CHART_ENV, **(overrides or {})}
    if model:
        env["LOGPROBD_MODEL"] = model
    command = [sys.executable, *COMMAND[:-1], str(port)]
    base = f"http://127.0.0.1:{port}"
    checks: dict[str, bool] = {}
    report: dict[str, Any] = {
        "command": command,
        "env": {**ENV, **CHART_ENV},
        "model": model,
        "checks": checks,
    }
    started = time.monotonic()
    proc = subprocess.Popen(command, env=env)
    try:
        ready = None
        while time.monotonic() - started < READY_TIMEOUT_S and proc.poll() is None:
            try:
                ready = httpx.get(f"{base}/health/ready", timeout=5)
                if ready.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(1)
        report["ready_s"] = round(time.monotonic() - started, 1)
        checks["ready"] = ready is not None and ready.status_code == 200
        if not checks["ready"]:
            report["exit_code"] = proc.poll()
            return report
        checks["live"] = httpx.get(f"{base}/health/live", timeout=5).status_code == 200
        info = httpx.get(f"{base}/info", timeout=5).json()
        report["info"] = info
        checks["on_cuda"] = str(info.get("device", "")).startswith("cuda")

        metrics = httpx.get(f"{base}/metrics", timeout=5)
        checks["metrics_served"] = (
            metrics.status_code == 200 and "text/plain" in metrics.headers["content-type"]
        )
        checks["metrics_ready_1"] = sample(metrics.text, "logprobd_ready") == 1.0
        checks["metrics_outcomes_at_0"] = (
            sample(metrics.text, 'logprobd_requests_total{outcome="overloaded"}') == 0
        )

        vocab = int(info["vocab_size"])
        rows = [
            [(7 * i + 3 * j) % vocab + 1 for j in range(length)] for i, length in enumerate([17, 64, 300])
        ]
        actions = [5, 32, 100]
        t0 = time.perf_counter()
        scored = httpx.post(f"{base}/logprobs", json={"input_ids": rows, "num_actions": actions}, timeout=300)
        report["score_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
        checks["scored_200"] = scored.status_code == 200
        if checks["scored_200"]:
            logprobs = scored.json()["logprobs"]
            checks["scored_shapes"] = [len(row) for row in logprobs] == actions
            values = [v for row in logprobs for v in row]
            checks["scored_finite_le_0"] = all(math.isfinite(v) and v <= 1e-3 for v in values)
            report["mean_logprob"] = sum(values) / len(values)
        after = httpx.get(f"{base}/metrics", timeout=5).text
        checks["metrics_count_the_request"] = sample(after, 'logprobd_requests_total{outcome="ok"}') == 1.0
        checks["metrics_count_the_tokens"] = sample(after, "logprobd_scored_tokens_total") == sum(actions)

        proc.send_signal(signal.SIGTERM)  # as Kubernetes does after the preStop sleep
        time.sleep(0.5)
        draining = httpx.get(f"{base}/health/ready", timeout=5)
        checks["drains_503"] = draining.status_code == 503
        report["exit_code"] = proc.wait(timeout=int(CHART_ENV["LOGPROBD_DRAIN_SECONDS"]) + EXIT_TIMEOUT_S)
        checks["exits_0"] = report["exit_code"] == 0
        return report
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        report["passed"] = bool(checks) and all(checks.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the demo model)")
    parser.add_argument("--port", type=int, default=PORT)
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    args = parser.parse_args()
    report = smoke(args.model, args.port)
    info = report.get("info", {})
    print(f"model {info.get('model')} on {info.get('device')} {info.get('dtype')}; "
          f"attention {info.get('attention_backend')}, kernels {info.get('kernels')}; "
          f"ready in {report.get('ready_s')} s, one request {report.get('score_ms')} ms")  # fmt: skip
    for name, ok in report["checks"].items():
        print(f"  {'ok  ' if ok else 'FAIL'} {name}")
    print("PASSED" if report["passed"] else "FAILED")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())

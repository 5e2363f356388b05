"""A real Prometheus for the tests: the Debian/Ubuntu package `prometheus` (server and promtool),
configured from what the chart renders.

- `scrape_config`: the ServiceMonitor as the Prometheus Operator turns it into a scrape job: the
  Service it selects, the endpoint's port and path, and the `namespace`, `service`, `pod`,
  `endpoint` labels the Operator's relabelling gives every series (alerts and the dashboard select
  on them). Loopback ports stand in for the pods; the interval is shortened for a test run.
- `rule_groups`: the PrometheusRule's groups, which are a Prometheus rule file as they are.

Where the binaries are missing the tests skip, naming the package; LOGPROBD_REQUIRE_PROMETHEUS=1
(set by .ci/run) makes that a failure.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.support.chart import VALUES_FILES, Manifest, kinds, only, render
from tests.support.needs import skip_or_fail
from tests.support.servers import free_port

INSTALL = "apt-get install -y prometheus  (the Debian/Ubuntu package `prometheus`: server and promtool)"
# The values file whose rendering has a ServiceMonitor, a PrometheusRule and a KEDA ScaledObject.
MONITORED = next(
    path
    for path in VALUES_FILES
    if {"ServiceMonitor", "PrometheusRule", "ScaledObject"} <= kinds(render(path))
)


def binary(name: str) -> str:
    """The path of `prometheus` or `promtool`; skips (or, under CI, fails) where it is missing."""
    found = shutil.which(name)
    if found is None:
        skip_or_fail(f"{name} is not installed: {INSTALL}", "LOGPROBD_REQUIRE_PROMETHEUS")
    return found


def rule_groups(manifests: list[Manifest]) -> dict[str, Any]:
    """The PrometheusRule as a rule file."""
    return {"groups": only(manifests, "PrometheusRule")["spec"]["groups"]}


def _selected_service(manifests: list[Manifest], monitor: Manifest) -> Manifest:
    wanted = monitor["spec"]["selector"]["matchLabels"]
    namespaces = monitor["spec"]["namespaceSelector"]["matchNames"]
    (service,) = [
        m
        for m in manifests
        if m["kind"] == "Service"
        and wanted.items() <= m["metadata"].get("labels", {}).items()
        and m["metadata"].get("namespace", namespaces[0]) in namespaces
    ]
    return service


def scrape_config(
    manifests: list[Manifest], namespace: str, pods: dict[str, str], interval: str
) -> dict[str, Any]:
    """The ServiceMonitor's one endpoint as a scrape job over `pods` ({pod name: host:port}), every
    `interval` (the chart's own interval is checked, and shortened, here)."""
    monitor = only(manifests, "ServiceMonitor")
    (endpoint,) = monitor["spec"]["endpoints"]
    service = _selected_service(manifests, monitor)
    port_names = {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["port"] in port_names, (endpoint["port"], port_names)
    assert namespace in monitor["spec"]["namespaceSelector"]["matchNames"]
    name = service["metadata"]["name"]
    return {
        "job_name": f"serviceMonitor/{namespace}/{monitor['metadata']['name']}/0",
        "metrics_path": endpoint["path"],
        "scrape_interval": interval,
        "scrape_timeout": interval,
        "static_configs": [
            {
                "targets": [address],
                "labels": {
                    "namespace": namespace,
                    "service": name,
                    "pod": pod,
                    "endpoint": endpoint["port"],
                    "job": name,
                },
            }
            for pod, address in pods.items()
        ],
    }


class Prometheus:
    """A running Prometheus' HTTP API."""

    def __init__(self, url: str) -> None:
        self.url = url

    def api(self, path: str, **params: Any) -> Any:
        reply = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=30)
        body = reply.json()
        assert reply.status_code == 200, (path, params, body)
        assert body["status"] == "success", (path, params, body)
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> dict[str, Any]:
        data: dict[str, Any] = self.api("query", query=expr, **({"time": at} if at is not None else {}))
        return data

    def query_range(self, expr: str, start: float, end: float, step: str) -> dict[str, Any]:
        data: dict[str, Any] = self.api("query_range", query=expr, start=start, end=end, step=step)
        return data

    def rules(self) -> dict[str, dict[str, Any]]:
        """Every loaded rule by its alert or record name."""
        groups = self.api("rules")["groups"]
        return {rule["name"]: rule for group in groups for rule in group["rules"]}


@contextmanager
def running_prometheus(
    workdir: Path, scrape: dict[str, Any], rules: dict[str, Any], interval: str
) -> Iterator[Prometheus]:
    """`prometheus` on a free loopback port with `scrape` and `rules`, rules evaluated every
    `interval`; yields once it is ready."""
    exe = binary("prometheus")
    (workdir / "rules.yaml").write_text(yaml.safe_dump(rules, sort_keys=False))
    config = {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "rule_files": [str(workdir / "rules.yaml")],
        "scrape_configs": [scrape],
    }
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))
    port = free_port()
    log = (workdir / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [exe, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (workdir / "prometheus.log").read_text()
            try:
                if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "Prometheus did not become ready"
            time.sleep(0.1)
        yield Prometheus(url)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()

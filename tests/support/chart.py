"""What the deploy tests share: the Helm chart rendered offline (helm-python-sdk: Helm's Go SDK in a
wheel, no helm binary) with each CI values file, the app's GET routes, PromQL parsed into the
series names it reads (promql-parser), and the dashboard's panels."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import promql_parser
import yaml
from starlette.routing import Match

from service.http.app import create_app
from service.settings import Settings
from tests.support import ROOT

CHART = ROOT / "helm" / "logprobd"
VALUES_FILES = sorted((CHART / "ci").glob("*-values.yaml"))
KUBE_VERSION = "1.30.0"
RELEASE, NAMESPACE = "rl", "train"

Manifest = dict[str, Any]


_ROUTES = create_app(Settings()).routes


def serves_get(path: str) -> bool:
    """Whether the app answers GET `path` with one of its routes (asked the way Starlette routes)."""
    scope = {"type": "http", "method": "GET", "path": path, "root_path": ""}
    return any(route.matches(scope)[0] == Match.FULL for route in _ROUTES)


def values_of(path: Path) -> dict[str, Any]:
    values: dict[str, Any] = yaml.safe_load(path.read_text()) or {}
    return values


@functools.cache
def _rendered(path: Path) -> tuple[dict[str, str], dict[str, Any]]:
    with helm.Chart.load(CHART) as chart:
        values = values_of(path)
        return chart.render(values, name=RELEASE, namespace=NAMESPACE), chart.merge_values(values)


def render(path: Path) -> list[Manifest]:
    """Every object the chart renders with this values file (NOTES.txt and empty templates left out)."""
    templates, _ = _rendered(path)
    return [
        doc
        for name, text in sorted(templates.items())
        if name.endswith(".yaml")
        for doc in yaml.safe_load_all(text)
        if doc
    ]


def merged_values(path: Path) -> dict[str, Any]:
    """The chart's defaults coalesced with the file, as an install would use them."""
    return _rendered(path)[1]


def notes(path: Path) -> str:
    return _rendered(path)[0][f"{CHART.name}/templates/NOTES.txt"]


def only(manifests: list[Manifest], kind: str) -> Manifest:
    found = [m for m in manifests if m["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def services(manifests: list[Manifest]) -> tuple[Manifest, Manifest | None]:
    """The load-balanced Service and the headless one (None when turned off)."""
    found = [m for m in manifests if m["kind"] == "Service"]
    headless = [m for m in found if m["spec"].get("clusterIP") == "None"]
    (main,) = [m for m in found if m not in headless]
    assert len(headless) <= 1
    return main, headless[0] if headless else None


def kinds(manifests: list[Manifest]) -> set[str]:
    return {m["kind"] for m in manifests}


def container(manifests: list[Manifest]) -> dict[str, Any]:
    pod = only(manifests, "Deployment")["spec"]["template"]["spec"]
    (main,) = pod["containers"]
    result: dict[str, Any] = main
    return result


def env_of(manifests: list[Manifest]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container(manifests).get("env", [])}


# Grafana's range variables, replaced by a duration so that a dashboard query parses as PromQL
_GRAFANA_RANGES = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}


def promql_metric_names(expr: str) -> set[str]:
    """The series names `expr` selects. Parses it as PromQL: a syntax error raises ValueError."""
    for variable, duration in _GRAFANA_RANGES.items():
        expr = expr.replace(variable, duration)
    names: set[str] = set()

    def visit(node: promql_parser.Expr) -> bool:
        if isinstance(node, promql_parser.VectorSelector):
            assert node.name, f"a selector without a metric name in {expr!r}"
            names.add(node.name)
        return True

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


# Series that other exporters provide, with where they come from.
EXTERNAL = {"DCGM_FI_DEV_FB_USED": "NVIDIA DCGM exporter: GPU framebuffer in use, MiB (GPU memory panel)"}


def every_panel(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Each panel of a dashboard's `panels`, and of its rows' `panels`, depth first."""
    for panel in panels:
        yield panel
        yield from every_panel(panel.get("panels", []))

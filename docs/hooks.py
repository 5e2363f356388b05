"""MkDocs hooks: the pages generated from the repository's own files, so that they cannot drift.

- `openapi.md`: the committed `openapi.yaml` rendered to markdown (every route, request field,
  response and schema), with the YAML itself beside it for download. No network, no plugin.
- `benchmarks.md`: the repository's `BENCHMARKS.md`, its links to `docs/` made site links; the
  pages' links to `../BENCHMARKS.md` (right when read in the repository) lead to it in the site; the
  result files it links (`benchmarks/results/...`) are served at the same paths.
- `img/dashboard.svg`: the Grafana dashboard's layout (rows and panels, where the JSON puts them).
- the metrics table of `observability.md`: every metric of `service/metrics.py`, in place of
  `<!-- metrics-table -->`.
- `configuration.md` is committed (`make config-docs`); the build fails when it differs from what
  `service/settings.py` renders.
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path
from typing import Any

import yaml
from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

ROOT = Path(__file__).resolve().parents[1]
OPENAPI = ROOT / "openapi.yaml"
DASHBOARD = ROOT / "helm" / "logprobd" / "dashboards" / "logprobd.json"
CONFIGURATION = ROOT / "docs" / "configuration.md"
BENCHMARKS = ROOT / "BENCHMARKS.md"


def on_pre_build(config: MkDocsConfig) -> None:
    from service.configdoc import render_configuration

    if CONFIGURATION.read_text() != render_configuration():
        raise PluginError("docs/configuration.md is stale: run `make config-docs`")


def on_files(files: Files, config: MkDocsConfig) -> Files:
    spec = yaml.safe_load(OPENAPI.read_text())
    files.append(File.generated(config, "openapi.md", content=render_openapi(spec)))
    files.append(File.generated(config, "openapi.yaml", content=OPENAPI.read_text()))
    benchmarks = BENCHMARKS.read_text().replace("](docs/", "](")
    files.append(File.generated(config, "benchmarks.md", content=benchmarks))
    for cited in sorted(set(re.findall(r"\]\((benchmarks/results/[^)]+)\)", benchmarks))):
        files.append(File.generated(config, cited, content=(ROOT / cited).read_bytes()))
    dashboard = json.loads(DASHBOARD.read_text())
    files.append(File.generated(config, "img/dashboard.svg", content=render_dashboard(dashboard)))
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    markdown = markdown.replace("](../BENCHMARKS.md", "](benchmarks.md")
    return markdown.replace(METRICS_MARKER, render_metrics()) if METRICS_MARKER in markdown else markdown


METRICS_MARKER = "<!-- metrics-table -->"


def render_metrics() -> str:
    """Every collector of `service.metrics.Metrics`: name, type, labels, help text."""
    from prometheus_client.metrics import MetricWrapperBase

    from service.metrics import Metrics

    lines = ["| metric | type | labels | what |", "| --- | --- | --- | --- |"]
    for collector in vars(Metrics()).values():
        for family in collector.describe() if hasattr(collector, "describe") else []:
            labels: tuple[str, ...] = (
                collector._labelnames if isinstance(collector, MetricWrapperBase) else ()
            )
            name = family.name + {"counter": "_total", "info": "_info"}.get(family.type, "")
            lines.append(
                f"| `{name}` | {family.type} | {', '.join(f'`{x}`' for x in labels)} "
                f"| {_cell(family.documentation)} |"
            )
    return "\n".join(lines)


# --- openapi.yaml -> markdown -------------------------------------------------------------------


def schema_type(schema: dict[str, Any]) -> str:
    """A short type: `integer ≥ 0`, `array of array of integer`, `k1 | k2 | k3`, a linked $ref, or null."""
    if "$ref" in schema:
        name = str(schema["$ref"]).rsplit("/", 1)[-1]
        return f"[{name}](#{name.lower()})"
    if "anyOf" in schema:
        return " or ".join(schema_type(s) for s in schema["anyOf"])
    if "enum" in schema:
        return " | ".join(f"`{v}`" for v in schema["enum"])  # `_cell` escapes the bars
    kind = str(schema.get("type", "any"))
    if kind == "array":
        return f"array of {schema_type(schema.get('items', {}))}"
    bounds = [
        f"{op} {schema[key]:g}"
        for key, op in (
            ("minimum", "≥"),
            ("exclusiveMinimum", ">"),
            ("maximum", "≤"),
            ("maxLength", "length ≤"),
        )
        if key in schema
    ]
    return " ".join([kind, *bounds])


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ").strip()


def properties_table(schema: dict[str, Any]) -> list[str]:
    required = set(schema.get("required", []))
    lines = ["| field | type | default | description |", "| --- | --- | --- | --- |"]
    for name, prop in schema.get("properties", {}).items():
        default = (
            "required"
            if name in required
            else f"`{json.dumps(prop['default'])}`"
            if "default" in prop
            else ""
        )
        lines.append(
            f"| `{name}` | {_cell(schema_type(prop))} | {default} | {_cell(prop.get('description', ''))} |"
        )
    return lines


def render_openapi(spec: dict[str, Any]) -> str:
    info = spec["info"]
    out = [
        "# OpenAPI document",
        "",
        f"{info['description']} Version {info['version']}, OpenAPI {spec['openapi']}.",
        "",
        "Rendered at build time from the committed [`openapi.yaml`](openapi.yaml), which a test keeps",
        "equal to what the app serves at `/openapi.json`. The prose reference is [API reference](api.md).",
        "",
    ]
    nested: dict[str, Any] = {}  # the $defs of request bodies declared inline (their $refs link here)
    for path, methods in spec["paths"].items():
        for method, op in methods.items():
            out += [f"## `{method.upper()} {path}`", "", op.get("description") or op.get("summary", ""), ""]
            for kind, body in op.get("requestBody", {}).get("content", {}).items():
                out += [f"Request body, `{kind}`:", ""]
                body_schema = body.get("schema", {})
                nested.update(body_schema.get("$defs", {}))
                out += (
                    [*properties_table(body_schema), ""]
                    if "properties" in body_schema
                    else [
                        f"{_cell(body_schema.get('description', schema_type(body_schema)))}",
                        "",
                    ]
                )
            out += ["| status | description | body |", "| --- | --- | --- |"]
            for status, response in op.get("responses", {}).items():
                schemas = [
                    schema_type(c["schema"]) for c in response.get("content", {}).values() if "schema" in c
                ]
                out.append(
                    f"| {status} | {_cell(response.get('description', ''))} | {_cell(', '.join(schemas))} |"
                )
            out.append("")
    out += ["## Schemas", ""]
    every_schema = {**nested, **spec.get("components", {}).get("schemas", {})}
    for name, schema in every_schema.items():
        out += [f"### {name}", "", schema.get("description", ""), "", *properties_table(schema), ""]
    return "\n".join(out)


# --- the Grafana dashboard -> an SVG of its layout ------------------------------------------------

UNIT_W, UNIT_H = 40, 24  # Grafana's grid: 24 columns; a height unit of about 30 px, drawn smaller


def render_dashboard(dashboard: dict[str, Any]) -> str:
    panels = dashboard["panels"]
    height = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels) * UNIT_H
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{24 * UNIT_W}" height="{height}" '
        'font-family="sans-serif" font-size="12">',
        f'<rect width="{24 * UNIT_W}" height="{height}" fill="#111217"/>',
    ]
    for panel in panels:
        g = panel["gridPos"]
        x, y, w, h = g["x"] * UNIT_W, g["y"] * UNIT_H, g["w"] * UNIT_W, g["h"] * UNIT_H
        title = html.escape(str(panel.get("title", "")))
        if panel.get("type") == "row":
            parts.append(f'<text x="{x + 4}" y="{y + 17}" fill="#ccccdc" font-weight="bold">{title}</text>')
            continue
        parts.append(
            f'<rect x="{x + 2}" y="{y + 2}" width="{w - 4}" height="{h - 4}" rx="3" fill="#181b1f" '
            'stroke="#2c3235"/>'
        )
        parts.append(f'<text x="{x + 8}" y="{y + 18}" fill="#ccccdc">{title}</text>')
        parts.append(f'<text x="{x + 8}" y="{y + 34}" fill="#8e8e8e" font-size="10">{panel["type"]}</text>')
    parts.append("</svg>")
    return "\n".join(parts)

"""MkDocs hooks: the pages generated from the repository's own files, so that they cannot drift.

Committed, so that the repository shows them as the site does (GitHub renders docs/ and follows its
links), and checked: the build fails when one differs from what its source renders, and
`python docs/hooks.py` writes them all anew (`make openapi` runs it after openapi.yaml):

- `openapi.md`: the committed `openapi.yaml` rendered to markdown (every route, request field,
  response and schema); the site serves the YAML beside it for download. No network, no plugin.
- `img/dashboard.svg`: the Grafana dashboard's layout (rows and panels, where the JSON puts them).
- the metrics table of `observability.md`, between its `<!-- metrics-table -->` markers: every
  metric of `service/metrics.py`.
- `img/architecture.svg`, the map of `service/` on architecture.md, from the boxes below.
- `configuration.md` (`make config-docs`, from `service/settings.py`).

Rendered at build time: `benchmarks.md` and `contributing.md`, the repository's `BENCHMARKS.md` and
`CONTRIBUTING.md` with their links to `docs/` made site links; the pages' links to the repository's
root files (`../BENCHMARKS.md`, `../CONTRIBUTING.md`, `../openapi.yaml`: right when read in the
repository) lead to them in the site; the result files `BENCHMARKS.md` links
(`benchmarks/results/...`) are served at the same paths.
"""

from __future__ import annotations

import html
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
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
OBSERVABILITY = ROOT / "docs" / "observability.md"
ROOT_PAGES = {"BENCHMARKS.md": "benchmarks.md", "CONTRIBUTING.md": "contributing.md"}  # file -> site page
ROOT_FILES = {**ROOT_PAGES, "openapi.yaml": "openapi.yaml"}  # what ../<file> links lead to in the site
ARCHITECTURE_SVG = ROOT / "docs" / "img" / "architecture.svg"
DASHBOARD_SVG = ROOT / "docs" / "img" / "dashboard.svg"
OPENAPI_PAGE = ROOT / "docs" / "openapi.md"
METRICS_MARKER = "<!-- metrics-table -->"
METRICS_END = "<!-- /metrics-table -->"


def generated() -> dict[Path, Callable[[], str]]:
    """Each committed generated file and what it must read (docs/configuration.md has its own command)."""
    return {
        OPENAPI_PAGE: lambda: render_openapi(yaml.safe_load(OPENAPI.read_text())),
        DASHBOARD_SVG: lambda: render_dashboard(json.loads(DASHBOARD.read_text())),
        ARCHITECTURE_SVG: render_architecture,
        OBSERVABILITY: lambda: with_metrics_table(OBSERVABILITY.read_text()),
    }


def on_pre_build(config: MkDocsConfig) -> None:
    from service.configdoc import render_configuration

    if CONFIGURATION.read_text() != render_configuration():
        raise PluginError("docs/configuration.md is stale: run `make config-docs`")
    for path, render in generated().items():
        if path.read_text() != render():
            raise PluginError(f"{path.relative_to(ROOT)} is stale: run `python docs/hooks.py`")


def on_files(files: Files, config: MkDocsConfig) -> Files:
    files.append(File.generated(config, "openapi.yaml", content=OPENAPI.read_text()))
    for name, site_page in ROOT_PAGES.items():
        content = (ROOT / name).read_text().replace("](docs/", "](")
        files.append(File.generated(config, site_page, content=content))
        for cited in sorted(set(re.findall(r"\]\((benchmarks/results/[^)]+)\)", content))):
            files.append(File.generated(config, cited, content=(ROOT / cited).read_bytes()))
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    for name, site_file in ROOT_FILES.items():
        markdown = markdown.replace(f"](../{name}", f"]({site_file}")
    return markdown


def with_metrics_table(page: str) -> str:
    """`page` with the metrics table between its markers rendered anew."""
    if METRICS_MARKER not in page or METRICS_END not in page:
        raise PluginError(f"observability.md has lost its {METRICS_MARKER} ... {METRICS_END} markers")
    head, rest = page.split(METRICS_MARKER, 1)
    tail = rest.split(METRICS_END, 1)[1]
    return f"{head}{METRICS_MARKER}\n{render_metrics()}\n{METRICS_END}{tail}"


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
        "Generated (`python docs/hooks.py`) from the committed [`openapi.yaml`](../openapi.yaml), which a",
        "test keeps equal to what the app serves at `/openapi.json`. The prose reference is",
        "[API reference](api.md).",
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
    return "\n".join(parts) + "\n"


# --- the map of the code (docs/architecture.md) -> docs/img/architecture.svg ------------------------

IN, OUT, SIDE = "#2d3748", "#2b6cb0", "#9c6b12"  # arrows: a request in, its answer out, the others


@dataclass(frozen=True)
class Box:
    """A package, or a folder of the engine, and a few lines on it. `names`: every module and folder
    the box names, under service/ (a test checks that each exists)."""

    x: int
    y: int
    w: int
    h: int
    title: str
    lines: tuple[str, ...]
    names: tuple[str, ...]
    fill: str = "#f4f6f9"
    dashed: bool = False


@dataclass(frozen=True)
class Arrow:
    """From (x, y0) to (x, y1), or from (x0, y) to (x1, y): `a` and `b` are the two points. A label
    at `at` (left-aligned), or, with `at` None, along the arrow."""

    a: tuple[int, int]
    b: tuple[int, int]
    colour: str = IN
    label: str = ""
    at: tuple[int, int] | None = None
    dashed: bool = False


def _box(at: tuple[int, int, int, int], title: str, *lines: str, names: tuple[str, ...], **kw: Any) -> Box:
    """A box at (x, y, width, height)."""
    return Box(*at, title, lines, names, **kw)


def _room(at: tuple[int, int, int, int], folder: str, *lines: str, also: tuple[str, ...] = ()) -> Box:
    """A folder of the engine, inside its box; `also`: what else it names, under service/engine/."""
    names = (f"engine/{folder}/", *(f"engine/{name}" for name in also))
    return Box(*at, f"{folder}/", lines, names, fill="#ffffff")


ARCHITECTURE_BOXES = (
    _box(
        (40, 16, 760, 50),
        "service/client/",
        "the trainer's process: Client, AsyncClient, the OpenRLHF / verl / TRL adapters; wire.py writes",
        "a body (JSON, or wire/frame.py's compact frame, shared with the server) and reads the answer",
        names=("client/", "client/wire.py", "wire/frame.py"),
        fill="#fff8e6",
        dashed=True,
    ),
    _box(
        (40, 108, 760, 50),
        "service/http/",
        "router.py logprobs(): read_body, parse, normalise, Batcher.submit, answer, to_frame | to_json",
        "admin.py POST /admin/weights · completions/ POST /v1/completions · app.py lifespan: load, warm up",
        names=("http/", "http/router.py", "http/admin.py", "http/completions/", "http/app.py"),
    ),
    _box(
        (100, 200, 600, 50),
        "service/wire/",
        "in: jsonrows.py parse_json (its rows of ids by _jsonrows.c) | arrays.py parse_frame",
        "out: arrays.py to_frame · schemas.py the pydantic models, which openapi.yaml is generated from",
        names=("wire/", "wire/jsonrows.py", "wire/_jsonrows.c", "wire/arrays.py", "wire/schemas.py"),
    ),
    _box(
        (100, 292, 290, 64),
        "service/normalise/",
        "normalise(request, limits) -> ScoringPlan: a",
        "SequenceJob per row (tokens [L], actions [A])",
        "and its RowWindow; every cross-field 422",
        names=("normalise/",),
    ),
    _box(
        (410, 292, 290, 64),
        "service/answer/",
        "layout.py answer(plan, scores): each row's",
        "scores in its window [width], top-K blocks,",
        "routes; diagnostics.py KL, rollout mismatch",
        names=("answer/", "answer/layout.py", "answer/diagnostics.py"),
    ),
    _box(
        (40, 398, 560, 64),
        "service/batcher/",
        "policy.py Policy.take: queued jobs -> a micro-batch under --max-batch-tokens, a shared",
        "prefix computed once (core/prefixes.py Forest), a long sequence in chunks",
        "runner.py Batcher: launch on the engine thread, collect on the results thread",
        names=("batcher/", "batcher/policy.py", "batcher/runner.py", "core/prefixes.py"),
    ),
    _box(
        (620, 398, 180, 64),
        "service/weights/",
        "updates.py Reloader: stage",
        "off the engine thread; apply",
        "at the batcher's barrier",
        names=("weights/", "weights/updates.py"),
    ),
    _box(
        (40, 504, 760, 168),
        "service/engine/",
        "contract.py ScoringEngine: launch(jobs, chunk, forest) -> Launched; result() -> [SequenceScores]",
        names=("engine/", "engine/contract.py"),
        fill="#eaf1fb",
    ),
    _room(
        (56, 548, 160, 62),
        "scorer",
        "engine.py PackedScorer",
        "launches; inflight.py",
        "copies scores to host",
        also=("scorer/engine.py", "scorer/inflight.py"),
    ),
    _room(
        (246, 548, 160, 62),
        "batch",
        "packing.py pack ->",
        "PackedBatch: N tokens",
        "in one row, A actions",
        also=("batch/packing.py",),
    ),
    _room(
        (436, 548, 160, 62),
        "decoder",
        "each model's forward",
        "-> hidden [A, H]; with",
        "ops/, moe/, strategies/",
        also=("ops/", "moe/", "strategies/"),
    ),
    _room(
        (626, 548, 160, 62),
        "heads",
        "action rows only ->",
        "log-probs [A], entropy",
        "[A], top K, candidates",
    ),
    _room((56, 624, 160, 36), "loading", "checkpoints -> models"),
    _room((246, 624, 160, 36), "parallel", "a rank's slices"),
    _room((436, 624, 160, 36), "tensor_parallel", "a scorer per rank"),
    _room((626, 624, 160, 36), "runtime", "optional kernels"),
    _box(
        (40, 714, 760, 50),
        "service/core/",
        "the types every layer shares, importing none of them: jobs.py (SequenceJob, Chunk, SequenceScores),",
        "prefixes.py (Forest), errors.py (every error a client sees, and its one status table), heap.py",
        names=("core/", "core/jobs.py", "core/prefixes.py", "core/errors.py", "core/heap.py"),
        fill="#eeeeee",
    ),
)

ARCHITECTURE_ARROWS = (
    Arrow((120, 66), (120, 108), IN, "POST /logprobs: JSON or a frame", (128, 91)),
    Arrow((120, 158), (120, 200), IN, "the body's bytes", (128, 183)),
    Arrow((120, 250), (120, 292), IN, "LogprobsRequest", (128, 275)),
    Arrow((120, 356), (120, 398), IN, "plan.jobs, plan.pins", (128, 381)),
    Arrow((120, 462), (120, 504), IN, "a Batch: jobs, a chunk, a Forest", (128, 487)),
    Arrow((216, 579), (246, 579)),
    Arrow((406, 579), (436, 579)),
    Arrow((596, 579), (626, 579)),
    Arrow((500, 504), (500, 462), OUT, "[SequenceScores]", (508, 487)),
    Arrow((500, 398), (500, 356), OUT, "Scored", (508, 381)),
    Arrow((500, 292), (500, 250), OUT, "the answer's rows", (508, 275)),
    Arrow((500, 200), (500, 158), OUT, "bytes", (508, 183)),
    Arrow((500, 108), (500, 66), OUT, "200: JSON or a frame", (508, 91)),
    Arrow((70, 158), (70, 398), SIDE, "/v1/completions: jobs", dashed=True),
    Arrow((770, 158), (770, 398), SIDE, "POST /admin/weights"),
    Arrow((710, 462), (710, 504), SIDE, "stage, apply", (718, 487)),
)


def architecture_names() -> list[str]:
    """Every module and folder the picture names, as paths under service/."""
    return [name for box in ARCHITECTURE_BOXES for name in box.names]


def _text(x: int, y: int, text: str, *attrs: str) -> str:
    return f'<text x="{x}" y="{y}"{"".join(" " + a for a in attrs)}>{html.escape(text)}</text>'


def render_architecture() -> str:
    """docs/img/architecture.svg: the packages of service/ and a request's way through them."""
    width, height = 840, 800
    heads = "".join(
        f'<marker id="head{i}" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" markerHeight="7" '
        f'orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="{colour}"/></marker>'
        for i, colour in enumerate((IN, OUT, SIDE))
    )
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="Helvetica, Arial, sans-serif" font-size="11">',
        f"<defs>{heads}</defs>",
        f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
    ]
    for b in ARCHITECTURE_BOXES:
        dash = ' stroke-dasharray="5,3"' if b.dashed else ""
        parts.append(
            f'<rect x="{b.x}" y="{b.y}" width="{b.w}" height="{b.h}" rx="4" fill="{b.fill}" '
            f'stroke="#4a5568"{dash}/>'
        )
        parts.append(_text(b.x + 8, b.y + 15, b.title, 'font-weight="bold"', 'font-size="12"'))
        parts += [_text(b.x + 8, b.y + 30 + 13 * i, line, 'fill="#1a202c"') for i, line in enumerate(b.lines)]
    for a in ARCHITECTURE_ARROWS:
        dash = ' stroke-dasharray="6,4"' if a.dashed else ""
        head = (IN, OUT, SIDE).index(a.colour)
        parts.append(
            f'<line x1="{a.a[0]}" y1="{a.a[1]}" x2="{a.b[0]}" y2="{a.b[1]}" stroke="{a.colour}" '
            f'stroke-width="1.6"{dash} marker-end="url(#head{head})"/>'
        )
        if a.label and a.at is not None:
            parts.append(_text(*a.at, a.label, f'fill="{a.colour}"'))
        elif a.label:  # along a vertical arrow, read upwards
            x, y = a.a[0] - 6, (a.a[1] + a.b[1]) // 2
            parts.append(
                _text(
                    x,
                    y,
                    a.label,
                    f'fill="{a.colour}"',
                    'text-anchor="middle"',
                    f'transform="rotate(-90 {x} {y})"',
                )
            )
    parts.append(
        _text(
            40,
            786,
            "black: a /logprobs request on its way in · blue: its answer on the way out · "
            "brown: /v1/completions and weight reloads",
            'fill="#4a5568"',
        )
    )
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


if __name__ == "__main__":  # python docs/hooks.py: write every committed generated file anew
    sys.path.insert(0, str(ROOT))  # this checkout's service/, whatever the venv has installed
    for path, render in generated().items():
        path.write_text(render())

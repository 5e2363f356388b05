"""The generated documentation cannot drift: docs/configuration.md is what `Settings` and the command
line render, the OpenAPI page names every route and field of openapi.yaml, the metrics table every
metric, and the observability page has a runbook for every alert of the chart."""

from __future__ import annotations

import ast
import re

import pytest
import yaml

from service.__main__ import _parser, _subcommand
from service.configdoc import render_configuration
from service.flags import setting_flags
from service.settings import GROUPS, Settings
from tests.support import ROOT
from tests.support.docs import hooks


def test_configuration_page_has_not_drifted() -> None:
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == render_configuration(), "docs/configuration.md is stale: run `make config-docs`"


def test_configuration_page_names_every_flag_and_variable() -> None:
    page = render_configuration()
    options = setting_flags(_subcommand(_parser(), "serve"))
    assert set(options) == set(Settings.model_fields)
    rows = [line for line in page.splitlines() if line.startswith("| `--")]
    assert len(rows) == len(Settings.model_fields)
    in_groups = [(name, Settings.model_fields[name]) for group in GROUPS for name in group.names]
    for row, (name, field) in zip(rows, in_groups, strict=True):
        assert row.startswith(f"| `{options[name].option_strings[0]}"), row
        assert f"`LOGPROBD_{name.upper()}`" in row
        assert (field.description or "").split(".")[0].replace("|", "\\|") in row


def test_openapi_page_names_every_route_and_field() -> None:
    spec = yaml.safe_load((ROOT / "openapi.yaml").read_text())
    page = hooks().render_openapi(spec)
    for path, methods in spec["paths"].items():
        for method, op in methods.items():
            assert f"## `{method.upper()} {path}`" in page
            for body in op.get("requestBody", {}).get("content", {}).values():
                for field in body.get("schema", {}).get("properties", {}):
                    assert f"| `{field}` |" in page
    for name, schema in spec["components"]["schemas"].items():
        assert f"### {name}" in page
        for field in schema.get("properties", {}):
            assert f"| `{field}` |" in page


def test_metrics_table_lists_every_metric() -> None:
    from service.metrics import Metrics

    table = hooks().render_metrics()
    types = [
        line.split()[2] for line in Metrics().render().decode().splitlines() if line.startswith("# TYPE")
    ]
    exported = {name for name in types if not name.endswith("_created")}  # prometheus_client's own
    listed = set(re.findall(r"^\| `(logprobd_\w+)`", table, re.MULTILINE))
    assert listed == exported


def test_every_alert_has_a_runbook() -> None:
    rules = (ROOT / "helm/logprobd/templates/prometheusrule.yaml").read_text()
    alerts = set(re.findall(r"- alert: (\w+)", rules))
    page = (ROOT / "docs" / "observability.md").read_text()
    assert alerts
    assert alerts == set(re.findall(r"^### (Logprobd\w+)$", page, re.MULTILINE))


def section_table(page: str, heading: str) -> list[list[str]]:
    """The first table after `heading` in docs/<page>, as rows of cells (the header row dropped)."""
    text = (ROOT / "docs" / page).read_text().split(f"\n{heading}\n", 1)[1]
    lines = text.split("\n|", 1)[1].split("\n\n", 1)[0].splitlines()
    rows = [[cell.strip() for cell in ("|" + line).strip().strip("|").split("|")] for line in lines]
    return [row for row in rows[1:] if not set(row[0]) <= {"-", " "}]


def test_api_response_table_names_every_response_field() -> None:
    spec = yaml.safe_load((ROOT / "openapi.yaml").read_text())
    fields = set(spec["components"]["schemas"]["LogprobsResponse"]["properties"])
    listed = {
        name for row in section_table("api.md", "### Response") for name in re.findall(r"`(\w+)`", row[0])
    }
    assert fields - listed == set()


def test_api_error_table_has_every_status_of_the_error_table() -> None:
    from service.core.errors import _STATUS, ClientDisconnected, ServiceError, status_for

    documented = {
        (int(row[0]), kind)
        for row in section_table("api.md", "## Errors")
        for kind in re.findall(r"`(\w+)`", row[1])
    }
    served = {
        (status_for(cls.__new__(cls)), cls.kind)
        for cls in _STATUS
        if cls is not ClientDisconnected  # never sent: the client has gone (the page says so below the table)
    }
    assert ServiceError in _STATUS
    assert served == documented


def test_architecture_picture_has_not_drifted() -> None:
    committed = (ROOT / "docs" / "img" / "architecture.svg").read_text()
    assert committed == hooks().render_architecture(), "docs/img/architecture.svg is stale: run docs/hooks.py"


SERVICE = ROOT / "service"
MODULE_NAME = re.compile(r"[\w/]+\.(?:py|c)\b|(?<![/\w])[a-z_]+/(?!\w)")  # `moe/layer.py`, `ops/`


def found_under(top: str, name: str) -> bool:
    """Whether `name` (a file, or a folder ending in /) is a path under top/, or the end of one."""
    root = ROOT / top
    paths = [p.relative_to(root).as_posix() + ("/" if p.is_dir() else "") for p in root.rglob("*")]
    return any(p == name or p.endswith("/" + name) for p in paths)


def test_architecture_picture_names_what_exists() -> None:
    docs = hooks()
    for name in docs.architecture_names():
        assert (SERVICE / name).exists(), f"docs/hooks.py's picture names service/{name}, which is not there"
    for box in docs.ARCHITECTURE_BOXES:
        for line in (box.title, *box.lines):
            for name in MODULE_NAME.findall(line.removeprefix("service/")):
                assert any(n.endswith(name) for n in box.names), f"{box.title}: {name} is not in its names"
            assert len(line) * 6.0 <= box.w - 12, f"{box.title}: {line!r} overflows its box"


def _definitions() -> tuple[set[str], dict[str, set[str]]]:
    """Every name service/ defines (functions at any depth, classes, module-level assignments), and
    each class's methods."""
    names: set[str] = set()
    methods: dict[str, set[str]] = {}
    for path in SERVICE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            if isinstance(node, ast.ClassDef):
                defs = (ast.FunctionDef, ast.AsyncFunctionDef)
                methods.setdefault(node.name, set()).update(n.name for n in node.body if isinstance(n, defs))
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names, methods


CALL = re.compile(r"^(?:(\w+)\.)?(\w+)\(.*\)$")  # `name()`, `Class.method()`, `module.name(args)`
CLASS = re.compile(r"^_?[A-Z][a-z]\w*$")  # `SequenceJob`
CONSTANT = re.compile(r"^_?[A-Z][A-Z0-9_]{2,}$")  # `SHAPE_STEP`
PATH = re.compile(r"^[\w.][\w./-]*(?:\.(?:py|c|md|yaml|toml|svg)|/)$")  # `service/batcher/`, `packing.py`
FLAG = re.compile(r"^--([a-z][a-z0-9-]*)$")  # `--max-batch-tokens`


@pytest.mark.parametrize("page", ["docs/architecture.md", "CONTRIBUTING.md"])
def test_code_pages_name_only_what_exists(page: str) -> None:
    """Every module, folder, function, class, constant and flag the page names in backticks exists."""
    names, methods = _definitions()
    missing = []
    for token in set(re.findall(r"`([^`\n]+)`", (ROOT / page).read_text())):
        if call := CALL.match(token):
            owner, name = call.groups()
            found = name in methods.get(owner, set()) if owner and owner[0].isupper() else name in names
        elif CLASS.match(token) or CONSTANT.match(token):
            found = token in names
        elif PATH.match(token):
            found = (ROOT / token).exists() or found_under("service", token) or found_under("tests", token)
        elif flag := FLAG.match(token):
            found = flag.group(1).replace("-", "_") in Settings.model_fields
        else:
            continue
        if not found:
            missing.append(token)
    assert sorted(missing) == []

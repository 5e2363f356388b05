"""The generated documentation cannot drift: docs/configuration.md is what `Settings` and the command
line render, the OpenAPI page names every route and field of openapi.yaml, the metrics table every
metric, and the observability page has a runbook for every alert of the chart."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import yaml

from service.__main__ import _parser, _subcommand
from service.configdoc import render_configuration
from service.flags import setting_flags
from service.settings import Settings

ROOT = Path(__file__).resolve().parents[1]


def hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_configuration_page_has_not_drifted() -> None:
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == render_configuration(), "docs/configuration.md is stale: run `make config-docs`"


def test_configuration_page_names_every_flag_and_variable() -> None:
    page = render_configuration()
    options = setting_flags(_subcommand(_parser(), "serve"))
    assert set(options) == set(Settings.model_fields)
    rows = [line for line in page.splitlines() if line.startswith("| `--")]
    assert len(rows) == len(Settings.model_fields)
    for row, (name, field) in zip(rows, Settings.model_fields.items(), strict=True):
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

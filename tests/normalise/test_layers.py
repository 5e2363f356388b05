"""The package reads top-down: each module imports only the modules below it (the order of
service/normalise/__init__.py's docstring), and outside the package only the wire models, the
native reader's loader (wire/jsonrows.native: expert_routes' one-pass checks), the error table, the
job types and the engine contract (MoeShape). Read from the source with ast, so nothing is imported
to check it."""

from __future__ import annotations

import ast
from pathlib import Path

import service.normalise

PACKAGE = Path(service.normalise.__file__).parent
# top to bottom
ORDER = ["__init__", "limits", "plan", "distribution", "ragged", "padded", "grouped", "expert_routes", "rows"]
OUTSIDE = {
    "service.core.errors",
    "service.core.jobs",
    "service.wire.schemas",
    "service.wire.jsonrows",
    "service.engine.contract",
}


def imported(module: str) -> set[str]:
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {name for name in names if name == "service" or name.startswith("service.")}


def test_every_module_has_a_place_in_the_order() -> None:
    assert sorted(path.stem for path in PACKAGE.glob("*.py")) == sorted(ORDER)
    assert [line.split()[0] for line in _docstring_table()] == ORDER


def test_each_module_imports_only_modules_below_it() -> None:
    for k, module in enumerate(ORDER):
        names = imported(module)
        inside = {
            name.removeprefix("service.normalise.") for name in names if name.startswith("service.normalise")
        }
        assert "service.normalise" not in inside, f"{module} imports the package it is part of"
        above = [name for name in inside if ORDER.index(name) <= k]
        assert not above, f"{module} imports {above}, which are not below it"
        assert names - {f"service.normalise.{name}" for name in inside} <= OUTSIDE, module
    assert imported("rows") == {"service.core.errors", "service.core.jobs"}


def _docstring_table() -> list[str]:
    """The module lines of the package docstring: four spaces, a module name, two spaces, its role."""
    doc = ast.get_docstring(ast.parse((PACKAGE / "__init__.py").read_text())) or ""
    return [line.strip() for line in doc.splitlines() if line.startswith("    ") and "  " in line.strip()]

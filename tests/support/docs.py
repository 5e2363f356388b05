"""Reading the docs in tests: docs/hooks.py (the site's MkDocs hooks, not a package) loaded as a module,
and a markdown page's fenced blocks and console commands."""

from __future__ import annotations

import importlib.util
import re
import sys
from types import ModuleType

from tests.support import ROOT


def hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as mkdocs loads a hook (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, re.MULTILINE | re.DOTALL)


def console_commands(block: str) -> list[tuple[str, str]]:
    """(command, expected output) pairs of a console block: `$ ` lines with their `\\` continuations."""
    pairs: list[tuple[str, str]] = []
    lines = block.splitlines()
    i = 0
    while i < len(lines):
        assert lines[i].startswith("$ "), f"not a command: {lines[i]!r}"
        command = [lines[i][2:]]
        while command[-1].endswith("\\") or "".join(command).count("'") % 2:
            i += 1
            command.append(lines[i])
        i += 1
        output = []
        while i < len(lines) and not lines[i].startswith("$ "):
            output.append(lines[i])
            i += 1
        pairs.append(("\n".join(command), "\n".join(output)))
    return pairs

"""docs/configuration.md, generated from `Settings` and the command line, so it cannot drift.

`python -m service config-docs --output docs/configuration.md` (`make config-docs`) writes it; a test
and the docs build fail when the committed page differs from what this renders.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from service.settings import Settings

HEADER = """\
<!-- Generated from service/settings.py by `make config-docs`: do not edit by hand. -->
# Configuration

Every setting is a flag of `python -m service serve` and an environment variable `LOGPROBD_<NAME>`;
the flag wins. In a container or the Helm chart, use the environment (`server.extraEnv`). Keys are
better given as the environment or a file than as flags: command lines are visible to other users.
What the kernel options do, and what they were measured to save, is in
[Performance](performance.md#kernel-options).

| flag | environment | default | meaning |
| --- | --- | --- | --- |
"""


def serve_options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The `serve` subcommand's options by destination (the Settings field name)."""
    for action in parser._actions:  # argparse exposes subparsers only through this
        if isinstance(action, argparse._SubParsersAction):
            serve: argparse.ArgumentParser = action.choices["serve"]
            return {a.dest: a for a in serve._actions if a.option_strings and a.dest != "help"}
    raise LookupError("the parser has no serve subcommand")


def _default(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, SecretStr):
        return "set"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


def _flag(action: argparse.Action) -> str:
    if action.choices:
        return f"`{action.option_strings[0]} {{{','.join(map(str, action.choices))}}}`"
    metavar = getattr(action.type, "__name__", "str").upper()
    return f"`{action.option_strings[0]} {'PATH' if metavar == 'PATH' else metavar}`"


def _cell(text: str) -> str:
    """Escapes the pipes of prose (GitHub and Python-Markdown agree there; code cells have none)."""
    return text.replace("|", "\\|").replace("\n", " ")


def render_configuration() -> str:
    from service.__main__ import _parser

    options = serve_options(_parser())
    rows = []
    for name, field in Settings.model_fields.items():
        env = f"LOGPROBD_{name.upper()}"
        rows.append(
            f"| {_flag(options[name])} | `{env}` | {_cell(_default(field.default))} "
            f"| {_cell(field.description or '')} |\n"
        )
    return HEADER + "".join(rows)


def write(path: Path) -> None:
    path.write_text(render_configuration())

"""docs/configuration.md, generated from `Settings` and the command line, so it cannot drift.

`python -m service config-docs --output docs/configuration.md` (`make config-docs`) writes it; a test
and the docs build fail when the committed page differs from what this renders.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from service.flags import BooleanFlag, UsageParser, add_setting_flags, metavar, setting_flags
from service.settings import GROUPS, Settings

HEADER = """\
<!-- Generated from service/settings.py by `make config-docs`: do not edit by hand. -->
# Configuration

Every setting is a flag of `python -m service serve` and an environment variable `LOGPROBD_<NAME>`;
the flag wins. A boolean flag is given alone to turn its setting on, as `--no-<name>` to turn it
off, or with a value read as the environment's (`true`/`false`, `1`/`0`, `yes`/`no`, `on`/`off`).
A value the service refuses stops the start with one line naming the flag or the variable (exit
status 2). In a container or the Helm chart, use the environment (`server.extraEnv`). Keys are
better given as the environment or a file than as flags: command lines are visible to other users.
What the kernel options do, and what they were measured to save, is in
[Performance](performance.md#kernel-options). `python -m service serve --help` lists the same
settings in the same groups.
"""
TABLE = "| flag, environment variable | default | meaning |\n| --- | --- | --- |\n"


def _default(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, SecretStr):
        return "set"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


def _flag(action: argparse.Action) -> str:
    if isinstance(action, BooleanFlag):
        return ", ".join(f"`{option}`" for option in action.option_strings)
    if action.choices:
        return f"`{action.option_strings[0]} {{{','.join(map(str, action.choices))}}}`"
    return f"`{action.option_strings[0]} {metavar(action.dest)}`"


def _cell(text: str) -> str:
    """Escapes the pipes of prose (GitHub and Python-Markdown agree there; code cells have none)."""
    return text.replace("|", "\\|").replace("\n", " ")


def render_configuration() -> str:
    parser = UsageParser(prog="python -m service serve")
    add_setting_flags(parser)
    options = setting_flags(parser)
    sections = []
    for group in GROUPS:
        rows = []
        for name in group.names:
            field = Settings.model_fields[name]
            rows.append(
                f"| {_flag(options[name])}<br>`LOGPROBD_{name.upper()}` | {_cell(_default(field.default))} "
                f"| {_cell(field.description or '')} |\n"
            )
        sections.append(
            f"\n## {group.title[0].upper()}{group.title[1:]}\n\n{group.about}\n\n{TABLE}{''.join(rows)}"
        )
    return HEADER + "".join(sections)


def write(path: Path) -> None:
    path.write_text(render_configuration())

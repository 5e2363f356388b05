"""python -m service serve|openapi|config-docs: parse the command line, build Settings, run. No logic here."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, get_args

from service.settings import Settings


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m service", description="logprobd scoring service")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the HTTP server")
    for name, field in Settings.model_fields.items():
        choices = get_args(field.annotation) or None
        if choices and not all(isinstance(c, str) for c in choices):
            choices = None
        annotation = field.annotation
        kind: Any = (
            Path if Path in get_args(annotation) else annotation if annotation in (int, float) else str
        )
        serve.add_argument(
            f"--{name.replace('_', '-')}",
            dest=name,
            type=kind,
            choices=choices,
            default=None,
            help=f"{field.description} [env LOGPROBD_{name.upper()}; default {field.default}]",
        )
    openapi = commands.add_parser("openapi", help="print the OpenAPI document as YAML")
    openapi.add_argument("--output", type=Path, default=None)
    config_docs = commands.add_parser("config-docs", help="print docs/configuration.md, from the settings")
    config_docs.add_argument("--output", type=Path, default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command in ("openapi", "config-docs"):
        if args.command == "openapi":
            from service.openapi import render_openapi as render
        else:
            from service.configdoc import render_configuration as render
        text = render()
        if args.output is None:
            sys.stdout.write(text)
        else:
            args.output.write_text(text)
        return 0
    overrides = {k: v for k, v in vars(args).items() if k != "command" and v is not None}
    settings = Settings(**overrides)
    from service.server import serve

    return serve(settings)


if __name__ == "__main__":
    sys.exit(main())

"""python -m service serve|openapi|config-docs: parse the command line, build Settings, run. No logic here."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from service.flags import SettingsHelp, UsageParser, add_setting_flags, settings_from


def _parser() -> argparse.ArgumentParser:
    parser = UsageParser(prog="python -m service", description="logprobd scoring service")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="run the HTTP server",
        usage="%(prog)s [--SETTING [VALUE] ...] (listed below)",
        formatter_class=SettingsHelp,
    )
    add_setting_flags(serve)
    openapi = commands.add_parser("openapi", help="print the OpenAPI document as YAML")
    openapi.add_argument("--output", type=Path, default=None)
    config_docs = commands.add_parser("config-docs", help="print docs/configuration.md, from the settings")
    config_docs.add_argument("--output", type=Path, default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command in ("openapi", "config-docs"):
        if args.command == "openapi":
            from service.http.openapi import render_openapi as render
        else:
            from service.configdoc import render_configuration as render
        text = render()
        if args.output is None:
            sys.stdout.write(text)
        else:
            args.output.write_text(text)
        return 0
    settings = settings_from(_subcommand(parser, "serve"), args)
    from service.http.server import serve

    return serve(settings)


def _subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:  # argparse exposes subparsers only through this
        if isinstance(action, argparse._SubParsersAction):
            found: argparse.ArgumentParser = action.choices[name]
            return found
    raise LookupError(f"the parser has no {name} subcommand")


if __name__ == "__main__":
    sys.exit(main())

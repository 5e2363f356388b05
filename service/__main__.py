"""python -m service serve|openapi|config-docs: parse the command line, build Settings, run. No logic here.

The server's stack (pydantic, fastapi, torch, ...) is the `server` extra: where a plain install has the
client alone, every command says so in one line and exits 2 instead of an import traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

NOT_INSTALLED = (
    "python -m service: the server is not installed here ({error}); "
    "pip install 'logprobd[server]' (a plain install is the client alone)\n"
)


def _parser() -> argparse.ArgumentParser:
    from service.flags import SettingsHelp, UsageParser, add_setting_flags

    parser = UsageParser(prog="python -m service", description="logprobd scoring service")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="run the HTTP server",
        usage="%(prog)s [--SETTING [VALUE] ...] (listed below)",
        description="Serve the scoring API over HTTP. Each setting below is also LOGPROBD_<NAME> in the "
        "environment (the flag wins); docs/configuration.md lists them in the same groups.",
        formatter_class=SettingsHelp,
    )
    add_setting_flags(serve)
    openapi = commands.add_parser("openapi", help="print the OpenAPI document as YAML")
    openapi.add_argument("--output", type=Path, default=None)
    config_docs = commands.add_parser("config-docs", help="print docs/configuration.md, from the settings")
    config_docs.add_argument("--output", type=Path, default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        parser = _parser()
        args = parser.parse_args(argv)
        command = _command(parser, args)
    except ModuleNotFoundError as error:  # only the imports: a run's own errors are the server's to report
        if (error.name or "service").partition(".")[0] == "service":
            raise
        sys.stderr.write(NOT_INSTALLED.format(error=error))
        return 2
    return command()


def _command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Callable[[], int]:
    """The command asked for, its modules imported (the server's stack), ready to run."""
    if args.command == "serve":
        from service.flags import named, settings_from

        serve_parser = _subcommand(parser, "serve")
        settings = settings_from(serve_parser, args)  # a bad value exits before the imports
        from service.http.listen import Refused, preflight

        try:  # a missing model or a taken port: one line, before anything loads
            listener = preflight(settings)
        except Refused as refused:
            serve_parser.error(f"{named(refused.setting, args)}: {refused.reason}")
        from service.http.server import serve

        return lambda: serve(settings, listener)
    if args.command == "openapi":
        from service.http.openapi import render_openapi as render
    else:
        from service.configdoc import render_configuration as render
    return lambda: _write(render(), args.output)


def _write(text: str, output: Path | None) -> int:
    if output is None:
        sys.stdout.write(text)
    else:
        output.write_text(text)
    return 0


def _subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:  # argparse exposes subparsers only through this
        if isinstance(action, argparse._SubParsersAction):
            found: argparse.ArgumentParser = action.choices[name]
            return found
    raise LookupError(f"the parser has no {name} subcommand")


if __name__ == "__main__":
    sys.exit(main())

"""The `serve` command line: one flag per `Settings` field, and the `Settings` the flags build.

`add_setting_flags(parser)` adds `--<name>` for each field (a boolean also as `--no-<name>`);
`settings_from(parser, args)` builds `Settings` from the flags given over the LOGPROBD_* environment.
Every refused value is one line on stderr naming the flag or the variable, exit status 2. Both
`python -m service serve` and docs/configuration.md (service/configdoc.py) are built from here.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn, get_args

from pydantic import SecretStr, TypeAdapter, ValidationError

from service.settings import GROUPS, Settings


class UsageParser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line, `<prog>: error: <reason>`, exit status 2 (the
    usage of `serve`, one flag per setting, is too long to repeat under every mistake)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


class BooleanFlag(argparse.Action):
    """`--x` alone sets True, `--x VALUE` the value read as the environment reads it (true/false,
    1/0, yes/no, on/off), `--no-x` sets False."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        negated = [f"--no-{option[2:]}" for option in option_strings]
        super().__init__([*option_strings, *negated], dest, nargs="?", metavar="BOOL", **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        if option_string is not None and option_string.startswith("--no-"):
            if values is not None:
                parser.error(f"argument {option_string}: takes no value (got {values!r})")
            setattr(namespace, self.dest, False)
            return
        if values is None:
            setattr(namespace, self.dest, True)
            return
        try:
            setattr(namespace, self.dest, TypeAdapter(bool).validate_python(values))
        except ValidationError:
            parser.error(
                f"argument {option_string}: {values!r} is not a boolean (give the flag alone, "
                f"{option_string} true|false, or --no-{self.dest.replace('_', '-')})"
            )


class SettingsHelp(argparse.HelpFormatter):
    """Help that shows a boolean as `--x [BOOL], --no-x` (the negation takes no value)."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if isinstance(action, BooleanFlag):
            on, off = action.option_strings
            return f"{on} [BOOL], {off}"
        return super()._format_action_invocation(action)


def flag(name: str) -> str:
    return f"--{name.replace('_', '-')}"


def metavar(name: str) -> str:
    """What a setting's value is, as --help and docs/configuration.md show it: PATH, INT, FLOAT, STR."""
    annotation = Settings.model_fields[name].annotation
    if Path in get_args(annotation):
        return "PATH"
    optional = [a for a in get_args(annotation) if a is not type(None)]  # int | None reads as INT
    kind = optional[0] if len(optional) == 1 and optional[0] in (int, float) else _kind(annotation)
    return str(getattr(kind, "__name__", "str")).upper()


def _kind(annotation: Any) -> Any:
    return Path if Path in get_args(annotation) else annotation if annotation in (int, float) else str


def add_setting_flags(parser: argparse.ArgumentParser) -> None:
    """`--<name>` for every field of Settings, under its group's heading (settings.GROUPS); unset
    flags stay None (the environment or default)."""
    for group in GROUPS:
        section = parser.add_argument_group(f"{group.title} settings", group.about)
        for name in group.names:
            _add_flag(section, name)


def _add_flag(section: argparse._ArgumentGroup, name: str) -> None:
    field = Settings.model_fields[name]
    annotation = field.annotation
    default = "unset" if field.default is None else field.default
    help_text = f"{field.description} [env LOGPROBD_{name.upper()}; default {default}]"
    if annotation is bool:
        section.add_argument(flag(name), dest=name, action=BooleanFlag, default=None, help=help_text)
        return
    choices = get_args(annotation) or None
    if choices and not all(isinstance(c, str) for c in choices):
        choices = None
    section.add_argument(
        flag(name),
        dest=name,
        type=_kind(annotation),
        choices=choices,
        default=None,
        help=help_text,
        metavar=None if choices else metavar(name),
    )


def setting_flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The parser's setting flags by destination (the Settings field name)."""
    return {a.dest: a for a in parser._actions if a.dest in Settings.model_fields and a.option_strings}


def named(name: str, args: argparse.Namespace) -> str:
    """Where setting `name` came from, as a one-line error names it: `argument --x` (the command
    line), `LOGPROBD_X` (the environment) or `--x` (its default)."""
    if getattr(args, name, None) is not None:
        return f"argument {flag(name)}"
    variable = f"LOGPROBD_{name.upper()}"
    return variable if variable in {key.upper() for key in os.environ} else flag(name)


def settings_from(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Settings:
    """Settings from the flags given (over the environment); a refused value exits through
    `parser.error`, naming the flag or the LOGPROBD_* variable it came from."""
    given = {k: v for k, v in vars(args).items() if k in Settings.model_fields and v is not None}
    try:
        return Settings(**given)
    except ValidationError as exc:
        parser.error("; ".join(_reason(error, given) for error in exc.errors()))


def _reason(error: Any, given: dict[str, Any]) -> str:
    """One pydantic error as `argument --flag: reason (got value)` or `LOGPROBD_NAME: reason`."""
    message = str(error.get("msg", "invalid")).removeprefix("Value error, ")
    loc = error.get("loc", ())
    name = loc[0] if loc and isinstance(loc[0], str) else None
    if name not in Settings.model_fields:  # a validator of several fields: its message names them
        return f"settings: {message}"
    assert name is not None
    secret = Settings.model_fields[name].annotation in (SecretStr, SecretStr | None)
    shown = "" if secret or "input" not in error else f" (got {error['input']!r})"
    where = f"argument {flag(name)}" if name in given else f"LOGPROBD_{name.upper()}"
    return f"{where}: {message[:1].lower()}{message[1:]}{shown}"

"""The serve command line: every boolean setting is a flag (`--x`, `--no-x`, `--x true|false`), the
environment reads as before, and every value the service refuses is one line naming the flag or
the variable, exit status 2, from a real `python -m service serve`."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from pydantic import ValidationError, model_validator

from service.__main__ import _parser, _subcommand
from service.flags import _reason, settings_from
from service.settings import Settings
from tests.support import ROOT

BOOLEANS = [name for name, field in Settings.model_fields.items() if field.annotation is bool]


def settings(*argv: str) -> Settings:
    parser = _parser()
    return settings_from(_subcommand(parser, "serve"), parser.parse_args(["serve", *argv]))


def test_the_boolean_settings_are_the_ones_the_docs_name() -> None:
    assert BOOLEANS == ["batch_invariant", "share_prefixes", "prefix_cache", "auth_all_routes", "docs_ui"]


@pytest.mark.parametrize("name", BOOLEANS)
def test_a_boolean_setting_is_a_flag(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in os.environ:
        if variable.startswith("LOGPROBD_"):
            monkeypatch.delenv(variable)
    flag = f"--{name.replace('_', '-')}"
    negated = f"--no-{name.replace('_', '-')}"
    default = Settings.model_fields[name].default
    assert getattr(settings(), name) is default
    assert getattr(settings(flag), name) is True
    assert getattr(settings(negated), name) is False
    assert getattr(settings(flag, "--port", "9001"), name) is True  # alone, before another flag
    assert settings(flag, "--port", "9001").port == 9001
    for word, value in [("true", True), ("false", False), ("1", True), ("0", False), ("no", False)]:
        assert getattr(settings(flag, word), name) is value
    assert getattr(settings(flag, negated), name) is False  # the last one wins, as for any flag
    # the environment as before; a flag overrides it either way
    monkeypatch.setenv(f"LOGPROBD_{name.upper()}", "false")
    assert getattr(settings(), name) is False
    assert getattr(settings(flag), name) is True
    monkeypatch.setenv(f"LOGPROBD_{name.upper()}", "true")
    assert getattr(settings(), name) is True
    assert getattr(settings(negated), name) is False


def serve(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LOGPROBD_")}
    return subprocess.run(
        [sys.executable, "-m", "service", "serve", *argv],
        cwd=ROOT,
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (
            ["--batch-invariant", "maybe"],
            "argument --batch-invariant: 'maybe' is not a boolean (give the flag alone, "
            "--batch-invariant true|false, or --no-batch-invariant)",
        ),
        (["--no-share-prefixes", "yes"], "argument --no-share-prefixes: takes no value (got 'yes')"),
        (["--port", "70000"], "argument --port: input should be less than or equal to 65535 (got 70000)"),
        (["--port", "eighty"], "argument --port: invalid int value: 'eighty'"),
        (
            ["--batch-wait-ms", "-1"],
            "argument --batch-wait-ms: input should be greater than or equal to 0 (got -1.0)",
        ),
        (
            ["--dtype", "float64"],
            "argument --dtype: invalid choice: 'float64' "
            "(choose from 'auto', 'float32', 'bfloat16', 'float16')",
        ),
        (
            ["--max-sequence-tokens", "many"],
            "argument --max-sequence-tokens: input should be a valid integer, unable to parse string as an "
            "integer (got 'many')",
        ),
        (
            ["--weights-version", "step 1"],
            "argument --weights-version: string should match pattern '^[A-Za-z0-9._:+/@-]+$' (got 'step 1')",
        ),
    ],
)  # fmt: skip
def test_a_refused_value_is_one_line_naming_the_flag(argv: list[str], line: str) -> None:
    done = serve(*argv)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr == f"python -m service serve: error: {line}\n"


def test_an_unknown_flag_is_one_line() -> None:
    done = serve("--batch-invariants")
    assert done.returncode == 2
    assert done.stderr == "python -m service: error: unrecognized arguments: --batch-invariants\n"


def test_a_refused_environment_value_names_the_variable() -> None:
    done = serve(env={"LOGPROBD_SHARE_MIN_TOKENS": "0", "LOGPROBD_BATCH_INVARIANT": "maybe"})
    assert done.returncode == 2
    assert done.stderr == (
        "python -m service serve: error: LOGPROBD_BATCH_INVARIANT: input should be a valid boolean, "
        "unable to interpret input (got 'maybe'); LOGPROBD_SHARE_MIN_TOKENS: input should be greater "
        "than or equal to 1 (got '0')\n"
    )


def test_a_combination_a_validator_refuses_is_its_message() -> None:
    class Keyed(Settings):
        @model_validator(mode="after")
        def _refuse(self) -> Keyed:
            raise ValueError("--api-keys and --api-keys-file are exclusive")

    with pytest.raises(ValidationError) as refused:
        Keyed(api_keys="s3cret")
    assert [_reason(e, {}) for e in refused.value.errors()] == [
        "settings: --api-keys and --api-keys-file are exclusive"
    ]


def test_a_refused_key_is_named_but_never_shown() -> None:
    with pytest.raises(ValidationError) as refused:
        Settings(api_keys=12345)
    (error,) = refused.value.errors()
    assert _reason(error, {"api_keys": 12345}) == "argument --api-keys: input should be a valid string"

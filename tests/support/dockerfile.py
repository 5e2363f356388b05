"""The Dockerfile read as its instructions, for the deploy tests (no Docker engine): each instruction
with its arguments, the build arguments' defaults, and the image's requirements step run here."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.support import ROOT

DOCKERFILE = ROOT / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order; continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(
        line for line in DOCKERFILE.read_text().splitlines() if not line.lstrip().startswith("#")
    ))  # fmt: skip
    found = []
    for line in text.splitlines():
        if line.strip():
            keyword, _, rest = line.strip().partition(" ")
            found.append((keyword.upper(), rest.strip()))
    return found


def build_args() -> dict[str, str]:
    """Every ARG with its default."""
    return dict(rest.split("=", 1) for kw, rest in instructions() if kw == "ARG" and "=" in rest)


def one(keyword: str) -> str:
    """The arguments of the one `keyword` instruction."""
    (args,) = [rest for kw, rest in instructions() if kw == keyword]
    return args


REQUIREMENTS_STEP = "pip install -c constraints.txt -r"
TORCH_STEP = (
    'pip install -c constraints.txt ${TORCH_FIND_LINKS:+--find-links "${TORCH_FIND_LINKS}"} "${TORCH}"'
)


def requirements_step(extras: str | None) -> list[str]:
    """The image's requirements step, run here on pyproject.toml: what it passes to pip for EXTRAS
    (None: the Dockerfile's default)."""
    args = build_args()
    (step,) = [rest for kw, rest in instructions() if kw == "RUN" and REQUIREMENTS_STEP in rest]
    code = re.search(r'python -c "(.*?)" >', step)
    assert code, step
    env = {"EXTRAS": args["EXTRAS"] if extras is None else extras, "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", code.group(1)], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    return [line for line in out.stdout.split("\n") if line]

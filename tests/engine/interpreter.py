"""Triton kernel tests on CPU: the `test_interpreter_*` cases of a file, in Triton's interpreter.

triton reads TRITON_INTERPRET when it is imported (its own tl.sum, tl.zeros, ... are jitted then),
and a pytest process has imported it long before these tests (transformers imports torch._dynamo,
which imports triton). So a file's `test_interpreter_*` cases run in a fresh pytest process started
with TRITON_INTERPRET=1 by `run_interpreter_cases`, and skip (`only_interpreted`) elsewhere.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
only_interpreted = pytest.mark.skipif(
    not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 process of test_kernel_cases_in_a_fresh_process"
)


def interpreted(args: list[str]) -> subprocess.CompletedProcess[str]:
    """`python args...` in a fresh process with TRITON_INTERPRET=1 (its output captured)."""
    return subprocess.run(
        [sys.executable, *args],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def run_interpreter_cases(test_file: str) -> None:
    """Run `test_file`'s test_interpreter_* cases under TRITON_INTERPRET=1; all must run and pass."""
    pytest.importorskip("triton", reason="the CPU kernel tests run in Triton's interpreter")
    if INTERPRETED:
        pytest.skip("this is the interpreter process")
    plugins = ["--noconftest", "-p", "tests.support.needs", "-p", "no:cacheprovider"]  # the markers only
    result = interpreted(["-m", "pytest", test_file, *plugins, "-q", "-k", "test_interpreter"])
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-4000:]
    assert " passed" in result.stdout
    assert "skipped" not in result.stdout, result.stdout[-4000:]

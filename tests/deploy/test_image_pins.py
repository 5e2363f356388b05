"""The image's pinned stack (docker/constraints.txt, which the Dockerfile installs with `-c`) is the one
BENCHMARKS.md's latest run measured, and it resolves, wheels only, for the image's platform and Python.

torch's pin is the Dockerfile's TORCH build argument (CI builds the same Dockerfile with the CPU
build instead, docker/ci-image.sh). The resolution asks PyPI (`pip install --dry-run --report`):
torch's own CUDA index (download.pytorch.org) is not reachable from CI. PyPI's torch 2.11.0 Linux
x86_64 wheel is the CUDA 13.0 build (it depends on the nvidia-*-cu13 / CUDA 13 libraries, checked
below), which torch's cu130 index serves as 2.11.0+cu130. Platforms: every manylinux tag that pip on
Ubuntu 24.04 (glibc 2.39) accepts, manylinux_2_28 among them (pip does not widen an explicit
--platform to older glibc tags, and nvidia-cudnn-cu13 ships manylinux_2_27 wheels only).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from tests.support import ROOT
from tests.support.dockerfile import build_args, requirements_step

CONSTRAINTS = ROOT / "docker" / "constraints.txt"
PLATFORMS = ["manylinux2014_x86_64", *(f"manylinux_2_{minor}_x86_64" for minor in range(17, 40))]
PYTHON = "3.12"


def pins() -> dict[str, str]:
    found = {}
    for text in CONSTRAINTS.read_text().splitlines():
        line = text.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"not an exact pin: {line}"
            found[name.strip().lower()] = version.strip()
    return found


def latest_run() -> dict[str, str]:
    """The versions BENCHMARKS.md's "Latest run" section names."""
    text = (ROOT / "BENCHMARKS.md").read_text()
    section = text.split("## Latest run", 1)[1].split("\n## ", 1)[0]
    section = " ".join(section.split())  # the bullet wraps lines
    patterns = {
        "torch": r"torch (\S+?),",
        "transformers": r"transformers (\S+?),",
        "triton": r"triton (\S+?),",
        "python": r"Python (\S+?),",
        "flash-attn-4": r"flash-attn 4 (\S+?),",
        "quack-kernels": r"quack-kernels (\S+?) on",
        "nvidia-cutlass-dsl": r"nvidia-cutlass-dsl (\S+?)\)",
    }
    found = {}
    for name, pattern in patterns.items():
        match = re.search(pattern, section)
        assert match, (name, section[:300])
        found[name] = match.group(1)
    return found


def test_the_latest_run_is_read() -> None:
    assert latest_run() == {
        "torch": "2.11.0+cu130", "transformers": "5.17.0", "triton": "3.6.0", "python": "3.12.3",
        "flash-attn-4": "4.0.0b36", "quack-kernels": "0.6.4", "nvidia-cutlass-dsl": "4.6.2",
    }  # fmt: skip


def test_pins_are_the_latest_benchmark_runs() -> None:
    run, pinned = latest_run(), pins()
    torch_version, _, cuda = run["torch"].partition("+")
    assert set(pinned) == {"transformers", "flash-attn-4", "quack-kernels", "nvidia-cutlass-dsl"}
    assert build_args()["TORCH"] == f"torch=={torch_version}"  # torch's pin: the Dockerfile's default
    for name in ["transformers", "flash-attn-4", "quack-kernels", "nvidia-cutlass-dsl"]:
        assert pinned[name] == run[name], name
    latest = json.loads((ROOT / "benchmarks" / "results" / "latest.json").read_text())["versions"]
    assert latest["torch"] == run["torch"]
    assert latest["transformers"] == run["transformers"]
    # the CUDA of the benchmark's torch build is the base image's (cu130 <-> nvidia/cuda:13.0.x)
    args = build_args()
    image = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-runtime-ubuntu24\.04", args["BASE_IMAGE"])
    assert image, args["BASE_IMAGE"]
    assert cuda == f"cu{image.group(1)}{image.group(2)}"
    assert run["python"].startswith(PYTHON + ".")  # Ubuntu 24.04's python3.12


def test_the_hopper_extra_admits_the_pins() -> None:
    """pyproject's `hopper` extra and the image's pins agree (the extra is what `pip install
    logprobd[hopper]` gets outside the image)."""
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["hopper"]
    from packaging.requirements import Requirement

    pinned = pins()
    for line in extra:
        requirement = Requirement(line)
        if requirement.name == "logprobd":  # `logprobd[server]`: the package's own server extra
            continue
        assert requirement.specifier.contains(pinned[requirement.name], prereleases=True), line


def resolve(requirements: list[str], target: Path) -> dict[str, Any]:
    """pip's resolution for the image's platform and Python, wheels only, from PyPI alone."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull  # no local wheel directories or indexes: what PyPI serves
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
         "--report", "-", *platforms, "--python-version", PYTHON, "--only-binary=:all:",
         "--target", str(target), "--index-url", "https://pypi.org/simple",
         "-c", str(CONSTRAINTS), *requirements],
        capture_output=True, text=True, env=env, check=False, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report: dict[str, Any] = json.loads(done.stdout)
    return report


@pytest.mark.slow
def test_the_image_requirements_resolve_to_wheels(tmp_path: Path) -> None:
    """torch, then the dependencies and default extras as the Dockerfile lists them, under the pins:
    every one has a wheel for manylinux x86_64 / CPython 3.12, and the pins are what resolves."""
    requirements = [build_args()["TORCH"], *requirements_step(None)]
    assert "nvidia-cutlass-dsl[cu13]" in requirements
    report = resolve(requirements, tmp_path / "target")
    versions = {
        i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"] for i in report["install"]
    }
    for name, version in {**pins(), "torch": latest_run()["torch"].partition("+")[0]}.items():
        assert versions[name] == version, name
    assert versions["triton"] == latest_run()["triton"]  # torch 2.11.0's own pin
    assert "liger-kernel" in versions
    # PyPI's torch 2.11.0 is the CUDA 13 build: its CUDA libraries are the 13.x ones
    (torch,) = [i for i in report["install"] if i["metadata"]["name"] == "torch"]
    cuda_libs = [r for r in torch["metadata"]["requires_dist"] if r.startswith(("nvidia-", "cuda-"))]
    assert any("cu13" in r or "cuda-toolkit" in r for r in cuda_libs), cuda_libs
    assert not any("cu12" in r for r in cuda_libs), cuda_libs
    assert versions["nvidia-cuda-runtime"].startswith("13.")
    assert "nvidia-cutlass-dsl-libs-cu13" in versions
    assert all(i["download_info"]["url"].endswith(".whl") for i in report["install"])

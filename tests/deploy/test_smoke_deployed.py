"""benchmarks/smoke_deployed.py starts the service as the image and the chart do: its environment,
command and settings are the Dockerfile's and the rendered chart's defaults; and the script runs (on
this CPU host, with only the device overridden) with every check but the CUDA one passing."""

from __future__ import annotations

import json
import re

from benchmarks import smoke_deployed
from tests.support.chart import VALUES_FILES, container, env_of, render
from tests.support.dockerfile import instructions, one
from tests.support.servers import free_port

DEFAULTS = next(path for path in VALUES_FILES if path.name == "default-values.yaml")


def test_the_environment_is_the_images_and_the_charts() -> None:
    dockerfile_env: dict[str, str] = {}
    for keyword, rest in instructions():
        if keyword == "ENV":
            dockerfile_env.update(re.findall(r"(\w+)=(\S+)", rest))
    assert smoke_deployed.ENV.items() <= dockerfile_env.items()
    assert set(dockerfile_env) - set(smoke_deployed.ENV) == {
        "DEBIAN_FRONTEND", "PIP_NO_CACHE_DIR", "PIP_DISABLE_PIP_VERSION_CHECK", "PATH"
    }  # fmt: skip
    manifests = render(DEFAULTS)
    assert env_of(manifests) == smoke_deployed.CHART_ENV
    entrypoint, cmd = json.loads(one("ENTRYPOINT")), json.loads(one("CMD"))
    assert ["python", *smoke_deployed.COMMAND] == entrypoint + cmd
    assert container(manifests)["args"] == cmd


def test_the_script_runs_on_cpu() -> None:
    report = smoke_deployed.smoke(
        None, free_port(), {"LOGPROBD_DEVICE": "cpu", "LOGPROBD_DRAIN_SECONDS": "1"}
    )
    checks = report["checks"]
    assert checks.pop("on_cuda") is False
    assert checks == dict.fromkeys(checks, True)
    assert len(checks) == 12
    assert report["exit_code"] == 0

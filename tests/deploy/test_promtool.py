"""The chart's PrometheusRule under promtool (the Debian/Ubuntu package `prometheus`): `promtool check
rules` passes it, and `promtool test rules` unit tests every alert on synthetic series: it fires on
series that should fire it (once its `for` has passed, not before) and stays silent on series that
should not (below the threshold, another release's series, a blip shorter than `for`).

The expected annotations are the rendered ones with `{{ $value ... }}` replaced by the value written
here, worked out by hand from the series (e.g. 10 of 110 requests per minute answered 429: 9.091 %).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.chart import NAMESPACE, render
from tests.support.prometheus import MONITORED, binary, rule_groups

SERVICE = "rl-logprobd"
OURS = f'namespace="{NAMESPACE}", service="{SERVICE}"'


def series(name: str, values: str, **labels: str) -> dict[str, str]:
    extra = "".join(f', {k}="{v}"' for k, v in labels.items())
    return {"series": f"{name}{{{OURS}{extra}}}", "values": values}


def requests(outcome: str, values: str, pod: str = "rl-logprobd-0") -> dict[str, str]:
    return series("logprobd_requests_total", values, pod=pod, outcome=outcome)


def pushes(outcome: str, values: str) -> dict[str, str]:
    return series("logprobd_weights_pushes_total", values, pod="a", target="policy", outcome=outcome)


def bucket(le: str, values: str) -> dict[str, str]:
    return series("logprobd_request_duration_seconds_bucket", values, pod="rl-logprobd-0", le=le)


# alert -> (cases that fire it: (series, when it fires, when it must not yet, its $value as the
# annotations print it), cases that must stay silent: (what, series))
Fire = tuple[list[dict[str, str]], str, str, str]
CASES: dict[str, tuple[list[Fire], list[tuple[str, list[dict[str, str]]]]]] = {
    "LogprobdWeightsDiverged": (
        [(
            [series("logprobd_weights_version", "1x30", pod="a", target="policy", version="v1"),
             series("logprobd_weights_version", "1x30", pod="b", target="policy", version="v2")],
            "15m", "8m", "2",
        )],
        [
            ("one version", [
                series("logprobd_weights_version", "1x30", pod="a", target="policy", version="v2"),
                series("logprobd_weights_version", "1x30", pod="b", target="policy", version="v2")]),
            ("a rollout that converges within 10m", [
                series("logprobd_weights_version", "1x30", pod="a", target="policy", version="v2"),
                series("logprobd_weights_version", "1x5 stale", pod="b", target="policy", version="v1"),
                series("logprobd_weights_version", "_x5 1x25", pod="b", target="policy", version="v2")]),
            ("reference weights may differ from the policy's", [
                series("logprobd_weights_version", "1x30", pod="a", target="policy", version="v2"),
                series("logprobd_weights_version", "1x30", pod="a", target="reference", version="r1")]),
        ],
    ),
    "LogprobdWeightPushFailing": (
        [([pushes("dropped", "0x10 1x20")], "12m", "5m", "")],
        [
            ("pushes applied", [pushes("applied", "0+1x30"), pushes("dropped", "0x30")]),
            ("another release's push failed", [
                {"series": 'logprobd_weights_pushes_total{namespace="train", service="other", '
                           'outcome="failed"}', "values": "0+1x30"}]),
        ],
    ),
    "LogprobdQueueGrowing": (
        [([series("logprobd_queue_tokens", "300000+1000x40", pod="a")], "30m", "5m", "330k")],
        [
            ("high but flat", [series("logprobd_queue_tokens", "300000x40", pod="a")]),
            ("growing below the threshold", [series("logprobd_queue_tokens", "1000+1000x40", pod="a")]),
        ],
    ),
    "LogprobdThrottling": (
        [([requests("ok", "0+100x30"), requests("overloaded", "0+10x30")], "20m", "8m", "9.091%")],
        [
            ("2 % throttled", [requests("ok", "0+100x30"), requests("overloaded", "0+2x30")]),
            ("another release throttled", [
                requests("ok", "0+100x30"),
                {"series": 'logprobd_requests_total{namespace="train", service="other", '
                           'outcome="overloaded"}', "values": "0+50x30"}]),
        ],
    ),
    "LogprobdServerErrors": (
        [([requests("ok", "0+95x30"), requests("deadline_exceeded", "0+5x30")], "20m", "4m", "5%")],
        [
            ("4xx only", [requests("ok", "0+100x30"), requests("invalid_request", "0+50x30"),
                          requests("overloaded", "0+50x30"), requests("client_disconnected", "0+50x30")]),
            ("0.5 % 5xx", [requests("ok", "0+199x30"), requests("engine_failure", "0+1x30")]),
        ],
    ),
    "LogprobdLatencyHigh": (
        # every request between 60 and 120 s: p99 interpolates to 60 + 0.99 x 60 = 119.4 s
        [([bucket("1", "0x30"), bucket("60", "0x30"), bucket("120", "0+10x30"), bucket("+Inf", "0+10x30")],
          "20m", "8m", "1m 59s")],
        [("every request under 1 s", [
            bucket("1", "0+10x30"), bucket("60", "0+10x30"), bucket("120", "0+10x30"),
            bucket("+Inf", "0+10x30")])],
    ),
    "LogprobdNoReplicaReady": (
        [
            ([series("logprobd_ready", "0x30", pod="a")], "20m", "10m", ""),
            ([series("logprobd_up_of_something_else", "1x30")], "20m", "10m", ""),  # nothing scraped
        ],
        [
            ("one ready", [series("logprobd_ready", "0x30", pod="a"),
                           series("logprobd_ready", "1x30", pod="b")]),
            ("a restart shorter than 15m", [series("logprobd_ready", "1 0x10 1x20", pod="a")]),
        ],
    ),
}  # fmt: skip


def rendered() -> dict[str, Any]:
    return rule_groups(render(MONITORED))


def alerts() -> dict[str, dict[str, Any]]:
    return {r["alert"]: r for g in rendered()["groups"] for r in g["rules"] if "alert" in r}


def rendered_annotations(rule: dict[str, Any], value: str) -> dict[str, str]:
    return {k: re.sub(r"\{\{\s*\$value[^}]*\}\}", value, v) for k, v in rule["annotations"].items()}


def unit_tests(alert: str) -> dict[str, Any]:
    rule = alerts()[alert]
    fire, silent = CASES[alert]
    tests = []
    for input_series, fires_at, not_yet_at, value in fire:
        expected = {"exp_labels": rule["labels"], "exp_annotations": rendered_annotations(rule, value)}
        tests.append({
            "name": f"{alert} fires",
            "interval": "1m",
            "input_series": input_series,
            "alert_rule_test": [
                {"eval_time": not_yet_at, "alertname": alert, "exp_alerts": []},
                {"eval_time": fires_at, "alertname": alert, "exp_alerts": [expected]},
            ],
        })  # fmt: skip
    for what, input_series in silent:
        tests.append({
            "name": f"{alert} silent: {what}",
            "interval": "1m",
            "input_series": input_series,
            "alert_rule_test": [
                {"eval_time": t, "alertname": alert, "exp_alerts": []} for t in ("10m", "20m", "29m")
            ],
        })  # fmt: skip
    return {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": tests}


def promtool(workdir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [binary("promtool"), *args], cwd=workdir, capture_output=True, text=True, check=False, timeout=60
    )


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rendered(), sort_keys=False))
    return tmp_path


def test_promtool_checks_the_rendered_rules(workdir: Path) -> None:
    done = promtool(workdir, "check", "rules", "rules.yaml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in done.stdout


def test_promtool_check_catches_a_bad_rule(workdir: Path) -> None:
    bad = rendered()
    bad["groups"][0]["rules"][0]["expr"] = "sum(rate(logprobd_requests_total[5m])"
    (workdir / "rules.yaml").write_text(yaml.safe_dump(bad))
    assert promtool(workdir, "check", "rules", "rules.yaml").returncode != 0


def test_every_alert_has_unit_tests() -> None:
    assert set(CASES) == set(alerts())


@pytest.mark.parametrize("alert", sorted(CASES))
def test_alert_fires_when_it_should_and_only_then(workdir: Path, alert: str) -> None:
    (workdir / "test.yaml").write_text(yaml.safe_dump(unit_tests(alert), sort_keys=False))
    done = promtool(workdir, "test", "rules", "test.yaml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_a_wrong_expectation_fails_promtool(workdir: Path) -> None:
    """The unit tests can fail: a silent case of the throttling alert, expected to fire."""
    spec = unit_tests("LogprobdThrottling")
    fires = spec["tests"][0]["alert_rule_test"][1]
    spec["tests"][1]["alert_rule_test"] = [{**fires}]
    (workdir / "test.yaml").write_text(yaml.safe_dump(spec))
    done = promtool(workdir, "test", "rules", "test.yaml")
    assert done.returncode != 0
    assert "FAILED" in done.stdout + done.stderr

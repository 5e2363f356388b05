"""A real Prometheus scraping two real logprobd replicas on loopback, configured from the chart's
rendered ServiceMonitor (scrape job and labels) and PrometheusRule (the rule file, unchanged), after
mixed traffic: good requests (some with rollout log-probs), 422s, 429s under a small queue cap, a
client that gives up, and a weight reload of one replica only.

Then every expression of every Grafana panel, the dashboard's variables, every alert (and recording)
rule and the KEDA query are asked of Prometheus' HTTP API: each parses, has the type its consumer
expects and returns data; the alerts are in the state the traffic causes (pending where their
condition holds: their `for` is minutes), and Prometheus' counts equal what the client saw.

The replicas serve a dense model, so the mixture-of-experts row has no data there: a third replica
serving a tiny Mixtral, scraped by a Prometheus of its own, gives it its data and its numbers.

The scrape and rule-evaluation interval is 1 s instead of the chart's 15 s; Grafana's
$__rate_interval for a 15 s scrape (4 x 15 s) is 1m, which is what the dashboard queries get here.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.http.app import create_app
from tests.support.chart import CHART, EXTERNAL, NAMESPACE, every_panel, only, render
from tests.support.device import settings_for
from tests.support.prometheus import MONITORED, Prometheus, rule_groups, running_prometheus, scrape_config
from tests.support.servers import loopback

INTERVAL = "1s"
DASHBOARD_DATA = "LOGPROBD_DASHBOARD_DATA"  # a file to write every panel's answers to
ADMIN = "admin-key"
PODS = ("rl-logprobd-0", "rl-logprobd-1")
GRAFANA = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "1h"}
BIG_ROWS, ROW = 500, 64  # a request of 32000 tokens in 64-token rows: 500 micro-batches
QUEUE_CAP = 40_000  # a second big request is refused (429) while more than 8000 tokens are queued
# The state each alert is in after the traffic: pending where the condition holds (their `for` is
# minutes, this run is seconds), inactive where it does not.
EXPECTED_STATES = {
    "LogprobdWeightsDiverged": "pending",  # one replica reloaded to v11, the other still on v10
    "LogprobdWeightPushFailing": "inactive",  # no weights were pushed
    "LogprobdQueueGrowing": "inactive",  # far below 262144 queued tokens
    "LogprobdThrottling": "pending",  # 3 of 29 requests answered 429: above 5 %
    "LogprobdServerErrors": "inactive",  # no 5xx: 422, 429 and 499 are not server errors
    "LogprobdLatencyHigh": "inactive",  # p99 well under 60 s
    "LogprobdNoReplicaReady": "inactive",  # both ready
}


def good(i: int, *, rollout: bool = False) -> dict[str, Any]:
    rows = [[(i + j) % 90 + 1 for j in range(8)], [(2 * i + j) % 90 + 1 for j in range(5)]]
    body: dict[str, Any] = {"input_ids": rows, "num_actions": [3, 2]}
    if rollout:
        body["rollout_logprobs"] = [[-1.0, -2.5, -0.5], [-3.0, -1.25]]
    return body


BAD: list[dict[str, Any]] = [
    {"input_ids": [[1, 2, 3]], "num_actions": 5},
    {"input_ids": [[1, 2, 999]], "num_actions": 1},
    {"input_ids": [[1, 2]], "num_actions": 1, "temperature": 0},
]
BIG = {"input_ids": [[(i + j) % 90 + 1 for j in range(ROW)] for i in range(BIG_ROWS)], "num_actions": 1}


@dataclass
class Observed:
    prometheus: Prometheus
    manifests: list[dict[str, Any]]
    outcomes: Counter[str]  # per outcome, the requests the clients sent and saw answered so
    scored_tokens: int
    started: float
    ended: float


def metric(base: str, series: str) -> float:
    """One sample of the server's own /metrics."""
    text = httpx.get(f"{base}/metrics").text
    found = re.search(rf"^{re.escape(series)} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def drive(base: str, other: str) -> tuple[Counter[str], int]:
    """The traffic; returns what the client saw by outcome and the action tokens scored."""
    outcomes: Counter[str] = Counter()
    scored = 0
    with httpx.Client(timeout=60) as http:
        for i in range(18):
            reply = http.post(f"{base if i % 3 else other}/logprobs", json=good(i, rollout=i % 2 == 0))
            assert reply.status_code == 200, reply.text
            outcomes["ok"] += 1
            scored += 5
        for body in BAD:
            assert http.post(f"{base}/logprobs", json=body).status_code == 422
            outcomes["invalid_request"] += 1
    with ThreadPoolExecutor(1) as pool:
        big = pool.submit(httpx.post, f"{base}/logprobs", json=BIG, timeout=120)
        deadline = time.monotonic() + 30
        while metric(base, "logprobd_queue_tokens") < 12_000:  # the big request is queued
            assert not big.done(), "the big request was scored before it was seen queued"
            assert time.monotonic() < deadline, "the big request never queued"
        for _ in range(3):
            refused = httpx.post(f"{base}/logprobs", json=BIG, timeout=60)
            assert refused.status_code == 429, refused.text
            outcomes["overloaded"] += 1
        with pytest.raises(httpx.ReadTimeout):  # gives up while its request waits behind the big one
            httpx.post(f"{base}/logprobs", json=good(99), timeout=0.05)
        outcomes["client_disconnected"] += 1
        assert big.result().status_code == 200
        outcomes["ok"] += 1
        scored += BIG_ROWS
    deadline = time.monotonic() + 30
    while metric(base, 'logprobd_requests_total{outcome="client_disconnected"}') < 1:
        assert time.monotonic() < deadline, "the disconnect was never counted"
        time.sleep(0.05)
    return outcomes, scored


@pytest.fixture(scope="module")
def observed(
    weight_versions: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Observed]:
    manifests = render(MONITORED)
    settings = settings_for(
        weight_versions["v10"],
        admin_api_keys=ADMIN,
        weights_version="v10",
        max_batch_tokens=ROW,
        max_queued_tokens=QUEUE_CAP,
        batch_wait_ms=0,
        reload_mode="copy",
    )
    with (
        loopback(create_app(settings), log_level="error") as base,
        loopback(create_app(settings), log_level="error") as other,
    ):
        pods = {PODS[0]: base.removeprefix("http://"), PODS[1]: other.removeprefix("http://")}
        scrape = scrape_config(manifests, NAMESPACE, pods, INTERVAL)
        workdir = tmp_path_factory.mktemp("prometheus")
        with running_prometheus(workdir, scrape, rule_groups(manifests), INTERVAL) as prometheus:
            started = time.time()
            wait_for(prometheus, 'sum(up{job="rl-logprobd"}) == 2')  # both scraped once: counters at 0
            outcomes, scored = drive(base, other)
            reloaded = httpx.post(
                f"{base}/admin/weights",
                json={"path": str(weight_versions["v11"]), "version": "v11"},
                headers={"Authorization": f"Bearer {ADMIN}"},
                timeout=60,
            )
            assert reloaded.status_code == 200, reloaded.text
            wait_for(prometheus, 'logprobd_weights_version{version="v11"}')
            wait_for(prometheus, f"sum(logprobd_requests_total) == {sum(outcomes.values())}")
            wait_for(prometheus, 'ALERTS{alertname="LogprobdWeightsDiverged"}')
            wait_for(prometheus, 'ALERTS{alertname="LogprobdThrottling"}')
            yield Observed(prometheus, manifests, outcomes, scored, started, time.time())


def wait_for(prometheus: Prometheus, expr: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not prometheus.query(expr)["result"]:
        assert time.monotonic() < deadline, f"Prometheus never had {expr}"
        time.sleep(0.2)


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((CHART / "dashboards" / "logprobd.json").read_text())
    return loaded


def as_grafana_sends(expr: str) -> str:
    """The panel's query with the dashboard's variables set to this release and all its pods."""
    for variable, value in {
        **GRAFANA,
        "$namespace": NAMESPACE,
        "$service": "rl-logprobd",
        "$pod": "(" + "|".join(PODS) + ")",
    }.items():
        expr = expr.replace(variable, value)
    assert "$" not in expr, expr
    return expr


def panel_queries() -> list[tuple[str, str, str]]:
    """(panel title, panel type, expression) of every target of every panel."""
    return [
        (panel["title"], panel["type"], target["expr"])
        for panel in every_panel(dashboard()["panels"])
        for target in panel.get("targets", [])
    ]


def numbers(series: list[dict[str, Any]]) -> list[float]:
    values = [float(s["value"][1]) for s in series if "value" in s]
    values += [float(v) for s in series for _, v in s.get("values", [])]
    return [v for v in values if not math.isnan(v)]


def test_every_panel_query_returns_data(observed: Observed) -> None:
    """Stat panels ask an instant vector, time series panels a range (a matrix); each has data,
    and a number that is not NaN (histogram quantiles with no observations are NaN)."""
    prom = observed.prometheus
    queries = panel_queries()
    assert len(queries) > 30
    empty = []
    answers = []
    for title, kind, expr in queries:
        sent = as_grafana_sends(expr)
        if kind == "stat":
            data = prom.query(sent)
            assert data["resultType"] == "vector", (title, sent)
        else:
            start = observed.ended - math.ceil(observed.ended - observed.started)  # a step at the end
            data = prom.query_range(sent, start, observed.ended, "1s")
            assert data["resultType"] == "matrix", (title, sent)
        answers.append({"title": title, "expr": expr, "result": data["result"]})
        if any(name in expr for name in EXTERNAL):  # another exporter's series: parse and type only
            assert data["result"] == [], (title, sent)
            continue
        if title in SPARSE_PANELS or title in ROUTE_PANELS:  # a dense policy has no experts, no routes
            assert not numbers(data["result"]), (title, sent)
            continue
        if title in UNPUSHED_PANELS:  # no trainer pushes weights here: no push has a duration
            assert not numbers(data["result"]), (title, sent)
            continue
        if not numbers(data["result"]):
            empty.append((title, sent))
    if DASHBOARD_DATA in os.environ:  # benchmarks/dashboard_picture.py draws the panels from these
        Path(os.environ[DASHBOARD_DATA]).write_text(json.dumps(answers))
    assert not empty, f"panels without data after the traffic: {empty}"


def _row_panels(title: str) -> list[str]:
    """The titles of the panels under the dashboard's row `title` (up to the next row)."""
    panels = sorted(dashboard()["panels"], key=lambda p: (p["gridPos"]["y"], p["gridPos"]["x"]))
    rows = [i for i, p in enumerate(panels) if p["type"] == "row"]
    (start,) = [i for i in rows if panels[i]["title"] == title]
    end = next((i for i in rows if i > start), len(panels))
    return [p["title"] for p in panels[start + 1 : end]]


SPARSE_PANELS = _row_panels("Mixture of experts (sparse policies)")
# the weight-push row's quantile (its counters are exported at 0 and have data)
UNPUSHED_PANELS = ["Push time, first bucket to serving"]
# the routing drift panel sits with the rollout mismatch; only a sparse policy takes routes
ROUTE_PANELS = sorted({title for title, _, expr in panel_queries() if "logprobd_route_" in expr})


def _instant(observed: Observed, expr: str) -> dict[tuple[tuple[str, str], ...], float]:
    data = observed.prometheus.query(as_grafana_sends(expr))
    assert data["resultType"] == "vector"
    return {tuple(sorted(s["metric"].items())): float(s["value"][1]) for s in data["result"]}


def _panel(title: str) -> list[str]:
    exprs = [expr for t, _, expr in panel_queries() if t == title]
    assert exprs, title
    return exprs


def test_panels_show_what_the_traffic_did(observed: Observed) -> None:
    """Numbers against the clients' own record: ready replicas, outcomes, versions by replica,
    reloads; and Prometheus' counters equal the requests and tokens the clients sent."""
    assert _instant(observed, _panel("Ready replicas")[0]) == {(): 2.0}
    by_outcome = _instant(observed, _panel("Requests/s by outcome")[0])
    busy = {dict(labels)["outcome"] for labels, rate in by_outcome.items() if rate > 0}
    assert busy == set(observed.outcomes)
    versions = _instant(observed, _panel("Policy weights version by replica")[0])
    assert {(dict(k)["pod"], dict(k)["version"]) for k in versions} == {(PODS[0], "v11"), (PODS[1], "v10")}
    reloads = _instant(observed, _panel("Reloads by outcome")[0])
    assert {dict(k)["outcome"] for k, v in reloads.items() if v > 0} == {"applied"}
    counted = _instant(observed, 'sum by (outcome) (logprobd_requests_total{namespace="$namespace"}) > 0')
    assert {dict(k)["outcome"]: v for k, v in counted.items()} == dict(observed.outcomes)
    tokens = _instant(observed, 'sum(logprobd_scored_tokens_total{service="$service"})')
    assert tokens == {(): float(observed.scored_tokens)}


def test_dashboard_variables_list_this_release(observed: Observed) -> None:
    """label_values(<selector>, <label>): what Grafana asks /api/v1/label/<label>/values."""
    found = {}
    for variable in dashboard()["templating"]["list"]:
        if variable["type"] != "query":
            continue
        match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", variable["query"]["query"])
        assert match, variable["query"]
        selector, label = as_grafana_sends(match.group(1)), match.group(2)
        values = observed.prometheus.api(f"label/{label}/values", **{"match[]": selector})
        found[variable["name"]] = set(values)
    assert found == {"namespace": {NAMESPACE}, "service": {"rl-logprobd"}, "pod": set(PODS)}


def test_every_rule_evaluates_to_the_state_the_traffic_causes(observed: Observed) -> None:
    """Each rule of the PrometheusRule loaded, evaluated without error; an alert's expression is a
    vector with data exactly when the alert is pending or firing; a recording rule has data."""
    rules = [r for g in rule_groups(observed.manifests)["groups"] for r in g["rules"]]
    loaded = observed.prometheus.rules()
    alerts = {r["alert"] for r in rules if "alert" in r}
    assert alerts == set(EXPECTED_STATES), "a new alert needs its expected state here"
    assert set(loaded) == {r.get("alert") or r["record"] for r in rules}
    for rule in rules:
        name = rule.get("alert") or rule["record"]
        assert loaded[name]["health"] == "ok", loaded[name]
        data = observed.prometheus.query(rule["expr"])
        assert data["resultType"] == "vector", name
        if "record" in rule:
            assert data["result"], name
            continue
        assert loaded[name]["state"] == EXPECTED_STATES[name], (name, loaded[name])
        assert bool(data["result"]) == (EXPECTED_STATES[name] != "inactive"), (name, data)
    throttled = observed.prometheus.query(only_rule(rules, "LogprobdThrottling"))["result"]
    # the ratio of the counts, up to rate()'s extrapolation to the window's end, which differs
    # between the two replicas by up to a scrape interval (of a ~20 s sampled interval)
    assert float(throttled[0]["value"][1]) == pytest.approx(
        observed.outcomes["overloaded"] / sum(observed.outcomes.values()), rel=0.1
    )
    diverged = observed.prometheus.query(only_rule(rules, "LogprobdWeightsDiverged"))["result"]
    assert float(diverged[0]["value"][1]) == 2.0


def only_rule(rules: list[dict[str, Any]], alert: str) -> str:
    (expr,) = [r["expr"] for r in rules if r.get("alert") == alert]
    return str(expr)


def test_the_keda_query_returns_the_queue(observed: Observed) -> None:
    (trigger,) = only(observed.manifests, "ScaledObject")["spec"]["triggers"]
    data = observed.prometheus.query(trigger["metadata"]["query"])
    assert data["resultType"] == "vector"
    (sample,) = data["result"]
    assert 0 <= float(sample["value"][1]) <= QUEUE_CAP


@pytest.fixture(scope="module")
def sparse(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Observed]:
    """One replica serving the tiny Mixtral (4 experts, one counted sparse layer), scraped by a
    Prometheus of its own after six requests of 13 tokens, one after another, and two that replay
    routes other than the live router's (each recorded first)."""
    manifests = render(MONITORED)
    settings = settings_for(model_dirs["mixtral"], batch_wait_ms=0)
    with loopback(create_app(settings), log_level="error") as base:
        scrape = scrape_config(manifests, NAMESPACE, {PODS[0]: base.removeprefix("http://")}, INTERVAL)
        workdir = tmp_path_factory.mktemp("prometheus-sparse")
        with running_prometheus(workdir, scrape, rule_groups(manifests), INTERVAL) as prometheus:
            started = time.time()
            wait_for(prometheus, 'sum(up{job="rl-logprobd"}) == 1')
            with httpx.Client(timeout=60) as http:
                for i in range(6):
                    assert http.post(f"{base}/logprobs", json=good(i)).status_code == 200
                replay_other_routes(http, base)
            count = metric(base, "logprobd_moe_expert_load_count")
            assert count == 4 * metric(base, "logprobd_forward_duration_seconds_count") >= 4 * 10
            wait_for(prometheus, f"sum(logprobd_moe_expert_load_count) == {count}")
            yield Observed(prometheus, manifests, Counter(ok=10), 50, started, time.time())


def replay_other_routes(http: httpx.Client, base: str) -> None:
    """Two requests that replay routes the live router did not take: each one recorded (R2), then
    sent back with every expert id moved on by one (mod experts), so agreement is below 1."""
    for i in range(2):
        body = good(10 + i)
        recorded = http.post(f"{base}/logprobs", json={**body, "return_routed_experts": True}).json()
        experts = recorded["moe"]["experts"]
        moved = [
            [[[(e + 1) % experts for e in slot] for slot in pos] for pos in row]
            for row in recorded["routed_experts"]
        ]
        reply = http.post(f"{base}/logprobs", json={**body, "routed_experts": moved})
        assert reply.status_code == 200, reply.text


def test_routing_drift_panel_shows_the_replayed_requests(sparse: Observed) -> None:
    """The panel's queries return numbers on the sparse replica, and its means are the replica's own
    sums over counts (two requests observed)."""
    assert ROUTE_PANELS == ["Routing drift (requests sent with routed_experts)"]
    exact_mean, _, overlap_mean, _ = _panel(ROUTE_PANELS[0])
    for expr in _panel(ROUTE_PANELS[0]):
        assert numbers(sparse.prometheus.query(as_grafana_sends(expr))["result"]), expr
    count = _instant(sparse, "sum(logprobd_route_exact_fraction_count)")[()]
    assert count == 2
    exact = _instant(sparse, "sum(logprobd_route_exact_fraction_sum)")[()] / count
    overlap = _instant(sparse, "sum(logprobd_route_mean_overlap_sum)")[()] / count
    assert 0 <= exact < 1
    assert exact <= overlap < 1
    assert _instant(sparse, exact_mean)[()] == pytest.approx(exact)
    assert _instant(sparse, overlap_mean)[()] == pytest.approx(overlap)


def test_expert_load_panels_show_a_sparse_policys_load(sparse: Observed) -> None:
    """Every query of the row returns numbers; the shares of idle and overloaded experts are the ones
    the replica's own buckets give (over all of its micro-batches: their rate over the same window)."""
    assert SPARSE_PANELS == ["Expert load (1 = an even share)", "Idle and overloaded experts"]
    for title in SPARSE_PANELS:
        for expr in _panel(title):
            assert numbers(sparse.prometheus.query(as_grafana_sends(expr))["result"]), (title, expr)
    total = _instant(sparse, "sum(logprobd_moe_expert_load_count)")[()]
    idle = _instant(sparse, 'sum(logprobd_moe_expert_load_bucket{le="0.0"})')[()]
    within = _instant(sparse, 'sum(logprobd_moe_expert_load_bucket{le="4.0"})')[()]
    idle_panel, over_panel = _panel("Idle and overloaded experts")
    assert _instant(sparse, idle_panel)[()] == pytest.approx(idle / total)
    assert _instant(sparse, over_panel)[()] == pytest.approx(1 - within / total)
    assert total >= 24

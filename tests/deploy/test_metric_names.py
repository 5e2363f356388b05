"""Every series the Grafana dashboard, the alert rules and the autoscalers read is one the service
really exports: names come from parsing their PromQL, and are looked up in the /metrics output of
the demo model after one scoring request (so every labelled series has a sample)."""

from __future__ import annotations

import json
import re

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.chart import (
    CHART,
    EXTERNAL,
    VALUES_FILES,
    every_panel,
    kinds,
    only,
    promql_metric_names,
    render,
)
from tests.support.device import settings_for
from tests.support.servers import running


@pytest.fixture(scope="module")
def exported() -> set[str]:
    with running(settings_for(None)) as client:
        scored = client.post("/logprobs", json={"input_ids": [[1, 2, 3, 4]], "num_actions": 2})
        assert scored.status_code == 200
        text = client.get("/metrics").text
    return {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}


def dashboard_queries() -> list[str]:
    dashboard = json.loads((CHART / "dashboards" / "logprobd.json").read_text())
    queries = [t["expr"] for panel in every_panel(dashboard["panels"]) for t in panel.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":  # label_values(<series selector>, <label>)
            match = re.fullmatch(r"label_values\((.+),\s*\w+\)", variable["query"]["query"])
            assert match, variable["query"]
            queries.append(match.group(1))
    return queries


def chart_queries() -> list[str]:
    """Alert expressions and autoscaler queries from every values file that renders them."""
    queries = []
    for values_file in VALUES_FILES:
        manifests = render(values_file)
        if "PrometheusRule" in kinds(manifests):
            rule = only(manifests, "PrometheusRule")
            queries += [r["expr"] for group in rule["spec"]["groups"] for r in group["rules"]]
        if "ScaledObject" in kinds(manifests):
            queries += [t["metadata"]["query"] for t in only(manifests, "ScaledObject")["spec"]["triggers"]]
        if "HorizontalPodAutoscaler" in kinds(manifests):
            hpa = only(manifests, "HorizontalPodAutoscaler")
            queries += [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]]
    return queries


def test_promql_names_are_extracted_from_the_parse_tree() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le) (rate(a_bucket{x="y", pod=~"$pod"}[$__rate_interval])))'
        " / on (pod) group_left b or vector(0) and deriv(sum(c)[10m:1m]) > 1e3"
    )
    assert promql_metric_names(expr) == {"a_bucket", "b", "c"}
    with pytest.raises(ValueError, match="parenthesis"):
        promql_metric_names("sum(rate(a[5m])")


def test_the_dashboard_covers_what_the_issue_asks() -> None:
    names = set().union(*map(promql_metric_names, dashboard_queries()))
    assert names >= {
        "logprobd_scored_tokens_total", "logprobd_input_tokens_total", "logprobd_requests_total",
        "logprobd_request_duration_seconds_bucket", "logprobd_queue_duration_seconds_bucket",
        "logprobd_forward_duration_seconds_bucket", "logprobd_queue_requests", "logprobd_queue_tokens",
        "logprobd_batch_tokens_bucket", "DCGM_FI_DEV_FB_USED", "logprobd_rollout_abs_diff_bucket",
        "logprobd_rollout_kl_k3_bucket", "logprobd_rollout_ratio_outside_fraction_sum",
        "logprobd_computed_tokens_total", "logprobd_prefix_cache_hit_tokens_total",
        "logprobd_prefix_cache_miss_tokens_total", "logprobd_prefix_cache_evicted_tokens_total",
        "logprobd_prefix_cache_held_bytes", "logprobd_prefix_cache_capacity_bytes",
    }  # fmt: skip


def test_the_dashboards_panels_have_their_own_ids_and_places() -> None:
    """No two panels share an id (Grafana keeps one of them) or a cell of the 24-column grid (Grafana
    moves one, and a row's panels then sit under another row)."""
    panels = list(every_panel(json.loads((CHART / "dashboards" / "logprobd.json").read_text())["panels"]))
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    taken: dict[tuple[int, int], str] = {}
    for panel in panels:
        place = panel["gridPos"]
        for y in range(place["y"], place["y"] + place["h"]):
            for x in range(place["x"], place["x"] + place["w"]):
                assert (x, y) not in taken, (panel["title"], taken[x, y])
                taken[x, y] = panel["title"]


def test_every_series_read_is_exported(exported: set[str]) -> None:
    queries = dashboard_queries() + chart_queries()
    assert len(queries) > 20
    used = set().union(*map(promql_metric_names, queries))
    missing = used - exported - set(EXTERNAL)
    assert not missing, f"read by the dashboard or the chart, exported by nothing: {sorted(missing)}"
    assert "logprobd_queue_tokens" in used
    assert used & set(EXTERNAL)  # the allow-list is in use, not stale

"""The metrics that service/metrics.py builds itself: the bulk-observed histogram against
prometheus_client's own Histogram fed the same values one by one, and the expert load of a served
mixture of experts against the routing of the per-sequence float32 reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from service.metrics import LOAD_BUCKETS, BulkHistogram, Metrics
from tests.support.device import DTYPE, settings_for
from tests.support.servers import running


def samples(text: str, name: str) -> dict[str, float]:
    """`name`'s samples in an exposition text, keyed by sample name and `le`."""
    return {
        f"{sample.name}{sample.labels.get('le', '')}": sample.value
        for family in text_string_to_metric_families(text)
        if family.name == name
        for sample in family.samples
    }


def test_bulk_histogram_exposes_what_prometheus_clients_histogram_does() -> None:
    """Values on the bounds, between them, below the first and above the last, in two batches."""
    values = [np.array([0.0, 0.125, 0.2, 1.0, 1.0000001, 17.0, -1.0]), np.array([[3.0, 0.75], [8.0, 0.0]])]
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    bulk = BulkHistogram("load", "Help.", LOAD_BUCKETS, ours)
    single = Histogram("load", "Help.", buckets=LOAD_BUCKETS, registry=theirs)
    for batch in values:
        bulk.observe(batch)
        for value in batch.ravel():
            single.observe(float(value))
    got = samples(generate_latest(ours).decode(), "load")
    want = {k: v for k, v in samples(generate_latest(theirs).decode(), "load").items() if "created" not in k}
    assert got == pytest.approx(want)
    assert got["load_count"] == 11


def test_expert_load_is_each_experts_share_of_its_layer() -> None:
    """Layer 0: 16 tokens over 4 experts as 0, 4, 4, 8 (0, 1, 1, 2 even shares); layer 1 even; layer 2
    routed nothing and is left out."""
    metrics = Metrics()
    metrics.observe_expert_load(np.array([[0, 4, 4, 8], [3, 3, 3, 3], [0, 0, 0, 0]]))
    metrics.observe_expert_load(None)  # a dense policy's micro-batch
    got = samples(metrics.render().decode(), "logprobd_moe_expert_load")
    assert got["logprobd_moe_expert_load_count"] == 8
    assert got["logprobd_moe_expert_load_sum"] == 8  # each layer's shares sum to its experts
    assert got["logprobd_moe_expert_load_bucket0.0"] == 1
    assert got["logprobd_moe_expert_load_bucket1.0"] == 7
    assert got["logprobd_moe_expert_load_bucket2.0"] == 8


SEQUENCES = (
    [5, 9, 14, 3, 77, 21, 8, 60, 2, 19, 33, 41, 6],
    list(range(40, 80)),
    [11, 12, 13, 14, 15, 16, 17],
)


def reference_counts(model: Any, experts: int) -> list[int]:
    """How many tokens of SEQUENCES the float32 reference's first layer routes to each expert, sequence
    by sequence (the tiny Mixtral's layer 0, the one sparse layer before its last)."""
    seen: list[torch.Tensor] = []
    hook = model.model.layers[0].mlp.gate.register_forward_hook(lambda _m, _i, out: seen.append(out[2]))
    try:
        with torch.inference_mode():
            for tokens in SEQUENCES:
                model(input_ids=torch.tensor([tokens], device=model.device))
    finally:
        hook.remove()
    return torch.bincount(torch.cat([ids.flatten() for ids in seen]).cpu(), minlength=experts).tolist()


def test_a_served_mixture_of_experts_reports_its_expert_load(
    model_dirs: dict[str, Path], reference_models: dict[str, Any]
) -> None:
    """One micro-batch of three sequences through the tiny Mixtral (4 experts, top-2): four shares of
    one counted layer, summing to 4; in float32 the buckets are those of the reference's routing."""
    with running(settings_for(model_dirs["mixtral"], max_batch_tokens=4096)) as client:
        before = samples(client.get("/metrics").text, "logprobd_moe_expert_load")
        body = {"input_ids": [list(s) for s in SEQUENCES], "num_actions": [3, 5, 2]}
        assert client.post("/logprobs", json=body).status_code == 200
        got = samples(client.get("/metrics").text, "logprobd_moe_expert_load")
    assert before["logprobd_moe_expert_load_count"] == 0  # the warm-up's forwards are not served ones
    assert got["logprobd_moe_expert_load_count"] == 4
    assert got["logprobd_moe_expert_load_sum"] == pytest.approx(4.0)
    if DTYPE != "float32":
        return  # half precision may flip a near tie against the float32 reference
    counts = np.asarray(reference_counts(reference_models["mixtral"], 4))
    shares = counts * 4 / counts.sum()
    for bound in LOAD_BUCKETS:
        assert got[f"logprobd_moe_expert_load_bucket{bound}"] == int((shares <= bound).sum()), bound

"""Every Prometheus metric of the service and its buckets, in one registry per app."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from typing import cast

import numpy as np
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
    utils,
)
from prometheus_client import Info as InfoMetric
from prometheus_client.core import HistogramMetricFamily, Metric

from service.core.cache_plan import BLOCK
from service.core.errors import OUTCOMES
from service.core.jobs import IntArray
from service.core.prefix_cache import Stats
from service.wire.schemas import RolloutMismatch, RouteAgreementSummary

PREFIX = "logprobd"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = tuple(float(2**k) for k in range(4, 19))  # 16 .. 262144
MISMATCH_BUCKETS = (1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0)
FRACTION_BUCKETS = (0.0, 1e-4, 1e-3, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
# route agreement, a fraction near 1 where replay matters: fine steps below 1
AGREEMENT_BUCKETS = (0.0, 0.25, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999, 1.0)
# an expert's tokens as a multiple of an even share: 0 idle, 1 even
LOAD_BUCKETS = (0.0, 0.125, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 8.0, 16.0)
# how prometheus_client writes a bucket's `le` (untyped there)
_go_float = cast(Callable[[float], str], utils.floatToGoString)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PUSH_OUTCOMES = ("applied", "committed", "dropped", "failed")
BUCKET_OUTCOMES = ("received", "refused", "failed")


class BulkHistogram:
    """A histogram observed an array at a time: bucketed with numpy, exposed like prometheus_client's
    Histogram (cumulative `le` buckets, _sum, _count). For thousands of values per micro-batch, which
    Histogram.observe would take one call each."""

    def __init__(
        self, name: str, documentation: str, buckets: Sequence[float], registry: CollectorRegistry
    ) -> None:
        self._name, self._documentation = name, documentation
        self._bounds = np.asarray(buckets, dtype=np.float64)
        self._counts = np.zeros(len(buckets) + 1, dtype=np.int64)  # per bucket; the last above every bound
        self._sum = 0.0
        self._lock = threading.Lock()
        registry.register(self)

    def observe(self, values: np.ndarray) -> None:
        """Each value counts in the first bucket whose bound it does not exceed."""
        values = np.ravel(values)
        counts = np.bincount(np.searchsorted(self._bounds, values), minlength=self._counts.shape[0])
        with self._lock:
            self._counts += counts
            self._sum += float(values.sum())

    def describe(self) -> list[Metric]:
        return [HistogramMetricFamily(self._name, self._documentation)]

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            cumulative, total = np.cumsum(self._counts), self._sum
        bounds = [_go_float(float(bound)) for bound in self._bounds] + ["+Inf"]
        buckets = [(bound, float(count)) for bound, count in zip(bounds, cumulative, strict=True)]
        yield HistogramMetricFamily(self._name, self._documentation, buckets=buckets, sum_value=total)


class Metrics:
    """The service's metrics. Owns its registry, so apps (and tests) never share counters.

    No `<counter>_created` / `<histogram>_created` series: like vLLM's /metrics, prometheus_client's
    creation timestamps are turned off (process-wide), which would otherwise be one more series per
    counter, histogram and label set (76 of them) that no dashboard or alert reads."""

    def __init__(self) -> None:
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(f"{PREFIX}_requests", "Scoring requests by outcome.", ["outcome"], registry=r)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        self.input_tokens = Counter(f"{PREFIX}_input_tokens", "Real tokens received.", registry=r)
        self.scored_tokens = Counter(f"{PREFIX}_scored_tokens", "Action tokens scored.", registry=r)
        self.sequences = Counter(f"{PREFIX}_sequences", "Sequences scored.", registry=r)
        self.computed_tokens = Counter(
            f"{PREFIX}_computed_tokens",
            "Tokens run through the decoder: input tokens less the shared prefixes computed once.",
            registry=r,
        )
        self.cache_hit_tokens = Counter(
            f"{PREFIX}_prefix_cache_hit_tokens",
            "Tokens of scored sequences the prefix cache served (their keys, values and hidden states "
            "read, not computed).",
            registry=r,
        )
        self.cache_miss_tokens = Counter(
            f"{PREFIX}_prefix_cache_miss_tokens",
            "Tokens of scored sequences the prefix cache did not serve (computed).",
            registry=r,
        )
        self.cache_evicted_tokens = Counter(
            f"{PREFIX}_prefix_cache_evicted_tokens",
            "Tokens the prefix cache evicted (least recently used first) to make room.",
            registry=r,
        )
        self.cache_held_bytes = Gauge(
            f"{PREFIX}_prefix_cache_held_bytes",
            "Bytes of the prefix cache's pools holding entries (every served model's).",
            registry=r,
        )
        self.cache_capacity_bytes = Gauge(
            f"{PREFIX}_prefix_cache_capacity_bytes",
            "Bytes of the prefix cache's pools (every served model's); 0: no cache.",
            registry=r,
        )
        self.request_seconds = Histogram(
            f"{PREFIX}_request_duration_seconds",
            "Time from request arrival to response, per scoring request.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_seconds = Histogram(
            f"{PREFIX}_queue_duration_seconds",
            "Time a sequence waited in the queue before its micro-batch started.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.forward_seconds = Histogram(
            f"{PREFIX}_forward_duration_seconds",
            "Time of one micro-batch forward (packing, model, lm_head, log-softmax).",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_tokens = Histogram(
            f"{PREFIX}_batch_tokens", "Tokens per packed micro-batch.", buckets=TOKEN_BUCKETS, registry=r
        )
        self.expert_load = BulkHistogram(
            f"{PREFIX}_moe_expert_load",
            "Per micro-batch, each expert of each counted sparse layer of the policy: its real tokens as a "
            "multiple of an even share (the layer's routed tokens / its experts). 0: idle; 1: even.",
            LOAD_BUCKETS,
            r,
        )
        self.batch_sequences = Histogram(
            f"{PREFIX}_batch_sequences",
            "Sequences per packed micro-batch.",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
            registry=r,
        )
        self.rollout_abs_diff = Histogram(
            f"{PREFIX}_rollout_abs_diff",
            "Per request: mean |logprob - rollout_logprob| over its action tokens.",
            buckets=MISMATCH_BUCKETS,
            registry=r,
        )
        self.rollout_max_abs_diff = Histogram(
            f"{PREFIX}_rollout_max_abs_diff",
            "Per request: max |logprob - rollout_logprob| over its action tokens.",
            buckets=MISMATCH_BUCKETS,
            registry=r,
        )
        self.rollout_kl = Histogram(
            f"{PREFIX}_rollout_kl_k3",
            "Per request: mean k3 estimate of KL(rollout || policy), exp(d) - 1 - d, d = logprob - rollout.",
            buckets=MISMATCH_BUCKETS,
            registry=r,
        )
        self.rollout_ratio_outside = Histogram(
            f"{PREFIX}_rollout_ratio_outside_fraction",
            "Per request: fraction of action tokens whose ratio exp(logprob - rollout) is outside [0.5, 2].",
            buckets=FRACTION_BUCKETS,
            registry=r,
        )
        self.outside_kept = Histogram(
            f"{PREFIX}_sampling_outside_kept_fraction",
            "Per request with `sampling`: fraction of action tokens outside the sampler's kept set "
            "(processed log-prob -inf).",
            buckets=FRACTION_BUCKETS,
            registry=r,
        )
        self.route_exact = Histogram(
            f"{PREFIX}_route_exact_fraction",
            "Per request with routed_experts: fraction of its (position, sparse layer) pairs whose live "
            "top-k expert set equals the given (rollout's) set.",
            buckets=AGREEMENT_BUCKETS,
            registry=r,
        )
        self.route_overlap = Histogram(
            f"{PREFIX}_route_mean_overlap",
            "Per request with routed_experts: mean of |given ∩ live| / top_k over its (position, sparse "
            "layer) pairs.",
            buckets=AGREEMENT_BUCKETS,
            registry=r,
        )
        self.queue_requests = Gauge(
            f"{PREFIX}_queue_requests", "Requests waiting for or in scoring.", registry=r
        )
        self.queue_tokens = Gauge(f"{PREFIX}_queue_tokens", "Tokens waiting in the queue.", registry=r)
        self.ready = Gauge(f"{PREFIX}_ready", "1 once the model is loaded and warmed up.", registry=r)
        self.graphs_pending = Gauge(
            f"{PREFIX}_cuda_graphs_pending",
            "CUDA graphs the engine captures while idle (an MoE policy's for routed micro-batches, "
            "after the start; the first two with the check of both routed modes): how many are left. "
            "Each capture makes a request that comes meanwhile wait for it.",
            registry=r,
        )
        self.model_info = InfoMetric(f"{PREFIX}_model", "The model being served.", registry=r)
        self.weights_version = Gauge(
            f"{PREFIX}_weights_version",
            "1 for the weights version each model (policy, reference, critic) serves now.",
            ["target", "version"],
            registry=r,
        )
        self.weights_reloads = Counter(
            f"{PREFIX}_weights_reloads",
            "Weight reloads by model and outcome (applied, rejected, failed).",
            ["target", "outcome"],
            registry=r,
        )
        self.weights_reload_seconds = Histogram(
            f"{PREFIX}_weights_reload_duration_seconds",
            "Time from a reload's request to its weights serving.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.weights_pause_seconds = Histogram(
            f"{PREFIX}_weights_pause_seconds",
            "Time scoring paused between micro-batches while new weights were applied.",
            buckets=(0.0001, 0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
            registry=r,
        )

        self.weights_pushes = Counter(
            f"{PREFIX}_weights_pushes",
            "Pushed weight versions by model and outcome: applied (complete), committed (ended by the "
            "trainer before complete: the rest kept its values), dropped (timed out, or its group failed or "
            "was destroyed), failed (could not be applied).",
            ["target", "outcome"],
            registry=r,
        )
        self.weights_push_buckets = Counter(
            f"{PREFIX}_weights_push_buckets",
            "Pushed buckets (POST /update_weights_from_distributed) by model and outcome: received, refused "
            "(metadata or values that do not fit the model; drained), failed (the group broke).",
            ["target", "outcome"],
            registry=r,
        )
        self.weights_push_bytes = Counter(
            f"{PREFIX}_weights_push_bytes",
            "Bytes of weights received from trainers, by model.",
            ["target"],
            registry=r,
        )
        self.weights_push_seconds = Histogram(
            f"{PREFIX}_weights_push_duration_seconds",
            "Time from a pushed version's first bucket to its weights serving, by model.",
            ["target"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

        self.weights_push_groups = Gauge(
            f"{PREFIX}_weights_push_groups",
            "Trainer groups (SGLang's /init_weights_update_group) this replica is in now: 0 on a replica "
            "in no trainer's group, which the trainer's pushes do not reach.",
            registry=r,
        )

    def observe_push_targets(self, target: str) -> None:
        """Export the push series of `target` at 0 from the start, so rate() and alerts see the first."""
        for outcome in PUSH_OUTCOMES:
            self.weights_pushes.labels(target, outcome)
        for outcome in BUCKET_OUTCOMES:
            self.weights_push_buckets.labels(target, outcome)
        self.weights_push_bytes.labels(target)
        self.weights_push_seconds.labels(target)

    def observe_rollout(self, rollout: RolloutMismatch) -> None:
        if not rollout.tokens:
            return
        if rollout.mean_abs_diff is not None:
            self.rollout_abs_diff.observe(rollout.mean_abs_diff)
        if rollout.max_abs_diff is not None:
            self.rollout_max_abs_diff.observe(rollout.max_abs_diff)
        if rollout.mean_kl_k3 is not None:
            self.rollout_kl.observe(rollout.mean_kl_k3)
        if rollout.ratio_outside_fraction is not None:
            self.rollout_ratio_outside.observe(rollout.ratio_outside_fraction)
        if rollout.outside_kept_fraction is not None:
            self.outside_kept.observe(rollout.outside_kept_fraction)

    def observe_route_agreement(self, agreement: RouteAgreementSummary | None) -> None:
        if agreement is not None and agreement.compared:
            self.route_exact.observe(agreement.exact_fraction)
            self.route_overlap.observe(agreement.mean_overlap)

    def observe_expert_load(self, counts: IntArray | None) -> None:
        """counts [layers, experts]: the real tokens each expert took in one micro-batch."""
        if counts is None or counts.size == 0:
            return
        counts = counts[counts.sum(axis=1) > 0]  # a layer that routed nothing has no shares
        if counts.size:
            self.expert_load.observe(counts * counts.shape[1] / counts.sum(axis=1, keepdims=True))

    def observe_prefix_cache(self, stats: Stats, seen: Stats, capacity_bytes: int) -> None:
        """The prefix cache's counts since `seen` (the last observation), and what it holds now."""
        self.cache_hit_tokens.inc(max(0, stats.hit_tokens - seen.hit_tokens))
        self.cache_miss_tokens.inc(max(0, stats.miss_tokens - seen.miss_tokens))
        self.cache_evicted_tokens.inc(max(0, stats.evicted_blocks - seen.evicted_blocks) * BLOCK)
        self.cache_capacity_bytes.set(capacity_bytes)
        if stats.capacity_blocks:
            self.cache_held_bytes.set(capacity_bytes * stats.held_blocks / stats.capacity_blocks)

    def render(self) -> bytes:
        return generate_latest(self.registry)

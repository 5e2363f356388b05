"""Structural schemas of the custom resources the chart renders, which kubernetes-validate's built-in
schemas do not cover: the fields this chart may emit, as the Prometheus Operator's
(monitoring.coreos.com/v1) and KEDA's (keda.sh/v1alpha1) CRDs define them. Unknown fields are
rejected, so a misspelt key fails here rather than being dropped by the API server."""

from __future__ import annotations

from typing import Any

_UNITS = "".join(rf"(([0-9]+){unit})?" for unit in ("y", "w", "d", "h", "m", "s", "ms"))
DURATION = {"type": "string", "pattern": rf"^(0|{_UNITS})$"}  # Prometheus durations: 30s, 1m, 1h30m
STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
LABEL_SELECTOR = {
    "type": "object",
    "properties": {"matchLabels": STRING_MAP, "matchExpressions": {"type": "array"}},
    "additionalProperties": False,
}
METADATA = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "minLength": 1},
        "namespace": {"type": "string"},
        "labels": STRING_MAP,
        "annotations": STRING_MAP,
    },
    "additionalProperties": False,
}


def _resource(api_version: str, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": api_version},
            "kind": {"const": kind},
            "metadata": METADATA,
            "spec": spec,
        },
        "additionalProperties": False,
    }


SERVICE_MONITOR = _resource(
    "monitoring.coreos.com/v1",
    "ServiceMonitor",
    {
        "type": "object",
        "required": ["selector", "endpoints"],
        "properties": {
            "selector": LABEL_SELECTOR,
            "namespaceSelector": {
                "type": "object",
                "properties": {
                    "any": {"type": "boolean"},
                    "matchNames": {"type": "array", "items": {"type": "string"}},
                },
                "additionalProperties": False,
            },
            "endpoints": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "properties": {
                        "port": {"type": "string"},
                        "path": {"type": "string", "pattern": "^/"},
                        "scheme": {"enum": ["http", "https"]},
                        "interval": DURATION,
                        "scrapeTimeout": DURATION,
                        "honorLabels": {"type": "boolean"},
                        "relabelings": {"type": "array"},
                        "metricRelabelings": {"type": "array"},
                    },
                    "additionalProperties": False,
                },
            },
            "jobLabel": {"type": "string"},
            "targetLabels": {"type": "array", "items": {"type": "string"}},
        },
        "additionalProperties": False,
    },
)

PROMETHEUS_RULE = _resource(
    "monitoring.coreos.com/v1",
    "PrometheusRule",
    {
        "type": "object",
        "required": ["groups"],
        "properties": {
            "groups": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "required": ["name", "rules"],
                    "properties": {
                        "name": {"type": "string", "minLength": 1},
                        "interval": DURATION,
                        "rules": {
                            "type": "array",
                            "minItems": 1,
                            "items": {
                                "type": "object",
                                "required": ["expr"],
                                "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
                                "properties": {
                                    "alert": {"type": "string", "minLength": 1},
                                    "record": {"type": "string"},
                                    "expr": {"type": "string", "minLength": 1},
                                    "for": DURATION,
                                    "keep_firing_for": DURATION,
                                    "labels": STRING_MAP,
                                    "annotations": STRING_MAP,
                                },
                                "additionalProperties": False,
                            },
                        },
                    },
                    "additionalProperties": False,
                },
            }
        },
        "additionalProperties": False,
    },
)

SCALED_OBJECT = _resource(
    "keda.sh/v1alpha1",
    "ScaledObject",
    {
        "type": "object",
        "required": ["scaleTargetRef", "triggers"],
        "properties": {
            "scaleTargetRef": {
                "type": "object",
                "required": ["name"],
                "properties": {
                    "apiVersion": {"type": "string"},
                    "kind": {"type": "string"},
                    "name": {"type": "string"},
                    "envSourceContainerName": {"type": "string"},
                },
                "additionalProperties": False,
            },
            "minReplicaCount": {"type": "integer", "minimum": 0},
            "maxReplicaCount": {"type": "integer", "minimum": 1},
            "idleReplicaCount": {"type": "integer", "minimum": 0},
            "pollingInterval": {"type": "integer", "minimum": 1},
            "cooldownPeriod": {"type": "integer", "minimum": 0},
            "initialCooldownPeriod": {"type": "integer", "minimum": 0},
            "fallback": {"type": "object"},
            "advanced": {
                "type": "object",
                "properties": {
                    "restoreToOriginalReplicaCount": {"type": "boolean"},
                    "horizontalPodAutoscalerConfig": {
                        "type": "object",
                        "properties": {"name": {"type": "string"}, "behavior": {"type": "object"}},
                        "additionalProperties": False,
                    },
                    "scalingModifiers": {"type": "object"},
                },
                "additionalProperties": False,
            },
            "triggers": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "required": ["type", "metadata"],
                    "properties": {
                        "type": {"type": "string"},
                        "name": {"type": "string"},
                        "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                        "useCachedMetrics": {"type": "boolean"},
                        # KEDA's CRD: every metadata value is a string
                        "metadata": STRING_MAP,
                        "authenticationRef": {
                            "type": "object",
                            "required": ["name"],
                            "properties": {
                                "name": {"type": "string"},
                                "kind": {"enum": ["TriggerAuthentication", "ClusterTriggerAuthentication"]},
                            },
                            "additionalProperties": False,
                        },
                    },
                    "additionalProperties": False,
                    # the scaler's own requirements (KEDA's prometheus scaler)
                    "if": {"properties": {"type": {"const": "prometheus"}}},
                    "then": {
                        "properties": {"metadata": {"required": ["serverAddress", "query", "threshold"]}}
                    },
                },
            },
        },
        "additionalProperties": False,
    },
)

SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): SERVICE_MONITOR,
    ("monitoring.coreos.com/v1", "PrometheusRule"): PROMETHEUS_RULE,
    ("keda.sh/v1alpha1", "ScaledObject"): SCALED_OBJECT,
}

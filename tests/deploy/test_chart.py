"""The Helm chart, offline: it lints, renders with every CI values file, every object is valid
Kubernetes (kubernetes-validate's schemas, or the CRD schemas in crds.py), and what the pods run
matches what `python -m service serve` accepts: args, LOGPROBD_* settings, ports, probe routes."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any, get_args

import helm_python as helm
import jsonschema  # type: ignore[import-untyped]
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

import service
from service.__main__ import _parser
from service.client import group_keys as groups
from service.core.errors import ServiceError, status_for
from service.http.server import GRACEFUL_SHUTDOWN_S
from service.settings import (
    Attention,
    CudaGraphs,
    Decoder,
    Device,
    DType,
    HeadKernel,
    Kernels,
    MlpKernel,
    Settings,
)
from tests.support.chart import (
    CHART,
    VALUES_FILES,
    container,
    env_of,
    kinds,
    merged_values,
    notes,
    only,
    render,
    serves_get,
    services,
    values_of,
)
from tests.support.check_chart import lint_problems, main, validate
from tests.support.dockerfile import instructions

SETTINGS_ENV = {f"LOGPROBD_{name.upper()}" for name in Settings.model_fields}

values_files = pytest.mark.parametrize("values_file", VALUES_FILES, ids=lambda p: p.stem)


def test_there_are_values_files_for_each_deployment_shape() -> None:
    assert {p.stem for p in VALUES_FILES} >= {
        "default-values",
        "loadbalancer-autoscaling-pvc-values",
        "critic-reference-values",
    }
    assert values_of(CHART / "ci" / "default-values.yaml") == {}


@values_files
def test_values_pass_the_schema_and_lint_is_clean(values_file: Path) -> None:
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(values_of(values_file))
    assert lint_problems(values_file) == []


@pytest.mark.parametrize(
    "bad",
    [
        {"service": {"type": "Ingress"}},
        {"autoscaling": {"engine": "cpu"}},
        {"server": {"dtype": "float64"}},
        {"model": {"volume": {"type": "nfs"}}},
        {"model": {"path": "relative/dir"}},
        {"gpu": {"count": -1}},
        {"gpu": {"perPod": 0}},
        {"shm": {"sizeLimitPerGpu": "lots"}},
        {"drain": {"seconds": "15s"}},
        {"serverr": {}},
    ],
    ids=json.dumps,
)
def test_schema_rejects_bad_values(bad: dict[str, Any]) -> None:
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmValuesError):
        chart.validate_schema(bad)


@pytest.mark.parametrize(
    ("values", "error"),
    [
        ({"autoscaling": {"enabled": True, "minReplicas": 3, "maxReplicas": 2}}, "maxReplicas"),
        ({"model": {"volume": {"type": "existingClaim"}}}, "existingClaim is required"),
        ({"model": {"volume": {"type": "hostPath"}}}, "hostPath.path is required"),
        ({"auth": {"enabled": True}}, "existingSecret is required"),
        ({"gpu": {"perPod": 2, "resourceKey": "nvidia.com/mig-3g.40gb"}}, "needs whole GPUs"),
    ],
)
def test_render_refuses_inconsistent_values(values: dict[str, Any], error: str) -> None:
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmRenderError, match=error):
        chart.render(values, name="rl", namespace="train")


def test_notes_warn_when_replicas_share_a_read_write_once_claim() -> None:
    def warns(volume: dict[str, Any]) -> bool:
        values = {"replicaCount": 2, "model": {"path": "/models/m", "volume": volume}}
        with helm.Chart.load(CHART) as chart:
            return "ReadWriteOnce only" in chart.render(values, name="rl")["logprobd/templates/NOTES.txt"]

    assert warns({"type": "pvc"})
    assert not warns({"type": "pvc", "pvc": {"accessModes": ["ReadWriteMany"]}})


def test_schema_enums_follow_the_service_settings() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    server = schema["properties"]["server"]["properties"]
    assert server["dtype"]["enum"] == list(get_args(DType))
    assert server["device"]["enum"] == list(get_args(Device))
    assert server["attention"]["enum"] == list(get_args(Attention))
    assert server["decoder"]["enum"] == list(get_args(Decoder))
    assert server["kernels"]["enum"] == list(get_args(Kernels))
    assert server["mlpKernel"]["enum"] == list(get_args(MlpKernel))
    assert server["headKernel"]["enum"] == list(get_args(HeadKernel))
    assert server["cudaGraphs"]["enum"] == list(get_args(CudaGraphs))
    assert server["logLevel"]["enum"] == list(get_args(Settings.model_fields["log_level"].annotation))


def test_chart_defaults_are_the_service_defaults() -> None:
    server = yaml.safe_load((CHART / "values.yaml").read_text())["server"]
    defaults = Settings()
    assert server["port"] == defaults.port
    assert server["dtype"] == defaults.dtype
    assert server["attention"] == defaults.attention
    assert server["decoder"] == defaults.decoder
    assert server["kernels"] == defaults.kernels
    assert server["mlpKernel"] == defaults.mlp_kernel
    assert server["headKernel"] == defaults.head_kernel
    assert server["cudaGraphs"] == defaults.cuda_graphs
    assert server["maxBatchTokens"] == defaults.max_batch_tokens
    assert server["logLevel"] == defaults.log_level
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == service.__version__


@values_files
def test_every_rendered_object_is_valid(values_file: Path) -> None:
    manifests = render(values_file)
    assert kinds(manifests) >= {"Deployment", "Service", "ServiceAccount", "PodDisruptionBudget", "ConfigMap"}
    for manifest in manifests:
        validate(manifest)
    names = [(m["kind"], m["metadata"]["name"]) for m in manifests]
    assert len(names) == len(set(names))


def test_validation_catches_a_misspelt_field() -> None:
    """The checks above can fail: strict schemas reject unknown fields, in core and custom kinds."""
    files = {p.stem: p for p in VALUES_FILES}
    manifests = render(files["loadbalancer-autoscaling-pvc-values"])
    deployment = copy.deepcopy(only(manifests, "Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment)
    for kind in ("ServiceMonitor", "PrometheusRule", "ScaledObject"):
        bad = copy.deepcopy(only(manifests, kind))
        bad["spec"]["selectr"] = {}
        with pytest.raises(jsonschema.ValidationError):
            validate(bad)
    scaled = copy.deepcopy(only(manifests, "ScaledObject"))
    scaled["spec"]["triggers"][0]["metadata"]["threshold"] = 65536  # KEDA wants strings
    with pytest.raises(jsonschema.ValidationError):
        validate(scaled)


def test_make_chart_writes_every_values_file_and_fails_on_a_bad_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`make chart`: each CI values file rendered to a file of valid objects, exit 0; a values file
    whose objects fail validation exits 1 naming the object and the field."""
    assert main(["--output", str(tmp_path / "ci")]) == 0
    for values_file in VALUES_FILES:
        written = (tmp_path / "ci" / f"{values_file.stem}.yaml").read_text()
        assert list(yaml.safe_load_all(written)) == render(values_file)
    bad = tmp_path / "bad-values.yaml"
    bad.write_text(yaml.safe_dump({"affinity": {"nodeAfinity": {}}}))
    assert main(["--values", str(bad), "--output", str(tmp_path / "bad")]) == 1
    assert (
        "Deployment rl-logprobd: Additional properties are not allowed ('nodeAfinity'"
        in capsys.readouterr().err
    )
    bad.write_text(yaml.safe_dump({"server": {"logLevell": "info"}}))
    assert main(["--values", str(bad), "--output", str(tmp_path / "bad")]) == 1
    assert "additional properties 'logLevell' not allowed" in capsys.readouterr().err


@values_files
def test_container_args_are_accepted_by_the_service(values_file: Path) -> None:
    main = container(render(values_file))
    args = _parser().parse_args(main["args"])
    assert args.command == "serve"
    assert args.host == "0.0.0.0"
    (port,) = main["ports"]
    assert port["name"] == "http"
    assert int(args.port) == port["containerPort"] == merged_values(values_file)["server"]["port"]


@values_files
def test_env_names_and_values_are_real_settings(values_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = env_of(render(values_file))
    ours = {name: value for name, value in env.items() if name.startswith("LOGPROBD_")}
    unknown = set(ours) - SETTINGS_ENV
    assert not unknown, f"not settings of the service: {unknown}"
    for name, value in ours.items():
        monkeypatch.setenv(name, value)
    settings = Settings()  # the values parse as the service would parse them
    assert settings.device == "cuda"
    budget = merged_values(values_file)["server"].get("maxBatchTokens")  # null (dropped): the default
    assert settings.max_batch_tokens == budget
    assert ("LOGPROBD_MAX_BATCH_TOKENS" in env) == (budget is not None)


def test_critic_reference_and_keys_only_when_set() -> None:
    files = {p.stem: p for p in VALUES_FILES}
    default = env_of(render(files["default-values"]))
    assert "LOGPROBD_MODEL" not in default  # the demo model
    assert not {"LOGPROBD_CRITIC", "LOGPROBD_REF_MODEL", "LOGPROBD_API_KEYS_FILE"} & set(default)
    critic = env_of(render(files["critic-reference-values"]))
    assert critic["LOGPROBD_MODEL"] == "/models/policy"
    assert critic["LOGPROBD_CRITIC"] == "/models/critic"
    assert critic["LOGPROBD_REF_MODEL"] == "/models/reference"
    assert critic["LOGPROBD_API_KEYS_FILE"] == "/etc/logprobd/api-keys"


@values_files
def test_probes_hit_real_routes_on_the_container_port(values_file: Path) -> None:
    main = container(render(values_file))
    probes = {kind: main[kind]["httpGet"] for kind in ("startupProbe", "readinessProbe", "livenessProbe")}
    for probe in probes.values():
        assert serves_get(probe["path"])
        assert probe["port"] in {p["name"] for p in main["ports"]}
    assert probes["startupProbe"]["path"] == probes["readinessProbe"]["path"] == "/health/ready"
    assert probes["livenessProbe"]["path"] == "/health/live"
    assert not serves_get("/health/readyz")  # the route check itself can fail
    startup = main["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # minutes for a model load


@values_files
def test_service_monitor_and_ingress_reach_the_container(values_file: Path) -> None:
    manifests = render(values_file)
    deployment, (svc, headless) = only(manifests, "Deployment"), services(manifests)
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    (svc_port,) = svc["spec"]["ports"]
    assert svc_port["targetPort"] in {p["name"] for p in container(manifests)["ports"]}
    assert headless is not None
    assert headless["spec"]["selector"].items() <= pod_labels.items()
    assert headless["spec"]["ports"][0]["targetPort"] == svc_port["targetPort"]
    pdb = only(manifests, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    if "ServiceMonitor" in kinds(manifests):
        monitor = only(manifests, "ServiceMonitor")
        assert monitor["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
        # each pod scraped once: the headless Service's endpoints are not selected again
        assert (
            not monitor["spec"]["selector"]["matchLabels"].items() <= headless["metadata"]["labels"].items()
        )
        for endpoint in monitor["spec"]["endpoints"]:
            assert endpoint["port"] == svc_port["name"]
            assert serves_get(endpoint["path"])
    if "Ingress" in kinds(manifests):
        ingress = only(manifests, "Ingress")
        for rule in ingress["spec"]["rules"]:
            for path in rule["http"]["paths"]:
                assert path["backend"]["service"] == {
                    "name": svc["metadata"]["name"],
                    "port": {"name": "http"},
                }
        # groupAffinity: ingress-nginx hashes the client's group header (nginx's $http_<name>)
        annotations = ingress["metadata"].get("annotations") or {}
        hashed = annotations.get("nginx.ingress.kubernetes.io/upstream-hash-by")
        if merged_values(values_file)["ingress"]["groupAffinity"]:
            assert hashed == "$http_" + groups.HEADER.lower().replace("-", "_")
            assert annotations["nginx.ingress.kubernetes.io/proxy-body-size"] == "64m"  # the file's own kept
        else:
            assert hashed is None


@values_files
def test_gpu_requests_equal_limits(values_file: Path) -> None:
    values = merged_values(values_file)
    resources = container(render(values_file))["resources"]
    key, count, per_pod = values["gpu"]["resourceKey"], values["gpu"]["count"], values["gpu"]["perPod"]
    assert resources["requests"][key] == resources["limits"][key] == (per_pod if per_pod > 1 else count)


@values_files
def test_gpus_per_pod_set_the_ranks_the_gpus_and_shm(values_file: Path) -> None:
    """gpu.perPod > 1: LOGPROBD_TENSOR_PARALLEL_SIZE, that many GPUs, /dev/shm per GPU; 1: none of it."""
    values = merged_values(values_file)
    manifests = render(values_file)
    per_pod = values["gpu"]["perPod"]
    env = env_of(manifests)
    pod = only(manifests, "Deployment")["spec"]["template"]["spec"]
    shm = next(v for v in pod["volumes"] if v["name"] == "shm")["emptyDir"]
    assert shm["medium"] == "Memory"
    if per_pod == 1:
        assert "LOGPROBD_TENSOR_PARALLEL_SIZE" not in env
        assert shm["sizeLimit"] == values["shm"]["sizeLimit"]
        return
    assert env["LOGPROBD_TENSOR_PARALLEL_SIZE"] == str(per_pod)
    assert Settings(tensor_parallel_size=env["LOGPROBD_TENSOR_PARALLEL_SIZE"]).tensor_parallel_size == per_pod
    assert container(manifests)["resources"]["limits"]["nvidia.com/gpu"] == per_pod
    per_gpu = values["shm"]["sizeLimitPerGpu"]
    assert shm["sizeLimit"] == f"{int(per_gpu[:-2]) * per_pod}{per_gpu[-2:]}"


def test_there_is_a_tensor_parallel_values_file() -> None:
    assert any(merged_values(path)["gpu"]["perPod"] > 1 for path in VALUES_FILES)


@values_files
def test_the_pod_runs_locked_down_with_read_only_models(values_file: Path) -> None:
    manifests = render(values_file)
    pod = only(manifests, "Deployment")["spec"]["template"]["spec"]
    main = container(manifests)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert main["securityContext"]["readOnlyRootFilesystem"] is True
    assert main["securityContext"]["allowPrivilegeEscalation"] is False
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in main["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]["name"]]["emptyDir"]["medium"] == "Memory"
    assert "emptyDir" in volumes[mounts["/tmp"]["name"]]
    env = env_of(manifests)
    model_mounts = [path for path, m in mounts.items() if m["name"] == "models"]
    for path in model_mounts:
        assert mounts[path]["readOnly"] is True
    for name in ("LOGPROBD_MODEL", "LOGPROBD_CRITIC", "LOGPROBD_REF_MODEL"):
        if name in env:  # every model path lies on the read-only model volume
            assert any(env[name].startswith(f"{path}/") for path in model_mounts), name
    if "PersistentVolumeClaim" in kinds(manifests):
        claim = only(manifests, "PersistentVolumeClaim")
        assert volumes["models"]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
        assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"


@values_files
def test_grace_period_covers_the_drain(values_file: Path) -> None:
    manifests = render(values_file)
    pod = only(manifests, "Deployment")["spec"]["template"]["spec"]
    main = container(manifests)
    sleep = main["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep[0] == "sleep"
    drain = float(env_of(manifests)["LOGPROBD_DRAIN_SECONDS"])
    assert pod["terminationGracePeriodSeconds"] >= int(sleep[1]) + drain + GRACEFUL_SHUTDOWN_S
    readiness = main["readinessProbe"]
    # the readiness probe sees `draining` before the port closes
    assert readiness["periodSeconds"] * readiness["failureThreshold"] <= drain


@values_files
def test_autoscaling_is_on_queued_tokens_never_cpu(values_file: Path) -> None:
    manifests = render(values_file)
    values = merged_values(values_file)
    deployment = only(manifests, "Deployment")
    scalers = kinds(manifests) & {"HorizontalPodAutoscaler", "ScaledObject"}
    if not values["autoscaling"]["enabled"]:
        assert not scalers
        assert deployment["spec"]["replicas"] == values["replicaCount"]
        return
    assert "replicas" not in deployment["spec"]  # the autoscaler owns it
    assert len(scalers) == 1
    target = str(values["autoscaling"]["targetQueuedTokensPerReplica"])
    if "ScaledObject" in scalers:
        scaled = only(manifests, "ScaledObject")
        assert scaled["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
        (trigger,) = scaled["spec"]["triggers"]
        assert trigger["type"] == "prometheus"
        assert "logprobd_queue_tokens" in trigger["metadata"]["query"]
        assert trigger["metadata"]["threshold"] == target
        # KEDA hands `behavior` to the HPA it creates: it must be a valid HPA behavior
        behavior = scaled["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        spec = {"scaleTargetRef": {"kind": "Deployment", "name": "x"}, "maxReplicas": 2, "behavior": behavior}
        kind = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": {"name": "x"}}
        validate({**kind, "spec": spec})
    else:
        hpa = only(manifests, "HorizontalPodAutoscaler")
        assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
        (metric,) = hpa["spec"]["metrics"]
        assert metric["type"] == "Pods"
        assert metric["pods"]["metric"]["name"] == "logprobd_queue_tokens"
        assert metric["pods"]["target"]["averageValue"] == target


@values_files
def test_dashboard_config_map_ships_the_dashboard_file(values_file: Path) -> None:
    manifests = render(values_file)
    maps = [m for m in manifests if m["kind"] == "ConfigMap"]
    (dashboard,) = [m for m in maps if "grafana_dashboard" in m["metadata"]["labels"]]
    shipped = json.loads(dashboard["data"]["logprobd.json"])
    assert shipped == json.loads((CHART / "dashboards" / "logprobd.json").read_text())
    assert shipped["uid"] == "logprobd"


@values_files
def test_notes_render(values_file: Path) -> None:
    text = notes(values_file)
    assert "logprobd" in text
    assert ("DEMO model" in text) == (not merged_values(values_file)["model"]["path"])


def _statuses() -> dict[str, int]:
    """Every error outcome (`kind`, the `outcome` label of logprobd_requests_total) and its status."""
    found, pending = {}, [ServiceError]
    while pending:
        cls = pending.pop()
        found[cls.kind] = status_for(cls.__new__(cls))
        pending += cls.__subclasses__()
    return found


def test_alert_outcomes_follow_the_error_table() -> None:
    rule = yaml.safe_load((CHART / "values.yaml").read_text())["metrics"]["prometheusRule"]
    statuses = _statuses()
    assert set(rule["serverErrorOutcomes"].split("|")) == {k for k, s in statuses.items() if s >= 500}
    assert set(rule["throttledOutcomes"].split("|")) == {k for k, s in statuses.items() if s == 429}


def test_example_proxies_outlast_the_service_limits() -> None:
    """The examples' load balancer and Ingress let through the largest body and the longest request
    the service accepts by default."""
    files = {p.stem: p for p in VALUES_FILES}
    defaults = Settings()
    service_annotations = services(render(files["loadbalancer-autoscaling-pvc-values"]))[0]["metadata"]
    idle = service_annotations["annotations"][
        "service.beta.kubernetes.io/aws-load-balancer-connection-idle-timeout"
    ]
    assert int(idle) > defaults.request_timeout_s
    ingress = only(render(files["critic-reference-values"]), "Ingress")["metadata"]["annotations"]
    assert int(ingress["nginx.ingress.kubernetes.io/proxy-read-timeout"]) > defaults.request_timeout_s
    body = ingress["nginx.ingress.kubernetes.io/proxy-body-size"]
    assert body.endswith("m")
    assert int(body[:-1]) << 20 >= defaults.max_body_bytes


def test_weight_reload_values_wire_admin_keys_checkpoints_and_versions() -> None:
    """Reload on: the admin-key file, the reload mode and roots are settings the service knows, the
    checkpoints claim is mounted read-only where the roots point, and the version label is set."""
    manifests = render(CHART / "ci" / "weights-reload-values.yaml")
    env = env_of(manifests)
    main = container(manifests)
    mounts = {m["name"]: m for m in main["volumeMounts"]}
    assert env["LOGPROBD_RELOAD_MODE"] == "copy"
    assert env["LOGPROBD_WEIGHTS_VERSION"] == "step-0"
    assert mounts["checkpoints"] == {"name": "checkpoints", "mountPath": "/checkpoints", "readOnly": True}
    assert env["LOGPROBD_RELOAD_ROOTS"] == "/checkpoints"
    assert env["LOGPROBD_WEIGHTS_FOLLOW"].startswith(mounts["checkpoints"]["mountPath"] + "/")
    keys_dir, _, key = env["LOGPROBD_ADMIN_API_KEYS_FILE"].rpartition("/")
    assert mounts["admin-keys"]["mountPath"] == keys_dir
    volumes = {v["name"]: v for v in only(manifests, "Deployment")["spec"]["template"]["spec"]["volumes"]}
    assert volumes["admin-keys"]["secret"]["items"] == [{"key": key, "path": key}]
    assert volumes["checkpoints"]["persistentVolumeClaim"] == {
        "claimName": "rl-checkpoints",
        "readOnly": True,
    }
    Settings(reload_mode=env["LOGPROBD_RELOAD_MODE"], weights_version=env["LOGPROBD_WEIGHTS_VERSION"])
    default_env = env_of(render(CHART / "ci" / "default-values.yaml"))
    assert "LOGPROBD_ADMIN_API_KEYS_FILE" not in default_env  # reload stays off unless asked


def test_the_compile_cache_claim_is_mounted_where_the_image_keeps_its_kernels() -> None:
    """compileCache.existingClaim: mounted writable at /tmp/kernels, over the /tmp emptyDir, and every
    kernel cache directory the Dockerfile sets lies under it; unset, nothing is mounted there."""
    manifests = render(CHART / "ci" / "loadbalancer-autoscaling-pvc-values.yaml")
    mounts = {m["name"]: m for m in container(manifests)["volumeMounts"]}
    assert mounts["compile-cache"] == {"name": "compile-cache", "mountPath": "/tmp/kernels"}
    volumes = {v["name"]: v for v in only(manifests, "Deployment")["spec"]["template"]["spec"]["volumes"]}
    assert volumes["compile-cache"]["persistentVolumeClaim"] == {"claimName": "logprobd-kernels"}
    image_env: dict[str, str] = {}
    for keyword, rest in instructions():
        if keyword == "ENV":
            image_env.update(re.findall(r"(\w+)=(\S+)", rest))
    caches = ["TRITON_CACHE_DIR", "QUACK_CACHE_DIR", "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"]
    assert all(image_env[var].startswith(mounts["compile-cache"]["mountPath"] + "/") for var in caches)
    assert image_env["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] == "1"  # off unless turned on
    default = container(render(CHART / "ci" / "default-values.yaml"))["volumeMounts"]
    assert "compile-cache" not in {m["name"] for m in default}

"""Render the Helm chart and check it as tests/deploy/test_chart.py does: `helm lint --strict` (no
warning), then every rendered object against Kubernetes' schemas (kubernetes-validate, strict: an
unknown field fails) or, for the Prometheus Operator's and KEDA's kinds, the CRD schemas of crds.py.

`make chart` (python -m tests.support.check_chart [--values FILE ...] [--output DIR]) writes each
values file's manifests to DIR/<values file's name>.yaml and exits 1 naming what fails."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import helm_python as helm
import jsonschema  # type: ignore[import-untyped]
import kubernetes_validate  # type: ignore[import-untyped]
import yaml
from helm_python.errors import HelmRenderError, HelmValuesError

from tests.support import crds
from tests.support.chart import (
    CHART,
    KUBE_VERSION,
    NAMESPACE,
    RELEASE,
    VALUES_FILES,
    Manifest,
    render,
    values_of,
)


def validate(manifest: Manifest) -> None:
    """Raise (jsonschema's or kubernetes-validate's ValidationError) if the object is not valid."""
    key = (manifest["apiVersion"], manifest["kind"])
    if key in crds.SCHEMAS:
        jsonschema.Draft7Validator(crds.SCHEMAS[key]).validate(manifest)
    else:
        kubernetes_validate.validate(manifest, KUBE_VERSION, strict=True)


def lint_problems(values_file: Path) -> list[str]:
    """What `helm lint --strict` reports with this values file at warning level or above."""
    report = helm.lint(CHART, values_of(values_file), strict=True, kube_version=f"v{KUBE_VERSION}")
    return [str(e) for e in report["errors"]] + [
        str(m)
        for m in report["messages"]
        if m["severity"] >= 2  # 2 warning, 3 error
    ]


def check(values_file: Path, output: Path) -> list[str]:
    """Lint, render and validate with one values file; write the manifests; return the problems."""
    try:  # the chart's values.schema.json, then what it renders
        with helm.Chart.load(CHART) as chart:
            chart.validate_schema(values_of(values_file))
        problems = lint_problems(values_file)
        manifests = render(values_file)
    except (HelmValuesError, HelmRenderError) as exc:
        print(f"{values_file}: FAILED")
        return [f"{values_file}: {' '.join(str(exc).split())}"]
    for manifest in manifests:
        try:
            validate(manifest)
        except (jsonschema.ValidationError, kubernetes_validate.ValidationError) as exc:
            name = f"{manifest['kind']} {manifest['metadata']['name']}"
            problems.append(f"{name}: {str(exc).splitlines()[0]}")
    target = output / f"{values_file.stem}.yaml"
    target.write_text(yaml.safe_dump_all(manifests, sort_keys=False))
    print(f"{values_file}: {len(manifests)} objects -> {target}: {'FAILED' if problems else 'valid'}")
    return [f"{values_file}: {p}" for p in problems]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--values", type=Path, nargs="*", help="values files (default: the chart's ci/)")
    parser.add_argument("--output", type=Path, default=Path("build/chart"))
    args = parser.parse_args(argv)
    args.output.mkdir(parents=True, exist_ok=True)
    print(f"release {RELEASE} in namespace {NAMESPACE}, Kubernetes {KUBE_VERSION}")
    problems = [p for f in args.values or VALUES_FILES for p in check(f.resolve(), args.output)]
    print(*problems, sep="\n", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

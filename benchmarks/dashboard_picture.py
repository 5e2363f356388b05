"""The Grafana dashboard with data, as a PNG for docs/observability.md.

Runs tests/deploy/test_prometheus.py's panel test (a real Prometheus scraping two real replicas
after mixed traffic: good requests, 422s, 429s, a client that gives up, a weight reload of one
replica), which writes every panel query's answer to a JSON file; then draws each panel where the
dashboard's grid puts it: time series as lines (Grafana's legend format), stat panels as numbers.
Needs Prometheus (`apt-get install -y prometheus`) and matplotlib.

    python -m benchmarks.dashboard_picture [--data answers.json] [--output docs/img/dashboard-data.png]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "helm" / "logprobd" / "dashboards" / "logprobd.json"
SCALE = 0.55  # inches per grid column; a grid row is 30 px in Grafana, about 0.4 of a column here


def collect(path: Path) -> None:
    """Run the real-Prometheus panel test, which writes its answers to `path`."""
    env = {**os.environ, "LOGPROBD_DASHBOARD_DATA": str(path), "LOGPROBD_REQUIRE_PROMETHEUS": "1"}
    test = "tests/deploy/test_prometheus.py::test_every_panel_query_returns_data"
    subprocess.run([sys.executable, "-m", "pytest", "-q", test], cwd=ROOT, env=env, check=True)


def legend(fmt: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt) or ",".join(
        f"{k}={v}" for k, v in sorted(labels.items()) if k != "__name__"
    )


def draw(answers: list[dict[str, Any]], output: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = json.loads(DASHBOARD.read_text())["panels"]
    by_title: dict[str, list[dict[str, Any]]] = {}
    for answer in answers:
        by_title.setdefault(answer["title"], []).append(answer)
    height = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    fig = plt.figure(figsize=(24 * SCALE, height * SCALE * 0.5), facecolor="#111217")
    t0 = min((float(v[0]) for a in answers for s in a["result"] for v in s.get("values", [])), default=0.0)
    for panel in panels:
        g = panel["gridPos"]
        unit = 1 / height  # one grid row, as a fraction of the figure's height
        left, width, bottom = g["x"] / 24, g["w"] / 24, 1 - (g["y"] + g["h"]) * unit
        if panel["type"] == "row":
            fig.text(
                left + 0.004, bottom + 0.3 * unit, panel["title"], color="#ccccdc", weight="bold", size=11
            )
            continue
        # room for the y ticks on the left, the x ticks below and the title above
        ax = fig.add_axes((left + 0.03, bottom + 0.9 * unit, width - 0.036, (g["h"] - 2.0) * unit))
        ax.set_facecolor("#181b1f")
        for spine in ax.spines.values():
            spine.set_color("#2c3235")
        ax.tick_params(colors="#8e8e8e", labelsize=7)
        ax.set_title(panel["title"], color="#ccccdc", size=9, loc="left")
        targets = {t["expr"]: t.get("legendFormat", "") for t in panel.get("targets", [])}
        found = by_title.get(panel["title"], [])
        if panel["type"] == "stat":
            ax.set_xticks([])
            ax.set_yticks([])
            values = [
                (legend(targets.get(a["expr"], ""), s["metric"]), float(s["value"][1]))
                for a in found
                for s in a["result"]
            ]
            text = "\n".join(
                f"{name + ': ' if name and len(values) > 1 else ''}{v:.4g}" for name, v in values
            )
            ax.text(0.5, 0.45, text or "no data", ha="center", va="center", color="#73bf69", size=14)
            continue
        drawn = 0
        series = [(a, s) for a in found for s in a["result"]]
        nonzero = [(a, s) for a, s in series if any(float(v) for _, v in s.get("values", []))]
        for a, s in nonzero or series:  # outcomes that never happened stay out of the legend
            points = [(float(t) - t0, float(v)) for t, v in s.get("values", []) if not math.isnan(float(v))]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(
                    xs,
                    ys,
                    lw=1.2,
                    marker="o",
                    ms=2.5,
                    label=legend(targets.get(a["expr"], ""), s["metric"])[:40],
                )
                drawn += 1
        if drawn:
            ax.legend(fontsize=6, loc="upper left", facecolor="#181b1f", labelcolor="#ccccdc", framealpha=0.6)
            ax.set_xlabel("seconds into the run", color="#8e8e8e", size=7, labelpad=0)
        else:
            reason = "another exporter's series" if "DCGM" in json.dumps(panel) else "no data (dense policy)"
            ax.text(
                0.5, 0.5, reason, ha="center", va="center", color="#8e8e8e", size=9, transform=ax.transAxes
            )
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=110, facecolor=fig.get_facecolor())
    print(f"{output}: {len(answers)} queries drawn")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, help="answers already collected (default: run the test)")
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "img" / "dashboard-data.png")
    args = parser.parse_args()
    if args.data is None:
        with tempfile.TemporaryDirectory() as tmp:
            data = Path(tmp) / "answers.json"
            collect(data)
            answers = json.loads(data.read_text())
    else:
        answers = json.loads(args.data.read_text())
    draw(answers, args.output)


if __name__ == "__main__":
    main()

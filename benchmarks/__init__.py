"""logprobd's benchmarks.

- Suites, each `python -m benchmarks.<suite>`, each writing a result file that BENCHMARKS.md can
  cite: run (the standard workload), grpo (prefix sharing; plain-JSON clients), long, invariance,
  moe, replay, distribution, reload, tp, startup.
- What they share: harness.py (provenance, timing, models, the result file, a suite's loop over its
  models), server.py (the app on loopback and the rounds sent to it), client.py (the client
  processes), workload.py (workloads and floors), shapes.py (model shapes), peers.py (the naive
  peers).
- page/: BENCHMARKS.md, generated from the result files (`python -m benchmarks.page`).
- probes/: one-off measurements (`python -m benchmarks.probes.<probe>`).
- smoke_deployed.py and dashboard_picture.py: the deployed service's GPU smoke test and the
  dashboard picture of docs/observability.md.
"""

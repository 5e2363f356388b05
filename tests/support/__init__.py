"""What the tests share; nothing here is a test. Imported as `tests.support.<module>`.

Checkpoints and references, written independently of the service:
- models.py: tiny random-weight checkpoints of every architecture; critics.py: critic checkpoints in
  the formats RL frameworks write; teacher.py: a teacher with a tokenizer, and its float64 reference
- reference.py: the per-sequence float32 reference of docs/semantics.md; distribution.py: the float64
  reference of top-k, candidates and sampling; completions.py: the vLLM/OpenAI JSON of an answer
  built entry by entry, and the streamed completions' expected bytes
- requests.py: random requests in every layout; plans.py: normalise() on keyword fields
- frameworks.py: each RL framework's scoring re-implemented; releases.py: their released code imported

Running the service:
- device.py: the device and dtype the service side runs on (LOGPROBD_TEST_*), tolerances, settings_for
- servers.py: the app in-process, under uvicorn on loopback, or as a `python -m service serve` process
- launches.py: the app over an engine whose launches are recorded; fakes.py: engines with no model
- faults.py: transports that fail on script, for the client
- policies.py: the batcher's policy driven by hand (requests enqueued, micro-batches taken)
- trainer.py: a trainer's side of SGLang's weight push (rank 0, on SGLang's released helpers), a
  process of its own

Deployment and docs: chart.py renders the Helm chart, check_chart.py checks it (`make chart`), crds.py
holds the custom resources' schemas, prometheus.py runs a real Prometheus on what the chart renders,
dockerfile.py reads the Dockerfile; docs.py loads docs/hooks.py.

needs.py: the markers for what a test needs from the host (gpu, hopper, quack, liger, two_gpus), a
pytest plugin tests/conftest.py loads; and the CI switches LOGPROBD_REQUIRE_*.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository: a server process's working directory

# logprobd developer commands. `make serve` and `make test` do all set-up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
# transformers: the oldest supported release by default; CI also runs `TRANSFORMERS=newest`.
TRANSFORMERS ?= 5.17.0
# `make pytest`'s pytest-xdist workers: two, each running a fixed half of tests/ in a fixed order
# (tests/support/workers.py), take about half the time of one process on two cores; 0: one process
PYTEST_WORKERS ?= 2
PY := $(VENV)/bin/python
# Two installs into one venv: `make serve` the service and what it imports (requirements.txt,
# `-e .[server]`), `make test` the development tools on top (requirements-dev.txt, `-e .[dev]`, which
# brings `server` too). A plain `pip install .` is the trainer-side client alone.
SERVE_STAMP := $(VENV)/.serve-$(TRANSFORMERS)
STAMP := $(VENV)/.installed-$(TRANSFORMERS)
ifeq ($(TRANSFORMERS),newest)
TRANSFORMERS_REQ := transformers
else
TRANSFORMERS_REQ := transformers==$(TRANSFORMERS)
endif

.PHONY: install install-serve serve test lint typecheck docs pytest test-gpu openapi config-docs chart clean

$(SERVE_STAMP): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt -e ".[server]" "$(TRANSFORMERS_REQ)"
	rm -f $(VENV)/.serve-*
	touch $@

$(STAMP): $(SERVE_STAMP) requirements-dev.txt requirements-frameworks.txt requirements-lm-eval.txt
	$(PY) -m pip install -q -r requirements-dev.txt "$(TRANSFORMERS_REQ)"
	$(PY) -m pip install -q --no-deps --upgrade --target $(VENV)/frameworks -r requirements-frameworks.txt  # RL trainers' releases (tests/client/test_releases.py), SGLang's push helpers (tests/support/trainer.py)
	$(PY) -m pip install -q --no-deps --upgrade --target $(VENV)/lm-eval -r requirements-lm-eval.txt  # lm-eval's command line for tests/e2e/test_lm_eval_cli.py
	rm -f $(VENV)/.installed-*
	touch $@

install-serve: $(SERVE_STAMP)  ## the service alone: what `make serve` needs

install: $(STAMP)  ## everything `make test` needs

serve: install-serve  ## run the server (demo model unless LOGPROBD_MODEL or ARGS="--model DIR")
	$(PY) -m service serve $(ARGS)

test: lint typecheck docs pytest  ## every gate: ruff, mypy --strict, the docs build, the test suite

lint: install
	$(PY) -m ruff check service tests benchmarks examples docs/hooks.py
	$(PY) -m ruff format --check service tests benchmarks examples docs/hooks.py
	$(VENV)/bin/lint-imports  # the import contracts in pyproject.toml

typecheck: install
	$(PY) -m mypy service tests benchmarks examples docs/hooks.py

docs: install  ## build the documentation site into build/site; --strict: any warning fails
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet

pytest: install  ## the test suite on PYTEST_WORKERS processes, each a fixed half of tests/ in a fixed order
	$(PY) -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
	$(PY) -m pytest -n $(PYTEST_WORKERS) $(PYTEST_ARGS)

openapi: install  ## regenerate openapi.yaml from the app, then the committed pages generated from it (docs/hooks.py)
	$(PY) -m service openapi --output openapi.yaml
	$(PY) docs/hooks.py

config-docs: install  ## regenerate docs/configuration.md from service/settings.py
	$(PY) -m service config-docs --output docs/configuration.md

chart: install  ## render the Helm chart into build/chart (each ci/ values file, or VALUES="a.yaml b.yaml"), lint and validate it as tests/deploy does
	$(PY) -m tests.support.check_chart --output build/chart $(if $(VALUES),--values $(VALUES))

# The GPU suite, on a CUDA host with a CUDA torch (not this .venv's CPU one): GPU_PYTHON runs it.
GPU_PYTHON ?= python3
GPU_DTYPES ?= bfloat16 float16 float32
OUT ?= .
GPU_PYTEST = $(GPU_PYTHON) -m pytest -q -W ignore::UserWarning -p no:cacheprovider $(PYTEST_ARGS)

test-gpu:  ## on a CUDA host: every test marked gpu, then the parity suites on cuda in each dtype (docs/development.md)
	$(GPU_PYTHON) -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name())'
	status=0; \
	echo "== the tests marked gpu"; \
	$(GPU_PYTEST) -m gpu || status=1; \
	for dtype in $(GPU_DTYPES); do \
	  echo "== the parity suites on cuda, $$dtype"; \
	  LOGPROBD_TEST_DEVICE=cuda LOGPROBD_TEST_DTYPE=$$dtype LOGPROBD_TEST_REPORT=$(OUT)/parity-$$dtype.json \
	    $(GPU_PYTEST) -m "parity and not gpu" || status=1; \
	  cat $(OUT)/parity-$$dtype.json 2>/dev/null; \
	done; \
	exit $$status

clean:
	rm -rf .venv .venv-* .mypy_cache .ruff_cache .pytest_cache

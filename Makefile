# logprobd developer commands. `make serve` and `make test` do all set-up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
# transformers: the oldest supported release by default; CI also runs `TRANSFORMERS=newest`.
TRANSFORMERS ?= 5.17.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(TRANSFORMERS)
ifeq ($(TRANSFORMERS),newest)
TRANSFORMERS_REQ := transformers
else
TRANSFORMERS_REQ := transformers==$(TRANSFORMERS)
endif

.PHONY: install serve test lint typecheck pytest openapi gpu-parity clean

$(STAMP): requirements-dev.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt "$(TRANSFORMERS_REQ)"
	rm -f $(VENV)/.installed-*
	touch $@

install: $(STAMP)

serve: install  ## run the server (demo model unless LOGPROBD_MODEL or ARGS="--model DIR")
	$(PY) -m service serve $(ARGS)

test: lint typecheck pytest  ## every gate: ruff, mypy --strict, the test suite

lint: install
	$(PY) -m ruff check service tests benchmarks examples
	$(PY) -m ruff format --check service tests benchmarks examples

typecheck: install
	$(PY) -m mypy service tests benchmarks examples

pytest: install
	$(PY) -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
	$(PY) -m pytest $(PYTEST_ARGS)

openapi: install  ## regenerate openapi.yaml from the app
	$(PY) -m service openapi --output openapi.yaml

gpu-parity:  ## on a CUDA host: parity suite in bf16/fp16/fp32 (see README, Development)
	bash tests/gpu/run_parity.sh

clean:
	rm -rf .venv .venv-* .mypy_cache .ruff_cache .pytest_cache

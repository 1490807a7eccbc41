# Set-up and entry points. `make test` and `make bench` work on a fresh
# machine: they create .venv, install torch and the build tools, build the
# extension in place (pip install --no-build-isolation -e .) and run.
#
#   make test                 # the test suite but its slow tests (CI runs this, then make test-slow,
#                             # test-python-hooks and sweep)
#   make lint                 # ruff: lint and format check (CI runs it first)
#   make bench                # the benchmark suite on the best device present
#
# The default torch is 2.14.1, a CUDA 13.0 build: with a CUDA toolkit present
# (CUDA_HOME, or /usr/local/cuda) the CUDA kernels are compiled too, GPU or not,
# and their tests run on every GPU present. TORCH=torch==2.13.0 (a CPU build)
# skips them and installs much faster.

PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.14.1
# The frameworks the integration tests train with (tests/test_frameworks.py),
# and transformers 4.x in a folder of its own beside 5.x.
FRAMEWORKS   ?= transformers==5.24.0 accelerate==1.15.0 pytorch-lightning==2.6.6 peft==0.21.2
TRANSFORMERS4 ?= transformers==4.57.6
PY     := $(VENV)/bin/python
# The formatter and linter (configured in pyproject.toml), pinned: a new release may format otherwise.
RUFF   ?= ruff==0.17.6
NATIVE_SOURCES := $(shell find csrc -type f) setup.py pyproject.toml

.PHONY: test test-slow test-python-hooks sweep lint format bench build clean gpu-deps

$(VENV)/.deps:
	@echo "== setting up $(VENV): $(TORCH) (a CUDA build is ~5.5 GB), ninja, pytest, pytest-xdist, numpy, matplotlib; 1-3 minutes"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)" ninja pytest pytest-xdist expecttest numpy matplotlib "setuptools>=77" wheel "$(RUFF)"
	if $(PY) -c "import sys, torch; sys.exit(0 if torch.version.cuda else 1)"; then \
		$(PY) -m pip install --quiet cuda-bindings; fi
	@echo "== test frameworks: $(FRAMEWORKS), and $(TRANSFORMERS4) in $(VENV)/transformers4"
	$(PY) -m pip install --quiet $(FRAMEWORKS)
	$(PY) -m pip install --quiet --target $(VENV)/transformers4 "$(TRANSFORMERS4)"
	touch $@

# The in-place build the tests run. Without a GPU the CUDA kernels can only be
# compiled and linked, not run: one architecture (sm_90) shows that, in half
# the time of the release default (8.0;9.0+PTX, which pip install . builds).
# TORCH_CUDA_ARCH_LIST=... overrides it.
NO_GPU_ARCH ?= 9.0

$(VENV)/.built: $(VENV)/.deps $(NATIVE_SOURCES)
	@echo "== building accumkernels' CPU kernels (and its CUDA kernels where a toolkit is found): about 2 minutes on 2 cores"
	if [ -z "$$TORCH_CUDA_ARCH_LIST" ] && ! $(PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then \
		export TORCH_CUDA_ARCH_LIST="$(NO_GPU_ARCH)"; fi; \
	$(PY) -m pip install --quiet --no-build-isolation --no-deps -e .
	touch $@

build: $(VENV)/.built

# Two pytest-xdist workers, one thread each (tests/conftest.py), a module (or
# class) at a time: a module that spawns ranks for its tests does so once.
# make test runs every test but those marked slow (pyproject.toml says which);
# make test-slow runs those, and CI runs both, then the seed sweep.
PYTEST := ACCUMKERNELS_REQUIRE_FRAMEWORKS=1 $(PY) -m pytest -ra -n 2 --dist loadscope
SEEDS  ?= 10

test: build
	$(PYTEST) -m "not slow"

# ruff's lint and format check (pyproject.toml's [tool.ruff]); make format rewrites the files.
lint: $(VENV)/.deps
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: $(VENV)/.deps
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

test-slow: build
	$(PYTEST) -m slow

# The "hooks" intake's tests once more with its Python pre-hooks only (as
# without the extension) instead of the native inbox (tests/conftest.py). Not
# tests/test_pipeline.py: its ranks are spawned processes, which the switch
# does not reach (make test runs them).
PYTHON_HOOK_TESTS := tests/test_optimizer.py tests/test_contract.py tests/test_lean_window.py tests/test_amp.py \
	tests/test_conformance.py
test-python-hooks: build
	ACCUMKERNELS_PYTHON_HOOKS=1 $(PYTEST) -m "not slow" $(PYTHON_HOOK_TESTS)

# The numeric tests at $(SEEDS) fresh seeds (reference and CPU backends): every bound must hold at every seed.
sweep: build
	ACCUMKERNELS_TEST_BACKENDS=reference,cpu $(PY) tests/seed_sweep.py --seeds $(SEEDS)

# The convergence benchmark's peers (bench/convergence.py), installed for make bench only.
PEERS ?= torchao==0.18.0 bitsandbytes

$(VENV)/.bench-deps: $(VENV)/.deps
	@echo "== the convergence benchmark's peers: $(PEERS)"
	$(PY) -m pip install --quiet $(PEERS)
	touch $@

bench: build $(VENV)/.bench-deps
	$(PY) -m bench.run

# For a GPU machine without network (bench/gpu_check.sh; carry .gpu-deps): a
# setuptools that reads pyproject.toml's SPDX license (>= 77). pytest and
# pytest-xdist are the machine's own (a second pytest here would shadow the one
# its xdist was built with).
gpu-deps:
	rm -rf .gpu-deps
	$(PYTHON) -m pip install --quiet --no-deps --target .gpu-deps "setuptools>=77"

clean:
	rm -rf build *.egg-info accumkernels/_C*.so $(VENV)/.built

# Set-up and entry points. `make test` and `make bench` work on a fresh
# machine: they create .venv, install torch and the build tools, build the
# extension in place (pip install --no-build-isolation -e .) and run.
#
#   make test                 # the whole test suite (CI runs this)
#   make bench                # kernel benchmark on the best device present
#   TORCH=torch==2.14.1 make  # another torch (a CUDA build compiles csrc/cuda too)

PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
PY     := $(VENV)/bin/python
NATIVE_SOURCES := $(shell find csrc -type f) setup.py pyproject.toml

.PHONY: test bench build clean

$(VENV)/.deps:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)" ninja pytest numpy "setuptools>=64" wheel
	touch $@

$(VENV)/.built: $(VENV)/.deps $(NATIVE_SOURCES)
	$(PY) -m pip install --quiet --no-build-isolation --no-deps -e .
	touch $@

build: $(VENV)/.built

test: build
	$(PY) -m pytest -ra

bench: build
	$(PY) -m bench.kernels

clean:
	rm -rf build *.egg-info accumkernels/_C*.so $(VENV)/.built

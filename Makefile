# Each target does its own setup on a fresh machine. The CPU build of torch is pinned: a bare
# `torch` would pull a multi-GB CUDA build.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0
STAMP := $(VENV)/.qckpt-setup

.PHONY: setup demo test test-fast bench lint format clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -c constraints.txt -e ".[test]"
	touch $(STAMP)

demo: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" bash scripts/demo.sh

test: setup
	$(PY) -m pytest -q -x --durations=15 tests

# Small runs that fit this CPU machine; the figures in docs/BENCHMARKS.md come from full-size runs
# on an H200 (the commands are listed there).
bench: setup
	$(PY) -m bench.formats --sizes 8 --iters 3
	$(PY) -m bench.load --layers 8 --dim 1024
	$(PY) -m bench.export --size-gb 0.25 --repeat 1
	$(PY) -m torch.distributed.run --standalone --nproc-per-node 2 -m bench.sync -n 2000 --backend gloo

lint: setup
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf runs .pytest_cache

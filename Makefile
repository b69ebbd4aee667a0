# Baton: `make demo` and `make test` work from nothing (they create .venv first).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
EXTRAS ?= test,serve,transfer,load

.PHONY: install test test-unit test-gpu demo clean

install: $(VENV)/.installed

# torch first, pinned, so a CPU machine never pulls the CUDA stack.
$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[$(EXTRAS)]'
	touch $@

test: install
	RAY_USAGE_STATS_ENABLED=0 $(BIN)/python -m pytest -q -m "not gpu"

# The inner loop: no Ray, no GPU, nothing slow (tests/conftest.py marks them `unit`).
test-unit: install
	RAY_USAGE_STATS_ENABLED=0 $(BIN)/python -m pytest -q -m unit

test-gpu: install
	$(BIN)/python -m pytest -q -m gpu

demo: install
	$(BIN)/baton demo

clean:
	rm -rf $(VENV) .pytest_cache

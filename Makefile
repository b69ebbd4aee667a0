# Baton: `make demo` and `make test` work from nothing (they create .venv first).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
EXTRAS ?= test,serve,transfer,load
TORCH  ?= 2.13.0

.PHONY: install test test-unit test-gpu demo clean

install: $(VENV)/.installed

# torch first, pinned, and the build that fits the machine (deploy/torch_install.py): the CPU
# wheels where there is no NVIDIA GPU, so a laptop never pulls the CUDA stack.
$(VENV)/.installed: pyproject.toml Makefile deploy/torch_install.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $$($(PYTHON) deploy/torch_install.py $(TORCH))
	$(BIN)/pip install -q -e '.[$(EXTRAS)]'
	touch $@

test: install
	RAY_USAGE_STATS_ENABLED=0 $(BIN)/python -m pytest -q -m "not gpu" --durations=25

# The inner loop: no Ray, no GPU, nothing slow (tests/conftest.py marks them `unit`).
test-unit: install
	RAY_USAGE_STATS_ENABLED=0 $(BIN)/python -m pytest -q -m unit

test-gpu: install
	$(BIN)/python -m pytest -q -m gpu

demo: install
	$(BIN)/baton demo

clean:
	rm -rf $(VENV) .pytest_cache

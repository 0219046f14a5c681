# The two commands of the README: `make demo` and `make test`. Both create .venv when missing and install
# every distribution of this repository into it in editable mode.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# core first, then every plugin distribution; each has its own pyproject.toml.
DISTS := core $(sort $(dir $(wildcard plugins/*/pyproject.toml)))
STAMP := $(VENV)/.installed
PYTEST_WORKERS ?= 2

.PHONY: setup demo test lint bench clean

$(STAMP): requirements-dev.txt $(foreach d,$(DISTS),$(d)/pyproject.toml) Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements-dev.txt
	$(BIN)/python -m pip install --quiet --no-build-isolation $(foreach d,$(DISTS),-e $(d))
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo/train_lm.py

test: $(STAMP)
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) -q

lint: $(STAMP)
	$(BIN)/ruff check core plugins tests examples benchmarks

bench: $(STAMP)
	$(BIN)/python -m benchmarks

clean:
	rm -rf $(VENV) demo_output

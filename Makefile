# `make test` and `make demo` create or refresh .venv themselves (README, first screen).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: venv test check lint typecheck unit fast demo bench clean fuzz

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

lint: venv
	$(BIN)/ruff check .

typecheck: venv
	$(BIN)/mypy --strict common encoder_client runtime shuffler analyzer services

unit: venv
	$(BIN)/pytest

# The inner loop's tier: in-process tests only (no `system` or `slow` mark; tests/conftest.py).
fast: venv
	$(BIN)/pytest -q -m "not system and not slow"

# Lint, types and the fast tier (< 3 min on 2 cores); `make test` runs everything, as CI.
check: lint typecheck fast

test: lint typecheck unit

# Long schemathesis runs against both services (the suite runs 200 cases per operation).
FUZZ_EXAMPLES ?= 5000
fuzz: venv
	ESA_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(BIN)/pytest -s tests/shuffler/test_fuzz.py tests/analyzer/test_fuzz.py

demo: venv
	$(BIN)/esa demo

bench: venv
	$(BIN)/python benchmarks/accounting.py
	$(BIN)/python benchmarks/lifetime.py
	$(BIN)/python benchmarks/mechanisms.py
	$(BIN)/python benchmarks/shuffler.py
	$(BIN)/python benchmarks/analyzer.py
	$(BIN)/python benchmarks/client.py
	$(BIN)/python benchmarks/demo.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache

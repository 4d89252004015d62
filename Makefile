# `make test` and `make demo` create or refresh .venv themselves (README, first screen).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: venv test check lint typecheck unit fast demo bench clean fuzz sdk-js

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

# Two pytest-xdist workers, one per core (the system tests mostly wait on epochs and processes;
# three were ~15 min on 2 cores and one ~45, but three made timing-sensitive tests flaky), each
# running a module whole, tests/deploy whole (tests/conftest.py's work_unit); then the `serial`
# tests, alone. The slowest 40 are listed at the end, to keep the suite within its budget.
WORKERS ?= 2
unit: venv
	$(BIN)/pytest -n $(WORKERS) --dist loadscope --durations=40 -m "not serial"
	$(BIN)/pytest --durations=10 -m serial

# The inner loop's tier: in-process tests only (no `system` or `slow` mark; tests/conftest.py),
# on two pytest-xdist workers (one per core).
fast: venv
	$(BIN)/pytest -q -n 2 --dist loadscope -m "not system and not slow"

# Lint, types and the fast tier (< 3 min on 2 cores); `make test` runs everything, as CI.
check: lint typecheck fast

# The TypeScript device SDK (sdk-js/): install from its lockfile, build, run its tests (the
# shared wire vectors included; ~30 s). Before `unit`, whose system tests use its build.
sdk-js:
	cd sdk-js && npm ci --no-audit --no-fund && npm test

test: lint typecheck sdk-js unit

# Long schemathesis runs against both services (the suite runs 200 cases per operation).
FUZZ_EXAMPLES ?= 5000
fuzz: venv
	ESA_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(BIN)/pytest -s tests/shuffler/test_fuzz.py tests/analyzer/test_fuzz.py

demo: venv
	$(BIN)/esa demo

# The core benchmarks, printed; `make bench WRITE=--write` also records them in docs/benchmarks.md.
WRITE ?=
bench: venv
	$(BIN)/python benchmarks/accounting.py $(WRITE)
	$(BIN)/python benchmarks/lifetime.py $(WRITE)
	$(BIN)/python benchmarks/mechanisms.py $(WRITE)
	$(BIN)/python benchmarks/shuffler.py $(WRITE)
	$(BIN)/python benchmarks/analyzer.py $(WRITE)
	$(BIN)/python benchmarks/client.py $(WRITE)
	$(BIN)/python benchmarks/demo.py $(WRITE)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache sdk-js/node_modules sdk-js/dist sdk-js/build

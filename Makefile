# varuna-sdk: `make demo` and `make test` each set up what is missing (idempotently) first.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.setup-done

.PHONY: setup compile demo test bench clean

setup: $(STAMP)

# One place for set-up: a venv with pinned packages and the C++ core built by pip.
$(STAMP): pyproject.toml CMakeLists.txt csrc/*.cpp csrc/*.h scripts/setup.sh
	PYTHON=$(PYTHON) bash scripts/setup.sh
	touch $(STAMP)

# Byte-compiled once here: with PYTHONDONTWRITEBYTECODE set (CI images set it) every worker
# process would otherwise compile the package's sources again (~0.15 s of CPU each).
compile: setup
	$(PY) -m compileall -q -j 0 varuna_sdk dashboard tests benchmarks scripts

demo: compile
	$(VENV)/bin/varuna demo

test: compile
	$(VENV)/bin/ruff check --no-cache .
	$(PY) -m pytest -q

bench: setup
	for b in benchmarks/bench_*.py; do $(PY) $$b || exit 1; done
	$(PY) benchmarks/report.py

clean:
	rm -rf build $(VENV) .pytest_cache

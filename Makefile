# The two commands a newcomer needs: `make demo` and `make test` (`make test-fast` while editing). All create
# .venv and install SkyFed with the pinned constraints on first use.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.skyfed-installed
BENCH_STAMP := $(VENV)/.skyfed-bench-installed
PYTEST_ARGS ?=
# Two workers on CI's two cores: most tests wait on brokers, daemons and deadlines, not the CPU. A test file
# stays on one worker (its module fixtures, a browser or a federation, are made once).
PYTEST_WORKERS ?= 2
# Bytecode written once for every process the tests start: where the environment sets PYTHONDONTWRITEBYTECODE
# (this VM does), each daemon would compile SkyFed's modules again, about 0.3 s a start.
PACKAGES := agent broker_server common flcore models participant protocol provisioning region security sim skyfed

.PHONY: install demo test test-fast bench lint clean

# The grep drops pip-config noise about local wheel folders that are absent on some machines.
$(STAMP): setup.cfg pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[dev,broker,detect]' 2>&1 \
		| { grep -v "^WARNING: Location 'file:" || true; }
	touch $(STAMP)

# make bench also compares SkyFed with Flower (benchmarks.flower): the bench extra adds flwr, pinned like the rest.
$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[dev,broker,detect,bench]' 2>&1 \
		| { grep -v "^WARNING: Location 'file:" || true; }
	touch $(BENCH_STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m skyfed demo

test: $(STAMP)
	$(PY) -m compileall -q $(PACKAGES)
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# The in-process tier: no broker, daemon, browser or other process (tests/conftest.py marks those integration).
test-fast: $(STAMP)
	$(PY) -m compileall -q $(PACKAGES)
	$(PY) -m pytest -q -m "not integration" -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

bench: $(BENCH_STAMP)
	$(PY) -m compileall -q $(PACKAGES)
	$(PY) -m benchmarks

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf runs .pytest_cache .ruff_cache *.egg-info

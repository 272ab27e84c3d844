# The two set-up commands of the README:
#   make node ARGS="--pool-size 8gb"   install everything, then run the node daemon
#   make test                          install what the tests need, then run the whole suite
PYTHON ?= python3
ARGS ?=
PYTEST_ARGS ?=

.PHONY: node test install install-test lint

install:
	PYTHON=$(PYTHON) scripts/install.sh run

install-test:
	PYTHON=$(PYTHON) scripts/install.sh test

node: install
	exec pegaflow-node $(ARGS)

test: install-test
	$(PYTHON) -m ruff check pegaflow tests bench
	$(PYTHON) -m pytest -ra $(PYTEST_ARGS)

lint:
	$(PYTHON) -m ruff check pegaflow tests bench

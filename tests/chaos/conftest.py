"""Chaos scenarios: real daemons and processes, faults injected, figures reported.

Every test here is marked ``chaos``; the ``PEGAFLOW_CHAOS`` environment variable picks the
intensity (see ``tests/chaos/common.py``).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.chaos.procs import kill_leftovers
from tests.integration.redis_fixtures import redis_server  # noqa: F401 - a real redis-server


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/chaos/" in str(item.fspath):
            item.add_marker(pytest.mark.chaos)


@pytest.fixture(autouse=True)
def _no_worker_outlives_its_test() -> Iterator[None]:
    yield
    kill_leftovers()

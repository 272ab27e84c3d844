"""tests/gpu: run where CUDA is present; elsewhere every test here is skipped, saying why."""

from __future__ import annotations

import pytest
import torch

REASON = "no CUDA device (torch.cuda.is_available() is False): tests/gpu run on a GPU host"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.skip(reason=REASON))

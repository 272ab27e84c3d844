"""pegaflow-meta serves gRPC with grpc core's EventEngine off (pegaflow/meta/cli.py), set before
grpc loads, unless the operator chose GRPC_EXPERIMENTS; a process that already runs grpc is
left as it is."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pegaflow.meta import cli

PROBE = """
import os, sys
from pegaflow.meta import cli
assert "grpc" not in sys.modules, "importing the cli must not load grpc"
cli.grpc_without_event_engine()
import grpc  # noqa: F401
print(os.environ["GRPC_EXPERIMENTS"])
"""


def probe(env: dict[str, str]) -> str:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60, check=True,
                         env={k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"} | env)
    return out.stdout.strip()


def test_the_event_engine_is_off_before_grpc_loads_unless_the_operator_chose() -> None:
    assert probe({}) == cli.GRPC_EXPERIMENTS
    assert probe({"GRPC_EXPERIMENTS": "event_engine_listener"}) == "event_engine_listener"


def test_a_process_already_running_grpc_is_left_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    import grpc  # noqa: F401 - loaded, as in any test process

    monkeypatch.delenv("GRPC_EXPERIMENTS", raising=False)
    cli.grpc_without_event_engine()
    assert "GRPC_EXPERIMENTS" not in os.environ

"""What every process the harness starts shares: the directory it runs in, its environment,
and how a process group is ended."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from pathlib import Path

from tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]


def log_events(log: str, event: str) -> list[dict]:
    """The records of ``event`` in a daemon's JSON log (``--log-format json``), in order; lines
    that are not JSON objects (a traceback, another library's print) are passed over."""
    out = []
    for line in log.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("event") == event:
            out.append(rec)
    return out


def python_env(**extra: str) -> dict[str, str]:
    """This process's environment, read now (tests/conftest.py sets XDG_RUNTIME_DIR and
    VLLM_RPC_BASE_PATH when the run starts), with the repository on PYTHONPATH so a child can
    run ``-m tests....`` modules from any directory; ``extra`` on top."""
    return {**os.environ, "PYTHONPATH": str(REPO), **extra}


def stop_group(proc: subprocess.Popen, timeout: float, term: bool = True) -> None:  # type: ignore[type-arg]
    """End a process started with ``start_new_session``: SIGTERM its group (``term=False``: it
    was already asked to quit), wait, and SIGKILL what is left of the group. The group is
    ended even when its leader is already gone: a vLLM API server killed by a test leaves
    its engine-core and worker processes behind, in its group."""
    if term:
        _killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    with contextlib.suppress(AssertionError):  # a grace period: what outlives it is killed below
        wait_until(lambda: not _killpg(proc.pid, 0), timeout, "the rest of the group to exit")
    _killpg(proc.pid, signal.SIGKILL)


def _killpg(pgid: int, sig: int) -> bool:
    """Signal a process group; False if no process is left in it."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    return True

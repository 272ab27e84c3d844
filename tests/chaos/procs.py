"""Starting, killing and reading the chaos worker processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.waiting import next_line

ROOT = Path(__file__).resolve().parents[2]


class Worker:
    live: list[Worker] = []  # every worker started, so a failed test's are killed (kill_leftovers)

    def __init__(self, role: str, addr: str, seed: int, universe: int, *extra: str) -> None:
        self.p = subprocess.Popen([sys.executable, "-m", "tests.chaos.worker", role, addr, str(seed), str(universe),
                                   *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT,
                                  env={**os.environ, "PYTHONPATH": str(ROOT)}, text=True)
        Worker.live.append(self)

    def wait_ready(self, timeout: float = 60) -> None:
        line = self._line(timeout)
        assert json.loads(line).get("ready"), line

    def _line(self, timeout: float) -> str:
        assert self.p.stdout is not None
        return next_line(self.p.stdout, self.p, timeout, "a line from the worker", tail=self._stderr_if_done)

    def _stderr_if_done(self) -> str:
        return self.p.stderr.read()[-2000:] if self.p.stderr and self.p.poll() is not None else ""

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGKILL)
        self.p.wait(30)
        self.close()

    def finish(self, timeout: float = 60) -> dict[str, Any]:
        """SIGTERM, then its totals."""
        self.p.send_signal(signal.SIGTERM)
        line = self._line(timeout)
        self.p.wait(timeout)
        self.close()
        return json.loads(line)

    def stderr(self) -> str:
        return self.p.stderr.read() if self.p.stderr else ""

    def close(self) -> None:
        for f in (self.p.stdout, self.p.stderr):
            if f is not None and not f.closed:
                f.close()


def kill_leftovers() -> None:
    """Kill the workers a test left running (it failed before finishing them)."""
    while Worker.live:
        w = Worker.live.pop()
        if w.p.poll() is None:
            w.kill()


def node_stats(addr: str) -> Any:
    from pegaflow.client import PegaClient

    c = PegaClient(addr, timeout=5)
    try:
        return c.stats()
    finally:
        c.close()


def nothing_held(addr: str) -> bool:
    """No reservation, lease or session is left on the node at ``addr``."""
    st = node_stats(addr)
    return st.active_reservations == 0 and st.active_leases == 0 and st.sessions == 0

"""Daemons started from a preloaded fork server, for the tests: ``pegaflow-node``,
``pegaflow-meta``, the tests' publisher processes and ``pegaflow`` subcommands (``run``)
without paying their imports at every start.

A test run starts ~180 nodes and ~55 metaservers. Each ``python -m pegaflow.node.cli`` spent
~0.55 s of CPU before it served, nearly all of it importing (numpy, grpc, structlog,
prometheus_client, uvicorn, the node's own modules); forked from a process that has imported
them already, a node's start costs ~0.2 s (pre-faulting its pool and starting its servers:
10 starts each, a 2-core VM). The fork server is the standard library's own
(``multiprocessing``'s "forkserver", with ``PRELOAD``), one per test process, started at its
first daemon. Each daemon is still a process of its own running the real entry point: its
command-line module is run as ``__main__`` (``runpy``, as ``python -m`` does) with the
caller's arguments, environment, working directory and log file, and it exits with that
module's status (a signal's as a negative number, as ``subprocess`` reports it).

Only the tests use it (``tests/conftest.py`` turns it on); the benchmarks start their
daemons with ``exec`` as a user does, so a daemon's memory or CPU they report holds nothing
of the fork server's. ``PEGAFLOW_TEST_EXEC=1`` turns it off for a run (to debug a start).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.process
import os
import runpy
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

# What the fork server imports once (tests/harness/forked_preload.py: rich hidden first, as
# the daemons' entry points hide it).
PRELOAD = ["tests.harness.forked_preload"]
ENABLED = False  # set by tests/conftest.py; the benchmarks leave it off
OFF_ENV = "PEGAFLOW_TEST_EXEC"


def enabled() -> bool:
    return ENABLED and os.environ.get(OFF_ENV, "") in ("", "0")


def _context() -> multiprocessing.context.ForkServerContext:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx  # type: ignore[return-value]


def _run(module: str, argv: list[str], env: dict[str, str], cwd: str, log_path: str, out_path: str | None) -> None:
    """In the forked child: become ``python -m module argv...`` with its stderr (and its stdout
    unless ``out_path``) appended to ``log_path``."""
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, path in ((1, out_path or log_path), (2, log_path)):
        f = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(f, fd)
        os.close(f)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    sys.argv = [module, *argv]  # run_module sets argv[0] to the module's file, as -m does
    runpy.run_module(module, run_name="__main__", alter_sys=True)


class Forked:
    """The part of ``subprocess.Popen`` the harness and the tests use, for a forked daemon."""

    def __init__(self, module: str, argv: Sequence[str], env: Mapping[str, str], cwd: Path, log_path: Path,
                 out_path: Path | None = None) -> None:
        self.args = [sys.executable, "-m", module, *argv]
        self._p = _context().Process(target=_run, name=f"{module} {' '.join(argv)}"[:200],
                                     args=(module, list(argv), dict(env), str(cwd), str(log_path),
                                           None if out_path is None else str(out_path)))
        self._p.start()
        # Not one of multiprocessing's children: those are joined when this process exits,
        # and a daemon a failed test left running must not hold the test run open (it is
        # ended like an exec'd one, by the test's teardown or the run's cleanup).
        multiprocessing.process._children.discard(self._p)  # type: ignore[attr-defined]
        assert self._p.pid is not None
        self.pid: int = self._p.pid

    @property
    def returncode(self) -> int | None:
        return self._p.exitcode

    def poll(self) -> int | None:
        return self._p.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._p.join(timeout)
        code = self._p.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return code

    def send_signal(self, sig: int) -> None:
        if self._p.exitcode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start(argv: Sequence[str], env: Mapping[str, str], cwd: Path, log_path: Path,
          out_path: Path | None = None) -> Forked | subprocess.Popen[bytes]:
    """Run ``argv`` (``[sys.executable, "-m", module, *args]``) with stderr, and stdout unless
    ``out_path``, appended to ``log_path``: forked from the fork server when ``enabled()``,
    else exec'd."""
    if enabled():
        exe, dash_m, module, *args = argv
        assert exe == sys.executable and dash_m == "-m", argv
        return Forked(module, args, env, cwd, log_path, out_path)
    with open(log_path, "ab") as log:
        if out_path is None:
            return subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env=dict(env))
        with open(out_path, "ab") as out:
            return subprocess.Popen(list(argv), stdout=out, stderr=log, cwd=cwd, env=dict(env))


def run(argv: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: Path | None = None,
        timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(argv, capture_output=True, text=True, ...)`` for a ``python -m`` command
    (a ``pegaflow`` subcommand): forked from the fork server when ``enabled()``."""
    env = dict(os.environ if env is None else env)
    cwd = cwd or Path.cwd()
    if not enabled():
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    exe, dash_m, module, *args = argv
    assert exe == sys.executable and dash_m == "-m", argv
    with tempfile.TemporaryDirectory(prefix="pf-forked-") as d:
        out, err = Path(d) / "stdout", Path(d) / "stderr"
        p = Forked(module, args, env, cwd, err, out)
        try:
            code = p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)
            raise
        stdout, stderr = (f.read_text(errors="replace") if f.exists() else "" for f in (out, err))
        return subprocess.CompletedProcess(list(argv), code, stdout, stderr)

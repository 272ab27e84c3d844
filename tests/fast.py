"""``make test-fast``: the unit and integration tests in two pytest sessions side by side.

    python -m tests.fast [-n WORKERS] [pytest arguments...]

- the test files that import vLLM (``tests/parallel.py``'s ``VLLM_FILES``: the connector's
  unit tests) in one process: importing vLLM costs ~6.7 s of CPU, paid once instead of once
  per xdist worker, and the workers' collection takes ~2 s instead of ~16 s on 2 cores;
- the rest on ``WORKERS`` xdist workers (``--vllm-files=skip``: a file there that imports
  vLLM is a collection error naming it).

Both hold one machine lock (``PEGAFLOW_TEST_LOCKS``): a ``serial`` test of either runs with
no other test of either. The workers' output streams; the other session's follows when it
has ended. The exit status is the first failing session's (``status``), else 0.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import pytest

from tests import parallel

SELECT = ["-m", "not e2e and not install", "tests/unit", "tests/integration"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.fast", description=__doc__.split("\n\n")[0])
    p.add_argument("-n", type=int, default=4, dest="workers", help="xdist workers for the files without vLLM")
    a, extra = p.parse_known_args(argv)
    run = [sys.executable, "-m", "pytest"]
    with tempfile.TemporaryDirectory(prefix="pf-test-locks-") as locks, \
            tempfile.TemporaryFile("w+") as vllm_out:
        env = {**os.environ, parallel.LOCKS: locks, "PYTHONDONTWRITEBYTECODE": ""}
        vllm = subprocess.Popen([*run, "-ra", "--durations=5", "--vllm-files=only", *SELECT, *extra],
                                env=env, stdout=vllm_out, stderr=subprocess.STDOUT)
        try:
            rest = subprocess.run([*run, "-ra", "--durations=15", "-n", str(a.workers), "--dist", "loadfile",
                                   "--no-loadscope-reorder", "--vllm-files=skip", *SELECT, *extra], env=env).returncode
            vllm_rc = vllm.wait()
        finally:
            if vllm.poll() is None:  # ^C or an error here: the other session goes too
                vllm.terminate()
                vllm.wait(30)
        vllm_out.seek(0)
        print(f"\n==== the test files that import vLLM ({len(parallel.VLLM_FILES)}), in one process ====", flush=True)
        sys.stdout.write(vllm_out.read())
    return status(rest, vllm_rc)


def status(*codes: int) -> int:
    """The run's exit status: a session that collected nothing (pytest's 5, e.g. a ``-k`` that
    selects only the other side's tests) is not a failure unless neither collected anything."""
    if all(c == pytest.ExitCode.NO_TESTS_COLLECTED for c in codes):
        return int(pytest.ExitCode.NO_TESTS_COLLECTED)
    return next((c for c in codes if c not in (0, pytest.ExitCode.NO_TESTS_COLLECTED)), 0)


if __name__ == "__main__":
    sys.exit(main())

"""The workers of one ``pytest -n N`` run (pytest-xdist) sharing a 2-core machine.

What runs where (``--dist loadfile --no-loadscope-reorder``, the Makefile's, and
``file_scheduling`` below):

- the tests of one file go to one worker, one after another, so the file's module fixtures
  (nodes, clusters, vLLM engines) start once;
- every test that starts vLLM engines (marked ``e2e``) is in one unit of work, handed out
  first: one engine module at a time. The router's module alone holds four OpenAI servers
  (~13 GB of the 23 GiB here), and each engine process spends ~17 s of CPU importing;
- the tests marked ``serial`` are one unit too, handed out last;
- the other files go out longest first, by the seconds each took in this checkout's last
  run (the pytest cache), else in the committed table (``tests/file_seconds.json``), so a
  fresh clone (CI) orders them too: in the order collected, the longest files (the benchmarks'
  mechanics, the decode backup) came last and ran on beside idle workers. ``make test-times``
  updates the table from the cache after a run; a file in neither counts as longest.

Every test runs under a lock shared by the run's workers (``machine``): most take it
shared and run side by side; a ``serial`` test takes it exclusive and runs with no other test
of the run at the same time. Those are the tests whose assertions bound wall-clock time (a
first answer within a second of another's, a TTL plus slack, a millisecond wait) or count on
prompt scheduling (one wake per read). The benchmarks' mechanics tests (tests/integration/
test_bench_*.py) check no timing and run beside the others. The lock is ``flock(2)`` on files
in a directory the run's first process makes before the workers start
(``PEGAFLOW_TEST_LOCKS``), so the kernel releases it when a worker dies. A turnstile in front
of it makes it fair: a serial test waiting for the machine holds the turnstile, so no other
test starts meanwhile and it waits only for those already running (without it, workers that
keep taking the shared lock could starve it). The lock spans a test's whole protocol (setup,
call, teardown).

(xdist's own ``xdist_group`` mark does not group under pytest 9.2: it renames
``item._nodeid``, which pytest no longer reads. Hence the units' file below.)
"""
from __future__ import annotations

import fcntl
import json
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

LOCKS = "PEGAFLOW_TEST_LOCKS"  # the directory of the run's lock files, set for its workers
# The test files that import vLLM when collected or when their tests run (the connector's unit
# tests and their fakes, the tests that drive a fake engine's connector): ``make test-fast``
# (tests/fast.py) runs them in a process of their own, so its xdist workers import no vLLM
# (~6.7 s of CPU each time). ``--vllm-files=skip`` fails a file not listed here that imports
# vLLM, naming it: at collection, or the test that imported it.
VLLM_FILES = frozenset({
    "tests/integration/test_connector_with_node.py",
    "tests/integration/test_copy_times.py",
    "tests/integration/test_grafana_prometheus.py",
    "tests/unit/test_connector_hybrid.py",
    "tests/unit/test_connector_names.py",
    "tests/unit/test_connector_original_metrics.py",
    "tests/unit/test_connector_pci.py",
    "tests/unit/test_connector_settings.py",
    "tests/unit/test_connector_router_protocol.py",
    "tests/unit/test_connector_sides.py",
    "tests/unit/test_connector_state_space.py",
    "tests/unit/test_connector_tp_nodes.py",
    "tests/unit/test_connector_waits.py",
    "tests/unit/test_copy_times.py",
    "tests/unit/test_gpu_ready.py",
    "tests/unit/test_inflight.py",
    "tests/unit/test_metrics_docs.py",
    "tests/unit/test_tiers.py",
    "tests/unit/test_vllm_compat.py",
})
VLLM_CHOICES = ("all", "skip", "only")  # --vllm-files: every test file, all but VLLM_FILES, those alone
SERIAL_UNIT = "serial"  # the unit of work of the tests marked serial
ENGINES_UNIT = "engines"  # the unit of work of the tests marked e2e (vLLM engines)
FILE_SECONDS = "pegaflow/file_seconds"  # pytest cache key: seconds per test file, last run
SECONDS_TABLE = Path(__file__).with_name("file_seconds.json")  # the committed seconds per test file


@contextmanager
def _flock(path: str, op: int) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, op)
        yield
    finally:
        os.close(fd)  # releases the lock


@contextmanager
def machine(exclusive: bool) -> Iterator[None]:
    """Hold the run's machine: shared (beside other tests) or ``exclusive`` (alone). Outside
    a parallel run (``PEGAFLOW_TEST_LOCKS`` unset) tests run one at a time anyway."""
    base = os.environ.get(LOCKS)
    if not base:
        yield
        return
    turnstile, share = os.path.join(base, "turnstile"), os.path.join(base, "machine")
    if exclusive:
        with _flock(turnstile, fcntl.LOCK_EX), _flock(share, fcntl.LOCK_EX):
            yield
    else:
        with _flock(turnstile, fcntl.LOCK_EX):
            pass  # not while a serial test waits or runs
        with _flock(share, fcntl.LOCK_SH):
            yield


def _file(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _unit(item: Any) -> str:
    if item.get_closest_marker("serial") is not None:
        return SERIAL_UNIT
    return ENGINES_UNIT if item.get_closest_marker("e2e") is not None else ""


def _units_path() -> str | None:
    base = os.environ.get(LOCKS)
    return os.path.join(base, "units.json") if base else None


def order_and_write_units(items: list[Any], file_seconds: dict[str, float]) -> None:
    """In a worker, after collection: the e2e tests first, then the other files longest
    first (``file_seconds``; a file not in it counts as longest, and with none known the
    collection order stays), the serial tests last; and which tests form the two units, for
    the scheduler (every worker writes the same)."""
    rank = {ENGINES_UNIT: 0, "": 1, SERIAL_UNIT: 2}
    items.sort(key=lambda it: (rank[_unit(it)], -file_seconds.get(_file(it.nodeid), math.inf)))  # stable
    path = _units_path()
    if path is None:
        return
    tmp = f"{path}.{os.getpid()}"
    Path(tmp).write_text(json.dumps({it.nodeid: _unit(it) for it in items if _unit(it)}))
    os.replace(tmp, path)


def known_seconds(cached: dict[str, float]) -> dict[str, float]:
    """Seconds per test file: this checkout's last runs (``cached``, the pytest cache's) over
    the committed table."""
    committed = json.loads(SECONDS_TABLE.read_text()) if SECONDS_TABLE.exists() else {}
    return {**committed, **cached}


def write_table(cache_dir: Path) -> int:
    """The committed table updated from the pytest cache in ``cache_dir`` (a file the cache
    has not timed, e.g. an e2e file after ``make test-fast``, keeps its seconds; files that no
    longer exist go; sorted); returns how many files it holds."""
    known = known_seconds(json.loads((cache_dir / "v" / FILE_SECONDS).read_text()))
    root = SECONDS_TABLE.parent.parent
    table = {f: known[f] for f in sorted(known) if (root / f).exists()}
    SECONDS_TABLE.write_text(json.dumps(table, indent=0) + "\n")
    return len(table)


def vllm_ignored(path: Path, root: Path, choice: str) -> bool:
    """Whether ``--vllm-files=choice`` leaves the test file ``path`` out of the run."""
    if choice == "all" or not (path.name.startswith("test_") and path.suffix == ".py"):
        return False
    listed = path.relative_to(root).as_posix() in VLLM_FILES
    return listed if choice == "skip" else not listed


def count(seconds: dict[str, float], report: Any) -> None:
    """Add a test report's duration to its file's seconds."""
    f = _file(report.nodeid)
    seconds[f] = seconds.get(f, 0.0) + report.duration


def file_scheduling(config: Any, log: Any) -> Any:
    """xdist's ``loadfile`` scheduling with the two units of ``order_and_write_units``. Units
    go out in the order the workers collected them; the scheduler starts once every worker has
    collected, so the units' file is there by then."""
    from xdist.scheduler import LoadFileScheduling

    class FileScheduling(LoadFileScheduling):
        units: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.units is None:
                path = _units_path()
                self.units = json.loads(Path(path).read_text()) if path and os.path.exists(path) else {}
            return self.units.get(nodeid) or super()._split_scope(nodeid)

    return FileScheduling(config, log)


if __name__ == "__main__":  # make test-times
    print(f"{write_table(Path('.pytest_cache'))} test files in {SECONDS_TABLE}")

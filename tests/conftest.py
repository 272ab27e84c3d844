"""The run's directories, the machine shared by the workers of a parallel run
(tests/parallel.py), and real `pegaflow-node` daemons (tests/harness/node.py) as fixtures;
the harness's nodes and metaservers start from a preloaded fork server (tests/harness/forked.py)."""

from __future__ import annotations

import os
import sys
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from tests import parallel
from tests.harness import forked
from tests.harness.dirs import VLLM_RPC, temp_dir_removed_at_exit, vllm_rpc_dir
from tests.harness.node import EVERY_SCRAPE, Node


def pytest_configure(config: pytest.Config) -> None:
    """Sockets a killed process cannot remove go to directories of this run, removed when it
    exits, so the suite leaves nothing in the system temporary directory:

    - vLLM names its ZeroMQ IPC sockets ``$VLLM_RPC_BASE_PATH/<uuid4>`` (default: the system
      temporary directory): about 85 per run (``tests.harness.dirs.vllm_rpc_dir``);
    - a node puts its local socket and its own token in ``$XDG_RUNTIME_DIR`` (else ``/tmp``,
      ``pegaflow.common.security.default_socket_path``): about 11 per run from the tests
      that kill nodes. Clients look for the token there too, and every process a test starts
      inherits the variable. A node with ``--access-group`` still uses ``/tmp``."""
    os.environ[VLLM_RPC] = vllm_rpc_dir()
    os.environ["XDG_RUNTIME_DIR"] = temp_dir_removed_at_exit("pf-test-run-")  # 0700, as a user's is
    forked.ENABLED = True  # nodes and metaservers fork from a fork server with their imports done
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        # pytest -n N: the first process, before it starts the workers, which inherit this
        # (unless the run shares a machine with another session: tests/fast.py)
        os.environ.setdefault(parallel.LOCKS, temp_dir_removed_at_exit("pf-test-locks-"))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--vllm-files", choices=parallel.VLLM_CHOICES, default="all",
                     help="all test files, all but those that import vLLM (tests/parallel.VLLM_FILES), or those "
                          "alone: make test-fast runs the two sides in sessions of their own (tests/fast.py)")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    return True if parallel.vllm_ignored(collection_path, config.rootpath, config.getoption("vllm_files")) else None


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    """With ``--vllm-files=skip``, a test file whose import loads vLLM is a collection error."""
    checked = isinstance(collector, pytest.Module) and collector.config.getoption("vllm_files") == "skip"
    before = "vllm" in sys.modules
    report = yield
    if checked and not before and "vllm" in sys.modules:
        report.outcome = "failed"
        report.longrepr = (f"{collector.nodeid} imports vLLM: list it in tests/parallel.py's VLLM_FILES, which "
                           "make test-fast runs in a process of its own")
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    """With ``--vllm-files=skip``, a test that imports vLLM as it runs fails, naming its file."""
    checked = (item.config.getoption("vllm_files") == "skip" and "vllm" not in sys.modules
               and not parallel.vllm_ignored(item.path, item.config.rootpath, "skip"))  # a listed file named as an argument
    yield
    if checked and "vllm" in sys.modules:
        raise AssertionError(f"{item.path.relative_to(item.config.rootpath)} imports vLLM as its tests run: list it "
                             "in tests/parallel.py's VLLM_FILES, which make test-fast runs in a process of its own")


@pytest.hookimpl(trylast=True)  # after the conftests that add marks (tests/chaos/)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In a worker of ``pytest -n N``: the order and the units of work of the scheduler
    (tests/parallel.py), from the marks and the seconds per file of the last runs."""
    if hasattr(config, "workerinput"):
        cache = getattr(config, "cache", None)
        parallel.order_and_write_units(items, parallel.known_seconds(cache.get(parallel.FILE_SECONDS, {}) if cache else {}))


_seconds: dict[str, float] = {}  # test file -> seconds in this run (setup + call + teardown)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    parallel.count(_seconds, report)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """The seconds each test file took, for the next parallel run's order (the first process
    only: it has every worker's reports)."""
    cache = getattr(session.config, "cache", None)
    if cache is not None and _seconds and not hasattr(session.config, "workerinput"):
        last = cache.get(parallel.FILE_SECONDS, {})
        cache.set(parallel.FILE_SECONDS, {**last, **{f: round(s, 1) for f, s in _seconds.items()}})


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """``--dist loadfile`` (the Makefile's): a file's tests on one worker; the e2e tests
    together, first; the serial tests together, last (tests/parallel.py)."""
    if config.getvalue("dist") != "loadfile":
        return None
    return parallel.file_scheduling(config, log)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[object]:
    """Each test holds the machine, alone if marked ``serial`` (tests/parallel.py)."""
    with parallel.machine(exclusive=item.get_closest_marker("serial") is not None):
        return (yield)


def _nodes(log_dir: Path) -> Iterator:
    nodes: list[Node] = []

    def make(pool_size: str = "64mb", extra: list[str] | None = None, start: bool = True,
             env: dict[str, str] | None = None) -> Node:
        n = Node(log_dir, pool_size, render_interval=EVERY_SCRAPE, extra=extra or (), env=env)
        nodes.append(n)
        return n.start() if start else n

    yield make
    for n in nodes:
        n.kill()
        n.remove_local_socket()


@pytest.fixture
def node_factory(tmp_path: Path) -> Iterator:
    """Start nodes (64 MiB pools unless asked, /metrics rendered on every scrape); each is
    killed at the end of the test and its local socket removed."""
    yield from _nodes(tmp_path)


@pytest.fixture(scope="module")
def module_node_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """``node_factory`` for nodes that a module's tests share: killed after its last test. For
    tests that each check only what their own calls did (a node start is ~0.5 s of CPU)."""
    yield from _nodes(tmp_path_factory.mktemp("nodes"))


@pytest.fixture
def node(node_factory) -> Node:
    return node_factory()

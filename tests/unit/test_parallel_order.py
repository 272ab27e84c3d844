"""The order a parallel run hands out its test files in (tests/parallel.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests import parallel

ROOT = Path(parallel.__file__).parent.parent


def item(nodeid: str, mark: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(nodeid=nodeid, get_closest_marker=lambda name: object() if name == mark else None)


def test_the_engines_go_first_the_serial_tests_last_and_the_rest_longest_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(parallel.LOCKS, raising=False)  # no units' file to write
    items = [item("a.py::t"), item("b.py::t"), item("s.py::t", "serial"), item("new.py::t"), item("e.py::t", "e2e"),
             item("b.py::u")]
    parallel.order_and_write_units(items, {"a.py": 1.0, "b.py": 5.0, "s.py": 9.0, "e.py": 0.1})  # type: ignore[arg-type]
    # a file no run has timed counts as longest
    assert [it.nodeid for it in items] == ["e.py::t", "new.py::t", "b.py::t", "b.py::u", "a.py::t", "s.py::t"]


def test_this_checkouts_seconds_win_over_the_committed_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    table = tmp_path / "file_seconds.json"
    table.write_text(json.dumps({"a.py": 1.0, "b.py": 2.0}))
    monkeypatch.setattr(parallel, "SECONDS_TABLE", table)
    assert parallel.known_seconds({"b.py": 7.0, "c.py": 3.0}) == {"a.py": 1.0, "b.py": 7.0, "c.py": 3.0}
    assert parallel.known_seconds({}) == {"a.py": 1.0, "b.py": 2.0}  # a fresh clone: no cache


def test_the_committed_table_names_test_files_that_exist_and_most_of_them() -> None:
    """A fresh clone orders its files by the table: one that names files long gone, or too few
    of today's, orders by little (``make test-times`` refreshes it)."""
    table = json.loads(parallel.SECONDS_TABLE.read_text())
    assert table and all((ROOT / f).is_file() and f.startswith("tests/") for f in table), \
        [f for f in table if not (ROOT / f).is_file()]
    assert all(isinstance(s, int | float) and s >= 0 for s in table.values())
    files = {str(p.relative_to(ROOT)) for d in ("unit", "integration") for p in (ROOT / "tests" / d).glob("test_*.py")}
    assert len(files & set(table)) >= 0.8 * len(files), sorted(files - set(table))


def test_make_test_times_writes_the_cache_as_the_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / ".pytest_cache"
    (cache / "v" / "pegaflow").mkdir(parents=True)
    (cache / "v" / parallel.FILE_SECONDS).write_text(json.dumps(
        {"tests/unit/test_parallel_order.py": 0.5, "tests/gone.py": 3.0, "tests/conftest.py": 1.0}))
    table = tmp_path / "tests" / "file_seconds.json"
    table.parent.mkdir()
    table.write_text(json.dumps({"tests/e2e/test_e.py": 80.0, "tests/conftest.py": 9.0}))
    monkeypatch.setattr(parallel, "SECONDS_TABLE", table)
    for f in ("tests/unit/test_parallel_order.py", "tests/conftest.py", "tests/e2e/test_e.py"):
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).touch()
    assert parallel.write_table(cache) == 3  # the file that is gone is dropped
    # the cache's seconds win; a file it did not time (a make test-fast run has no e2e) keeps its own
    assert json.loads(table.read_text()) == {"tests/conftest.py": 1.0, "tests/e2e/test_e.py": 80.0,
                                             "tests/unit/test_parallel_order.py": 0.5}
    assert list(json.loads(table.read_text())) == sorted(json.loads(table.read_text()))


def test_the_vllm_files_exist_and_each_side_leaves_out_the_other() -> None:
    assert parallel.VLLM_FILES and all((ROOT / f).is_file() for f in parallel.VLLM_FILES)
    listed, other = ROOT / sorted(parallel.VLLM_FILES)[0], ROOT / "tests/unit/test_parallel_order.py"
    helper = ROOT / "tests/unit/connector_fakes.py"  # not a test file: never left out
    for path, skip, only in ((listed, True, False), (other, False, True), (helper, False, False)):
        assert parallel.vllm_ignored(path, ROOT, "skip") is skip
        assert parallel.vllm_ignored(path, ROOT, "only") is only
        assert parallel.vllm_ignored(path, ROOT, "all") is False


def test_a_session_that_collected_nothing_fails_the_run_only_when_both_did() -> None:
    from tests.fast import status

    assert status(0, 0) == 0
    assert status(0, 5) == 0 and status(5, 0) == 0  # a -k that selects one side's tests only
    assert status(5, 5) == 5
    assert status(1, 0) == 1 and status(0, 2) == 2 and status(5, 1) == 1


@pytest.mark.parametrize(("path", "fails"), [("tests/unit/test_new_engine_fake.py", True),
                                             ("tests/unit/test_metrics_docs.py", False)])  # listed: named as an argument
def test_a_test_that_imports_vllm_as_it_runs_fails_on_the_workers_side_unless_listed(
        path: str, fails: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """make test-fast's xdist side (``--vllm-files=skip``): collection catches a module that
    imports vLLM; this catches a test that imports it as it runs (tests/conftest.py)."""
    from tests import conftest

    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    config = SimpleNamespace(getoption=lambda name: "skip", rootpath=ROOT)
    hook = conftest.pytest_runtest_call(SimpleNamespace(config=config, path=ROOT / path))  # type: ignore[arg-type]
    next(hook)
    sys.modules["vllm"] = SimpleNamespace()  # type: ignore[assignment]  # the test imported it
    try:
        if fails:
            with pytest.raises(AssertionError, match="test_new_engine_fake.py imports vLLM as its tests run: list it"):
                hook.send(None)
        else:
            with pytest.raises(StopIteration):
                hook.send(None)
    finally:
        del sys.modules["vllm"]  # before this test's own check (monkeypatch puts a real one back after it)

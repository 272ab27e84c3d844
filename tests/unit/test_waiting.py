"""tests/waiting.py: a wait returns the condition's value, fails fast on a real error, and
names what it waited for when time runs out."""

from __future__ import annotations

import asyncio
import itertools
import subprocess
import sys
import time

import pytest

from tests.waiting import next_line, wait_until, wait_until_async


def test_returns_the_first_truthy_value() -> None:
    calls = itertools.count()
    assert wait_until(lambda: next(calls) >= 3 and "done", 5, "the fourth check", every=0) == "done"


def test_times_out_naming_what_it_awaited_and_the_last_check() -> None:
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match=r"after 0.2s waiting for the moon \(the last check returned 0\)"):
        wait_until(lambda: 0, 0.2, "the moon", every=0.01)
    assert time.monotonic() - t0 >= 0.2


def test_ignored_exceptions_mean_not_yet_others_propagate_at_once() -> None:
    calls = itertools.count()

    def flaky() -> bool:
        if next(calls) < 2:
            raise ConnectionError("not up")
        return True

    assert wait_until(flaky, 5, "up", every=0, ignore=ConnectionError)
    with pytest.raises(AssertionError, match="raised ConnectionError"):
        wait_until(lambda: (_ for _ in ()).throw(ConnectionError("down")), 0.1, "up", every=0.01,
                   ignore=ConnectionError)
    t0 = time.monotonic()
    with pytest.raises(KeyError):
        wait_until(lambda: {}["x"], 30, "never")
    assert time.monotonic() - t0 < 5


def test_a_callable_what_is_asked_only_on_failure() -> None:
    asked: list[int] = []
    wait_until(lambda: True, 1, lambda: str(asked.append(1)))
    assert asked == []
    with pytest.raises(AssertionError, match="details"):
        wait_until(lambda: False, 0.05, lambda: "details", every=0.01)


def test_the_async_wait_lets_the_loop_run() -> None:
    async def run() -> int:
        box: list[int] = []
        asyncio.get_running_loop().call_later(0.05, box.append, 7)
        return await wait_until_async(lambda: box and box[0], 5, "the callback")

    assert asyncio.run(run()) == 7
    with pytest.raises(AssertionError, match="nothing"):
        asyncio.run(wait_until_async(lambda: None, 0.05, "nothing"))


def test_next_line_reads_a_line_and_fails_when_the_process_ends_without_one() -> None:
    p = subprocess.Popen([sys.executable, "-c", "print('hi', flush=True)"], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    assert next_line(p.stdout, p, 30, "a greeting") == "hi\n"
    with pytest.raises(AssertionError, match="a second greeting: the process closed its output"):
        next_line(p.stdout, p, 30, "a second greeting")
    p.wait()

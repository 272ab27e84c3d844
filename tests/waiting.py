"""The one way tests wait: poll a condition, bounded, and say what was awaited when it never came.

Built on tenacity (already a dependency of PegaFlow): :func:`wait_until` for threads and
processes, :func:`wait_until_async` on a running event loop (a blocking sleep there would
stall the very loop that makes the condition true), :func:`next_line` for a line a
subprocess writes to a pipe. All three give up with ``AssertionError``, so a wait that times
out fails the test that waited.
"""

from __future__ import annotations

import select
import subprocess
from collections.abc import Awaitable, Callable
from typing import IO, Any, TypeVar

from tenacity import (
    AsyncRetrying,
    RetryError,
    Retrying,
    retry_if_exception_type,
    retry_if_result,
    stop_after_delay,
    wait_fixed,
)

T = TypeVar("T")
Excuses = type[BaseException] | tuple[type[BaseException], ...]


def _policy(timeout: float, every: float, ignore: Excuses) -> dict[str, Any]:
    """Retry while the condition is falsy (or raised one of ``ignore``), every ``every`` s, for ``timeout`` s."""
    return {"stop": stop_after_delay(timeout), "wait": wait_fixed(every),
            "retry": retry_if_result(lambda got: not got) | retry_if_exception_type(ignore)}


def _timed_out(err: RetryError, timeout: float, what: str | Callable[[], str]) -> AssertionError:
    last = err.last_attempt
    got = f"raised {last.exception()!r}" if last.failed else f"returned {last.result()!r}"
    said = what() if callable(what) else what
    return AssertionError(f"timed out after {timeout}s waiting for {said} (the last check {got})"[:4000])


def wait_until(condition: Callable[[], T], timeout: float, what: str | Callable[[], str], every: float = 0.1,
               ignore: Excuses = ()) -> T:
    """Call ``condition`` every ``every`` seconds until it returns a truthy value, and return that value.

    ``timeout`` bounds the wait (checks continue until it has passed, so a slow condition
    may overrun it by one call). An exception of a type in ``ignore`` counts as "not yet";
    any other propagates at once, so a condition can fail fast (a process that died).
    On timeout: ``AssertionError`` naming ``what`` (a callable is called then, for details
    that only matter on failure) and the last check's result.
    """
    try:
        return Retrying(**_policy(timeout, every, ignore))(condition)
    except RetryError as err:
        raise _timed_out(err, timeout, what) from None


async def wait_until_async(condition: Callable[[], T], timeout: float, what: str | Callable[[], str],
                           every: float = 0.005, ignore: Excuses = ()) -> T:
    """:func:`wait_until` on a running event loop: the loop runs between checks."""
    try:
        return await AsyncRetrying(**_policy(timeout, every, ignore))(_awaitable(condition))
    except RetryError as err:
        raise _timed_out(err, timeout, what) from None


def _awaitable(condition: Callable[[], T]) -> Callable[[], Awaitable[T]]:
    async def check() -> T:
        return condition()

    return check


def next_line(stream: IO[str], proc: subprocess.Popen, timeout: float, what: str,  # type: ignore[type-arg]
              tail: Callable[[], str] | None = None) -> str:
    """The next line ``proc`` writes to ``stream`` (one of its pipes), within ``timeout`` seconds.

    ``AssertionError`` naming ``what`` if ``proc`` closes the pipe or exits first (with its
    exit status), or if the time runs out; ``tail`` (say, the end of its log) is appended then.
    """

    def line() -> str | None:
        if select.select([stream], [], [], 0.2)[0]:
            got = stream.readline()
            if not got:
                raise AssertionError(f"{what}: the process closed its output (exit status {proc.poll()})")
            return got
        if proc.poll() is not None:
            raise AssertionError(f"{what}: the process exited with status {proc.returncode} and wrote no line")
        return None

    try:
        return wait_until(line, timeout, what, every=0)
    except AssertionError as exc:
        if tail is None:
            raise
        raise AssertionError(f"{exc}\n{tail()}") from None

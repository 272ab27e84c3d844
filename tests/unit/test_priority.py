"""Background threads run below the thread that started them (pegaflow/common/priority.py)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pegaflow.common.priority import BACKGROUND_NICE, background_thread, name_thread


def _nice(tid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid)


def _comm(tid: int) -> str:
    return Path(f"/proc/self/task/{tid}/comm").read_text().strip()


def _seen_in_thread(first: Callable[[], None], name: str) -> dict[str, object]:
    """The nice value and OS name of a thread called ``name`` once it ran ``first``."""
    seen: dict[str, object] = {}

    def work() -> None:
        first()
        tid = threading.get_native_id()
        seen.update(nice=_nice(tid), comm=_comm(tid))

    t = threading.Thread(target=work, name=name)
    t.start()
    t.join()
    return seen


def test_a_background_thread_is_niced_and_named_and_its_creator_is_not():
    me = threading.get_native_id()
    base = _nice(me)
    seen = _seen_in_thread(background_thread, "pf-test-background-thread")
    assert seen == {"nice": min(19, base + BACKGROUND_NICE), "comm": "pf-test-backgro"}
    assert _nice(me) == base


def test_a_named_thread_keeps_its_creators_priority():
    base = _nice(threading.get_native_id())
    assert _seen_in_thread(name_thread, "pf-test-named-thread") == {"nice": base, "comm": "pf-test-named-t"}


def test_an_executor_initializer_nices_every_worker():
    base = _nice(threading.get_native_id())
    with ThreadPoolExecutor(2, thread_name_prefix="pf-test-pool", initializer=background_thread) as ex:
        got = set(ex.map(lambda _: (_nice(threading.get_native_id()), _comm(threading.get_native_id())[:12]),
                         range(8)))
    assert got and {n for n, _ in got} == {min(19, base + BACKGROUND_NICE)}
    assert {c for _, c in got} == {"pf-test-pool"}


def test_threads_a_background_thread_starts_inherit_its_priority():
    """What io_uring's kernel workers rely on: a thread starts with its creator's nice value."""
    base = _nice(threading.get_native_id())
    out: list[int] = []

    def child() -> None:
        out.append(_nice(threading.get_native_id()))

    def parent() -> None:
        background_thread()
        c = threading.Thread(target=child)
        c.start()
        c.join()

    t = threading.Thread(target=parent)
    t.start()
    t.join()
    assert out == [min(19, base + BACKGROUND_NICE)]

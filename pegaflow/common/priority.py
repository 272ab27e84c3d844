"""The CPU priority of a daemon's background threads: below the event loop that serves engines.

A node's event loop answers engines; its background threads (the SSD tier's I/O thread,
the event publisher, the ``/metrics`` server, the peer checksum hasher, the pool's
pre-fault, the loop's default executor) share the host's cores with it and with the
engines. When every core is busy, the kernel's scheduler decides who runs next by weight,
and a thread woken by an engine's call (the loop, or the engine's own client) waits
behind whatever runs. :func:`background_thread` makes the thread that calls it nice +10
relative to the thread that started it (a tenth of the weight), so on busy cores the
data path's threads are picked first and the background takes what is left.

Measured with ``bench/dataplane.py --rounds 3 --seconds 15`` (all background on vs all
off, the foreground the same) on one 2-core host, six runs with every thread of the node
but the loop's at +10 alternated with six without: Query p99 on/off 1.12x-1.34x (median
1.25x) against 1.04x-1.64x (1.31x); p999 1.44x-2.02x (median 1.65x) against 1.70x-3.61x
(2.00x); the "on" p999 1.23-1.79 ms against 1.42-2.78 ms. (An A/A run of the same bench,
``--parts none``, gives 0.87x-0.88x at p999: the gap is the background's.) What it cannot
remove: a background thread preempted while it holds the GIL still keeps the loop waiting
(the switch interval asks it to let go, but it has to run to do so); the figures above
include that. The other way round, raising the loop above the engines, did not help either:
with the loop's thread at nice -5 (root only), ``bench/saturation.py --pages 256`` at 50% of
saturation gave Query p99 1093-1538 us against 865-1121 at nice 0 (three runs each,
alternated), and with the page copies skipped Commit's p99 rose from 72-81 to 159-171 us: a
loop that preempts the engine as soon as a frame lands delays that engine's own next call.
A short scheduler slice for the loop (``sched_setattr``, 100 us) did not move the tail either
(718-1514 against 744-1045 us), nor did the loop's thread at real-time priority (``chrt -f
1``; no engine thread can delay it then): 2308-2755 against 2801-2875 us, three runs each,
alternated, later on the same host when it ran slower. What is left of that tail waits in the
engines' own processes: a client woken by its answer waits for a CPU behind the other
clients' page copies (``bench/saturation.py``'s docstring).

Linux keeps a nice value per thread (``setpriority(PRIO_PROCESS, tid)``), and a thread
starts with its creator's: io_uring's kernel workers started by the SSD I/O thread get its
value too. Raising nice needs no privilege; lowering it again does, so only threads that
do background work for their whole life call this (a thread's first line, an executor's
``initializer``). It also names the OS thread (``top -H``, ``ps -L`` show which part burns
CPU); :func:`name_thread` only names it, for threads that keep their creator's priority (the
metaserver's). Elsewhere than Linux both do nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import threading

BACKGROUND_NICE = 10  # added to the starting thread's nice value (capped at 19)
_PR_SET_NAME = 15  # <linux/prctl.h>

_libc: ctypes.CDLL | None = None


def _set_os_name(name: str) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    _libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)


def background_thread() -> None:
    """Lower the calling thread's CPU priority by ``BACKGROUND_NICE`` and give the OS thread
    the Python thread's name (15 bytes). Call it first thing in a background thread."""
    if not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + BACKGROUND_NICE))
    except OSError:  # a sandbox that forbids it: the thread runs at its creator's priority
        pass
    name_thread()


def name_thread() -> None:
    """Give the calling OS thread the Python thread's name (15 bytes), its priority unchanged:
    for the threads that serve or keep what serving reads current (``top -H``, ``ps -L``)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        _set_os_name(threading.current_thread().name)
    except (OSError, AttributeError):
        pass

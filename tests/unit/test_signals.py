"""A daemon's stop on SIGTERM/SIGINT (pegaflow/common/startup.set_on_signals): a second signal
that lands while the first one's handler is inside ``Event.set`` must not deadlock."""

from __future__ import annotations

import signal
import threading

from pegaflow.common.startup import set_on_signals


def test_a_signal_arriving_inside_the_events_set_does_not_deadlock_the_main_thread() -> None:
    stop = threading.Event()
    before = signal.getsignal(signal.SIGUSR1)
    set_on_signals(stop, signal.SIGUSR1)
    try:
        handler = signal.getsignal(signal.SIGUSR1)
        assert callable(handler)
        returned = threading.Event()

        def second_signal_inside_set() -> None:
            with stop._cond:  # type: ignore[attr-defined]  # the first signal's set() holds its lock
                handler(signal.SIGUSR1, None)  # the second one's handler runs in the same thread
                returned.set()

        t = threading.Thread(target=second_signal_inside_set, daemon=True)
        t.start()
        assert returned.wait(5), "the handler deadlocked on the event's lock"
        assert stop.wait(5)
        real = threading.Event()  # and a real signal, through the interpreter, sets its event
        set_on_signals(real, signal.SIGUSR1)
        signal.raise_signal(signal.SIGUSR1)
        assert real.wait(5)
    finally:
        signal.signal(signal.SIGUSR1, before)

"""What a daemon's entry point sets for its own process before the daemon's imports."""

from __future__ import annotations

import signal
import sys
import threading


def structlog_without_rich() -> None:
    """Hide ``rich`` from structlog in this process, unless something loaded structlog already.

    structlog imports rich when it is installed (our locks have it: transformers -> typer ->
    rich), only to pretty-print exceptions in its console renderer. A daemon renders JSON or
    plain lines, and the import cost each start ~0.1 s of CPU here (``import structlog``:
    0.23 s of CPU with rich, 0.13 s without; a 2-core VM, 20 runs each). With ``rich`` hidden,
    ``import rich`` fails in this process and structlog takes its plain-traceback path. Only
    for processes that need no rich: ``pegaflow-node``, ``pegaflow-meta`` and the ``pegaflow``
    subcommands (``pegaflow/cli.py``), not a vLLM engine; a process that already runs
    structlog (a test calling ``main``, a tool) is left as it is.
    """
    if "structlog" not in sys.modules:
        # None in sys.modules makes an import raise ModuleNotFoundError (the import system's
        # documented marker); typeshed types the values as modules only.
        sys.modules.setdefault("rich", None)  # type: ignore[arg-type]


def set_on_signals(event: threading.Event, *signals: signal.Signals) -> None:
    """Set ``event`` when one of ``signals`` arrives (install from the main thread).

    Not from the handler itself: a handler runs in the main thread between two bytecodes,
    possibly inside ``event.set`` for the signal before (a second SIGTERM 1 ms after the
    first: ``timeout``, a process group's), whose lock is not reentrant: that deadlocked the
    process for good. A thread of its own takes the lock the usual way.
    """

    def handler(signum: int, frame: object) -> None:
        threading.Thread(target=event.set, name="pf-signal", daemon=True).start()

    for sig in signals:
        signal.signal(sig, handler)

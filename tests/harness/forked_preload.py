"""What the tests' fork server (tests/harness/forked.py) imports before it forks a daemon:
the modules ``pegaflow-node``, ``pegaflow-meta``, ``pegaflow cache`` and ``status`` and the
tests' publisher processes (tests/integration/meta_nodeproc.py) import at start, with ``rich`` hidden
first as their entry points hide it; not the entry modules themselves, which the child runs
as ``__main__`` (runpy warns when one was imported already). Nothing here starts a thread or
opens a socket: a fork copies only the thread that forks."""

from pegaflow.common.startup import structlog_without_rich

structlog_without_rich()

import pegaflow.common.http  # noqa: E402,F401
import pegaflow.config.commands  # noqa: E402,F401
import pegaflow.meta.daemon  # noqa: E402,F401
import pegaflow.node.daemon  # noqa: E402,F401
import pegaflow.ops.cache  # noqa: E402,F401
import pegaflow.ops.status  # noqa: E402,F401

"""The node's query trace: one JSON line per answered request, for ``pegaflow replay``.

Written when ``--query-trace FILE`` is given. The format is defined in docs/replay.md and
written by :func:`pegaflow.replay.trace.encode_query` (one definition of the format).
A request is recorded once, when the node answers it READY (LOADING answers are retries
of the same request). Lines are buffered and flushed by the node's housekeeping task, so
recording costs the Query path one ``json.dumps`` and no system call.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import IO

from pegaflow.replay.trace import encode_query


class QueryTraceError(Exception):
    """The trace file cannot be opened (one line for the operator)."""


class QueryTrace:
    def __init__(self, path: str) -> None:
        try:
            self._f: IO[str] = open(path, "a", buffering=1 << 20)  # noqa: SIM115 - lives as long as the node
        except OSError as exc:
            raise QueryTraceError(f"cannot open --query-trace {path}: {exc.strerror}") from None
        self.path = path
        self.lines = 0

    def record(self, namespace: str, hashes: Sequence[bytes], page_bytes: int, instance: str) -> None:
        self._f.write(encode_query(time.time(), namespace, hashes, page_bytes=page_bytes, instance=instance))
        self._f.write("\n")
        self.lines += 1

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        self._f.close()

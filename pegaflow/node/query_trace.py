"""The node's query trace: one JSON line per answered request, for ``pegaflow replay``.

Written when ``--query-trace FILE`` is given. The format is defined in docs/replay.md and
written by :func:`pegaflow.core.trace.encode_query` (one definition of the format).
A request is recorded once, when the node answers it READY (LOADING answers are retries
of the same request). Lines are buffered and flushed by the node's housekeeping task, so
recording costs the Query path one ``json.dumps`` and no system call. ``--trace-sample-rate``
records that fraction of the requests (each request independently).
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Sequence
from typing import IO

from pegaflow.core.trace import encode_query


class QueryTraceError(Exception):
    """The trace file cannot be opened (one line for the operator)."""


class QueryTrace:
    def __init__(self, path: str, sample_rate: float = 1.0) -> None:
        try:  # 0600 like the pool and the SSD files: it names every request's blocks
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            os.fchmod(fd, 0o600)  # an existing file too
            self._f: IO[str] = os.fdopen(fd, "a", buffering=1 << 20)  # lives as long as the node
        except OSError as exc:
            raise QueryTraceError(f"cannot open --query-trace {path}: {exc.strerror}") from None
        self.path = path
        self.sample_rate = sample_rate  # --trace-sample-rate: the fraction of requests recorded
        self.lines = 0

    def record(self, namespace: str, hashes: Sequence[bytes], page_bytes: int, instance: str) -> None:
        if self.sample_rate < 1.0 and random.random() >= self.sample_rate:
            return
        self._f.write(encode_query(time.time(), namespace, hashes, page_bytes=page_bytes, instance=instance))
        self._f.write("\n")
        self.lines += 1

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        self._f.close()

"""Checks of request fields shared by every service that takes block hashes (and the limit
of an engine's copy report, which its sender and the node share).

The node (``Query``/``Reserve`` and the local socket), the metaserver (``QueryPrefix``) and
a node's peer endpoint (``PinForTransfer``) all take a batch of block hashes; this is the
one rule they apply to it. A bad batch is an :class:`~pegaflow.common.errors.InvalidArgument`
(``INVALID_ARGUMENT``) with a message naming the limit's flag or the bad hash.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pegaflow.common.errors import InvalidArgument
from pegaflow.core.identity import HASH_BYTES


def check_hashes(hashes: Sequence[bytes], limit: int, limit_flag: str) -> None:
    """At most ``limit`` hashes (``limit_flag`` names the option that sets it), each
    ``HASH_BYTES`` long."""
    if len(hashes) > limit:
        raise InvalidArgument(f"batch of {len(hashes)} hashes exceeds {limit_flag} {limit}")
    # set(map(len)) runs in C: a Python loop was ~15 us of a 128-block query. The culprit is
    # looked for only when something is wrong.
    lengths = set(map(len, hashes))
    if lengths and lengths != {HASH_BYTES}:
        i, h = next((i, h) for i, h in enumerate(hashes) if len(h) != HASH_BYTES)
        raise InvalidArgument(f"hash {i} has {len(h)} bytes, expected {HASH_BYTES}")


# Copy durations of each kind one Commit or Release may carry (node.proto, CopyTimes): an
# engine sends what its ranks reported since its last call, one per rank and step; its
# scheduler side keeps the newest this many when more piled up (the node was unreachable).
MAX_COPY_TIMES = 4096


def check_copy_times(name: str, seconds: Sequence[float]) -> None:
    """At most ``MAX_COPY_TIMES`` durations, each a finite, non-negative number of seconds."""
    if len(seconds) > MAX_COPY_TIMES:
        raise InvalidArgument(f"copies.{name}: {len(seconds)} durations, at most {MAX_COPY_TIMES}")
    if not all(0.0 <= v < math.inf for v in seconds):  # NaN fails too
        raise InvalidArgument(f"copies.{name}: every duration must be a finite, non-negative number of seconds")

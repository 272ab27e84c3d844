"""Free loopback ports for the processes the harness starts.

A port found free here is bound by the process started next, not held in between: another
process may take it first. Starters that can lose that race retry (``redis.start_server``);
the others fail with the daemon's "address in use" in their log.
"""

from __future__ import annotations

import random
import socket

PORT_TRIES = 200  # random bases tried before free_port_range gives up


def free_port() -> int:
    """A port the kernel calls free on 127.0.0.1 now (from its ephemeral range)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_range(n: int, bus_offset: int = 0, lo: int = 20000, hi: int = 30000) -> int:
    """A base port such that base..base+n-1 (and, with ``bus_offset``, each of them plus
    ``bus_offset``: a Redis Cluster's bus ports) are free. Drawn from [lo, hi), below the
    kernel's ephemeral range, so a client's source port does not take one meanwhile."""
    for _ in range(PORT_TRIES):
        base = random.randrange(lo, hi - n)
        ports = list(range(base, base + n))
        if bus_offset:
            ports += [p + bus_offset for p in ports]
        if all(port_is_free(p) for p in ports):
            return base
    raise RuntimeError("no free port range")

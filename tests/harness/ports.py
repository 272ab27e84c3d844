"""Free loopback ports for the processes the harness starts.

A port found free here is bound by the process started next, not held in between: another
process may take it first. Starters that can lose that race retry (``redis.start_server``);
the others fail with the daemon's "address in use" in their log. To make that race rare:

- ports come from below the kernel's ephemeral range (``ip_local_port_range``, 32768 up
  here), which it hands out as the source ports of outgoing connections: a port taken from
  there was, in a parallel run, soon some client's source port (a node then failed to bind);
- each pytest-xdist worker draws from its own share of that range, so two workers never
  hand out the same port;
- within a process, ports are handed out in turn from a random start, each checked free.
"""

from __future__ import annotations

import os
import random
import socket

PORT_TRIES = 200  # random bases tried before free_port_range gives up
# free_port's range, below free_port_range's (20000-30000, bus ports 30000-40000), split into
# WORKER_SHARES equal shares, one per pytest-xdist worker (gw0, gw1, ...; a plain run is gw0).
SINGLE_LO, SINGLE_HI = 10000, 20000
WORKER_SHARES = 8


def _share() -> range:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    size = (SINGLE_HI - SINGLE_LO) // WORKER_SHARES
    lo = SINGLE_LO + (index % WORKER_SHARES) * size
    return range(lo, lo + size)


_cursor: list[int] = []  # the next port this process tries (random start: see the module doc)


def free_port() -> int:
    """A port free on 127.0.0.1 now, from this worker's share (the module's doc)."""
    share = _share()
    if not _cursor:
        _cursor.append(random.randrange(len(share)))
    for _ in range(len(share)):
        port = share[_cursor[0] % len(share)]
        _cursor[0] += 1
        if port_is_free(port):
            return port
    raise RuntimeError(f"no free port in {share.start}-{share.stop - 1}")


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

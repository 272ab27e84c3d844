"""Addresses as the node and metaserver use them: ``HOST:PORT`` splitting and the one rule for
the address a node advertises to its peers (what the index publishes and pulls dial).

Hosts are compared without IPv6 brackets: ``[::]:50055`` has host ``::``.
"""

from __future__ import annotations

import socket

WILDCARD = frozenset({"0.0.0.0", "::", ""})  # bind to every interface: no host to dial
LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})


def split_host_port(addr: str) -> tuple[str, int]:
    """``("10.0.0.1", 50055)`` of ``10.0.0.1:50055``; IPv6 brackets are dropped."""
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


def host_of(addr: str) -> str:
    return addr.rpartition(":")[0].strip("[]")


def advertised(addr: str, advertise_addr: str = "") -> str:
    """The gRPC address peers reach this node at: ``--advertise-addr``, else ``--addr``; a
    wildcard host (``0.0.0.0``, ``[::]``) becomes this host's name."""
    chosen = advertise_addr or addr
    host, _, port = chosen.rpartition(":")
    if host.strip("[]") in WILDCARD:
        return f"{socket.gethostname()}:{port}"
    return chosen


def routability_warning(addr: str) -> str:
    """A warning for a configured address other hosts may not reach ('' if it looks routable):
    loopback, or a wildcard (peers then get the hostname, which must resolve on every host)."""
    host = host_of(addr)
    if host in WILDCARD or host in LOOPBACK:
        return (f"P2P is on but this node's address is {addr!r}, which other hosts cannot dial as it is; "
                "set --addr or --advertise-addr to this host's cluster IP")
    return ""

"""Addresses as every PegaFlow process writes them: the one ``HOST:PORT`` rule, and the
address a node advertises to its peers (what the index publishes and pulls dial).

Hosts are compared without IPv6 brackets: ``[::]:50055`` has host ``::``; an IPv6 host is
bracketed again whenever an address is built (:func:`join_host_port`).
"""

from __future__ import annotations

import socket

WILDCARD = frozenset({"0.0.0.0", "::", ""})  # bind to every interface: no host to dial
LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})

# Where a node serves its engines, and the metaserver its lookups, unless told otherwise
# (the original's defaults): every default of every command, connector and client is these.
NODE_HOST = "127.0.0.1"
NODE_PORT = 50055
NODE_ADDR = f"{NODE_HOST}:{NODE_PORT}"
META_ADDR = "127.0.0.1:50056"


def split_host_port(addr: str) -> tuple[str, int]:
    """``("10.0.0.1", 50055)`` of ``10.0.0.1:50055``, ``("::1", 50055)`` of ``[::1]:50055``.

    ValueError unless ``addr`` ends in ``:PORT`` with PORT in 0..65535 (an empty host is
    the wildcard)."""
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"invalid address {addr!r} (expected HOST:PORT)")
    if host.startswith("[") != host.endswith("]"):
        raise ValueError(f"invalid address {addr!r} (unbalanced brackets)")
    return host.strip("[]"), int(port)


def bracketed(host: str) -> str:
    """``host`` as it is written in an address or URL: an IPv6 host in brackets."""
    return f"[{host}]" if ":" in host else host


def join_host_port(host: str, port: int) -> str:
    """``HOST:PORT``, with an IPv6 host in brackets."""
    return f"{bracketed(host)}:{port}"


def host_of(addr: str) -> str:
    return split_host_port(addr)[0]


def advertised(addr: str, advertise_addr: str = "") -> str:
    """The gRPC address peers reach this node at: ``--advertise-addr``, else ``--addr``; a
    wildcard host (``0.0.0.0``, ``[::]``) becomes this host's name (``socket.gethostname``)."""
    chosen = advertise_addr or addr
    host, port = split_host_port(chosen)
    if host in WILDCARD:
        return join_host_port(socket.gethostname(), port)
    return chosen


def routability_warning(addr: str) -> str:
    """A warning for a configured address other hosts may not reach ('' if it looks routable):
    loopback, or a wildcard (peers then get the hostname, which must resolve on every host)."""
    host = host_of(addr)
    if host in WILDCARD or host in LOOPBACK:
        return (f"P2P is on but this node's address is {addr!r}, which other hosts cannot dial as it is; "
                "set --addr or --advertise-addr to this host's cluster IP")
    return ""

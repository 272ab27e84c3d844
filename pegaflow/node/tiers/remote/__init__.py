"""Remote reads (docs/architecture.md "Peer pull", docs/p2p.md): a block's path from a peer's pool into ours.

    Query miss after L1 and SSD -> :mod:`puller` asks the metaserver who holds the prefix
    -> ``PinForTransfer`` on that peer (:mod:`pins`) -> a :class:`Transport` copies the
    pinned pages straight into PENDING pages of our pool (:mod:`tcp` or :mod:`rdma`)
    -> checksums verified -> commit (visible, published as inserts) -> ``Unpin``.

This module holds what both sides and every transport share: the description of a pin
(:class:`RemotePages`), the transport interface and its error, and the page checksum.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from pegaflow.node.pool import page_checksum as page_checksum  # re-exported for the transports

TCP = "tcp"
RDMA = "rdma"




class TransferError(Exception):
    """A pull's data plane failed (peer gone, connection reset, timeout, short read).

    Raised by :meth:`Transport.read`; the puller then discards every page of the pull.
    """


@dataclass(frozen=True, slots=True)
class RemotePages:
    """Pages a peer pinned for us: ``count`` pages of ``page_bytes`` at ``offsets`` of its pool.

    Valid until the pin expires (``PinResponse.expires_in``) or is unpinned; a read after
    that may see other bytes, which the checksums then reject.
    """

    peer: str  # the peer's gRPC address (PegaPeer service)
    pin_id: int
    page_bytes: int
    offsets: tuple[int, ...]
    checksums: tuple[int, ...]  # xxh3_64 per page from the pin; empty for TCP (sent in-band)
    data_addr: str = ""  # TCP data plane HOST:PORT
    rdma_base: int = 0  # RDMA: virtual address of the peer's pool offset 0
    rkeys: tuple[int, ...] = ()  # RDMA: the pool MR's remote key on each of the peer's NICs

    @property
    def count(self) -> int:
        return len(self.offsets)


class Transport(Protocol):
    """Moves pinned remote pages into local pool pages and verifies them.

    ``read`` blocks (the puller calls it from a worker thread) and either fills every
    destination page, ``dests[i]`` receiving remote page ``i``, and returns per page its
    xxh3_64 if that matches the source's, else None; or raises :class:`TransferError`.
    On error or mismatch some destination bytes may have been written, so the caller
    must discard those pages (they are PENDING: no reader sees them); a matching value is
    the page's checksum from then on (the puller keeps it, so it can serve the page
    without hashing it). Where the source checksum comes from is the transport's choice:
    RDMA READ has only the pin's (the peer's CPU is not involved); TCP has the sender
    stream the checksums after the pages, so the pin is answered at once. Either way the
    serving node usually knows them already (``checksums.PageChecksums``).
    """

    name: str

    def read(self, remote: RemotePages, dests: Sequence[int]) -> list[int | None]: ...

    def close(self) -> None: ...

"""TCP data plane: a data port per node; pages move pool -> socket -> pool with no staging copy.

Wire format (little endian), one request at a time per connection, connections reused:

    puller -> peer   REQ  = magic "PFQ1", pin_id u64, start u32, count u32
    peer   -> puller RESP = magic "PFR1", status u32 (0 ok, 1 unknown/expired pin,
                            2 range outside the pin), total u64; then ``total`` bytes:
                            pages start .. start+count-1 of the pin, in order; then
                            ``count`` u64: the xxh3_64 of each page as it was sent.

Sender (:class:`TcpDataServer`): one thread per connection; each page goes from the
pool's memfd to the socket with ``os.sendfile``, so the bytes never enter Python and are
not copied (a huge-page pool, ``--use-hugepages``, cannot be spliced: there each page is
sent from the pool mapping with one kernel copy, GIL released). Its
checksum is usually known already (``PageChecksums``: hashed once when the block was
committed, or verified when it was pulled); a page whose checksum is not known yet is
hashed right before it is sent. While it sends, the pin is held busy and cannot expire
(``PinTable``).

Receiver (:class:`TcpTransport`): ``recv_into`` with ``MSG_WAITALL`` straight into each
destination page (a memoryview slice of the pool mmap): one syscall per page, GIL
released; each page is hashed as soon as it landed, while the next one arrives. A pull
is split into up to ``STREAMS`` connections read in parallel.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, Protocol, TypeVar

import structlog

from pegaflow.common.backoff import Backoff
from pegaflow.core.hosts import split_host_port
from pegaflow.node.tiers.remote import TCP, RemotePages, TransferError, page_checksum

log = structlog.get_logger("pegaflow.p2p")

REQ = struct.Struct("<4sQII")
RESP = struct.Struct("<4sIQ")
REQ_MAGIC = b"PFQ1"
RESP_MAGIC = b"PFR1"
OK, UNKNOWN_PIN, BAD_RANGE = 0, 1, 2
IO_TIMEOUT = 10.0  # seconds a send or receive may stall before the pull is failed (peer frozen)
STREAMS = 4  # parallel connections per pull: on 2 cores they hide each other's per-page hash and syscall gaps (0.87x iperf3 vs 0.49x with 2)
MIN_STREAM_BYTES = 4 << 20  # do not split pulls smaller than this per stream (setup cost)
SOCK_BUF = 4 << 20  # socket buffers large enough to keep a 10-25 Gbit/s link busy
IDLE_PER_PEER = 16  # idle connections kept per peer: STREAMS x the puller's SSD_CHUNKS_IN_FLIGHT, so chunked pulls reuse them
KEEPALIVE_IDLE = 30  # seconds: probes find pullers that vanished from an idle connection
IDLE_TIMEOUT = 120.0  # seconds a connection may wait for its next request before the holder closes it
# A transfer's whole deadline: IO_TIMEOUT plus its bytes at this rate. IO_TIMEOUT alone bounds
# only a call that makes no progress: a peer that reads (or sends) a little every few seconds
# kept a pin past its TTL on the holder, or a puller's worker thread, for as long as it liked.
MIN_RATE = 8 << 20  # bytes/s per connection: far below any data-center link
ACCEPT_RETRY_S = 0.01  # after a failed accept (EMFILE...): the wait, doubling (common.backoff) up to ACCEPT_RETRY_MAX_S
ACCEPT_RETRY_MAX_S = 1.0



class Page(Protocol):
    """What the data port needs of a pinned block (``Block``)."""

    @property
    def offset(self) -> int: ...
    @property
    def size(self) -> int: ...


P = TypeVar("P", bound=Page)  # the pin table's page (a Block), handed back to checksum_of
# (pin_id, start, count) -> the pin's pages with the pin marked busy, or an error status
Acquire = Callable[[int, int, int], "Sequence[P] | int"]
Release = Callable[[int], None]


def _timeval(seconds: float) -> bytes:
    return struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCK_BUF)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCK_BUF)
    # Blocking sockets with kernel timeouts: MSG_WAITALL and sendfile then block in the
    # kernel (one syscall per page) yet still fail after IO_TIMEOUT if the other side stalls.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(IO_TIMEOUT))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(IO_TIMEOUT))


def sendfile_works(fd: int) -> bool:
    """Whether ``os.sendfile`` can read ``fd``: hugetlbfs (a ``MFD_HUGETLB`` pool) has no
    splice support, so sendfile from it fails with EINVAL whatever the offset."""
    a, b = socket.socketpair()
    try:
        os.sendfile(a.fileno(), fd, 0, 1)
        return True
    except OSError:
        return False
    finally:
        a.close()
        b.close()


def _deadline(nbytes: int) -> float:
    return time.monotonic() + IO_TIMEOUT + nbytes / MIN_RATE


def _recv_exact(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    got = 0
    n = len(view)
    while got < n:
        if deadline is not None and time.monotonic() > deadline:
            raise TransferError(f"peer sends slower than {MIN_RATE >> 20} MiB/s")
        r = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        if r == 0:
            raise TransferError("peer closed the data connection")
        got += r


def _in_time(deadline: float) -> None:
    """A send past its deadline: the peer reads too slowly (the holder closes the connection)."""
    if time.monotonic() > deadline:
        raise OSError(f"peer reads slower than {MIN_RATE >> 20} MiB/s")


def _send_exact(sock: socket.socket, data: memoryview, deadline: float) -> None:
    while data:
        _in_time(deadline)
        sent = sock.send(data)
        data = data[sent:]


class TcpDataServer(Generic[P]):
    """The node's data port. Serves pages of live pins to any puller that names the pin.

    ``acquire`` and ``release`` come from the pin table and ``checksum_of`` (a page's
    xxh3_64, known or computed now: ``PageChecksums.of``) from the node; all are called
    from this server's threads. Everything else here touches no node state.
    """

    def __init__(self, addr: str, pool_fd: int, pool_view: memoryview, acquire: Acquire[P], release: Release,
                 on_sent: Callable[[int], None] | None = None,
                 checksum_of: Callable[[P], int] | None = None) -> None:
        host, port = split_host_port(addr)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(128)
        self.port: int = self.sock.getsockname()[1]
        self.pool_fd = pool_fd
        self.view = pool_view
        self.sendfile = sendfile_works(pool_fd)
        self.checksum_of: Callable[[P], int] = checksum_of or (
            lambda p: page_checksum(pool_view[p.offset:p.offset + p.size]))
        self.acquire = acquire
        self.release = release
        self.on_sent = on_sent  # called with the bytes of each span sent (a thread-safe counter)
        self._closed = False
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, name="p2p-data-accept", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _accept(self) -> None:
        """Accept until :meth:`close`. An error accepting (EMFILE, ENFILE, ENOBUFS: pressure
        anywhere in the process) or starting a connection's thread is waited out, not the
        end of the port: it ended the accept loop for good while the listening socket stayed
        open, so every puller's connection sat in the backlog until its timeout."""
        retry = Backoff(ACCEPT_RETRY_S, ACCEPT_RETRY_MAX_S)  # (this thread's alone)
        while not self._closed:
            try:
                conn, _ = self.sock.accept()
            except OSError as exc:
                if self._closed:
                    return
                delay = retry.fail("accept")
                log.warning("p2p_accept_failed", error=exc.strerror or repr(exc), retry_in_s=delay)
                time.sleep(delay)
                continue
            retry.ok("accept")
            try:
                _tune(conn)
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_IDLE)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
                with self._lock:
                    self._conns.add(conn)
                threading.Thread(target=self._serve, args=(conn,), name="p2p-data-send", daemon=True).start()
            except (OSError, RuntimeError) as exc:  # RuntimeError: no thread could be started
                log.warning("p2p_connection_not_served", error=repr(exc))
                with self._lock:
                    self._conns.discard(conn)
                conn.close()

    def _serve(self, conn: socket.socket) -> None:
        hdr = bytearray(REQ.size)
        try:
            while True:
                # Between requests a connection may idle (pooled by the puller): it waits
                # IDLE_TIMEOUT for the next request, then is closed (the puller replaces a
                # pooled connection the holder closed); keepalive reaps pullers that vanished
                # sooner. Without a bound a client that connects and sends nothing (or half a
                # header) held a thread and a descriptor here for good.
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(IDLE_TIMEOUT))
                try:
                    _recv_exact(conn, memoryview(hdr))
                except (TransferError, OSError):
                    return
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(IO_TIMEOUT))
                magic, pin_id, start, count = REQ.unpack(hdr)
                if magic != REQ_MAGIC:
                    return
                pages = self.acquire(pin_id, start, count)
                if isinstance(pages, int):
                    conn.sendall(RESP.pack(RESP_MAGIC, pages, 0))
                    continue
                try:
                    conn.sendall(RESP.pack(RESP_MAGIC, OK, sum(p.size for p in pages)))
                    self._send_pages(conn, pages)
                finally:
                    self.release(pin_id)
        except OSError as exc:  # puller died or stalled: nothing to clean up but the socket
            log.debug("p2p_send_aborted", error=repr(exc))
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _send_pages(self, conn: socket.socket, pages: Sequence[P]) -> None:
        out, fd, checksum_of = conn.fileno(), self.pool_fd, self.checksum_of
        sums = []
        total = 0
        deadline = _deadline(sum(p.size for p in pages))
        for p in pages:
            _in_time(deadline)
            sums.append(checksum_of(p))
            off, n = p.offset, p.size
            total += n
            if not self.sendfile:
                _send_exact(conn, self.view[off:off + n], deadline)
                continue
            while n:
                sent = os.sendfile(out, fd, off, n)
                if sent == 0:
                    raise OSError("sendfile sent nothing")
                off += sent
                n -= sent
                if n:
                    _in_time(deadline)
        # Counted before the checksums go: the puller's pull ends when they arrive, so a
        # scrape after any pull ended counts its bytes (counted after, a pull could end and be
        # scraped before this thread ran again: PeerStats.served_bytes 0 in a loaded test run).
        if self.on_sent is not None:
            self.on_sent(total)
        conn.sendall(struct.pack(f"<{len(sums)}Q", *sums))

    def close(self) -> None:
        self._closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class TcpTransport:
    """Puller side of the TCP data plane; see the module docstring. Thread-safe."""

    name = TCP

    def __init__(self, pool_view: memoryview, streams: int = STREAMS) -> None:
        self.view = pool_view
        self.streams = max(1, streams)
        self._idle: dict[str, list[socket.socket]] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max(1, self.streams - 1) * 4, thread_name_prefix="p2p-recv")

    def read(self, remote: RemotePages, dests: Sequence[int]) -> list[int | None]:
        """Fill ``dests[i]`` with remote page ``i``; per page, its checksum if it matches the sender's."""
        n = len(dests)
        if n != remote.count:
            raise ValueError(f"{n} destinations for {remote.count} pages")
        if n == 0:
            return []
        per = max(1, MIN_STREAM_BYTES // max(1, remote.page_bytes))
        k = max(1, min(self.streams, -(-n // per)))
        step = -(-n // k)
        parts = [(s, min(n, s + step)) for s in range(0, n, step)]
        futs = [self._pool.submit(self._read_range, remote, dests, a, b) for a, b in parts[1:]]
        err: BaseException | None = None
        ok: list[int | None] = []
        try:
            ok += self._read_range(remote, dests, *parts[0])
        except BaseException as exc:  # noqa: BLE001 - wait for the other streams before raising
            err = exc
        for f in futs:
            try:
                ok += f.result()
            except BaseException as exc:  # noqa: BLE001
                err = err or exc
        if err is not None:
            self.forget(remote.data_addr)  # idle connections to a failing peer are suspect too
            if isinstance(err, TransferError):
                raise err
            raise TransferError(f"data plane {remote.data_addr}: {err!r}") from err
        return ok

    def _read_range(self, remote: RemotePages, dests: Sequence[int], a: int, b: int) -> list[int | None]:
        sock, reused = self._connect(remote.data_addr)
        ok = False
        try:
            hdr = bytearray(RESP.size)
            try:
                sock.sendall(REQ.pack(REQ_MAGIC, remote.pin_id, a, b - a))
                _recv_exact(sock, memoryview(hdr))
            except (TransferError, OSError):
                if not reused:
                    raise
                # An idle connection the peer has closed meanwhile: retry once on a new one.
                sock.close()
                sock, _ = self._connect(remote.data_addr, fresh=True)
                sock.sendall(REQ.pack(REQ_MAGIC, remote.pin_id, a, b - a))
                _recv_exact(sock, memoryview(hdr))
            magic, status, total = RESP.unpack(hdr)
            if magic != RESP_MAGIC:
                raise TransferError("bad response magic on the data port")
            if status != OK:
                raise TransferError(f"peer refused pin {remote.pin_id}: status {status}")
            size = remote.page_bytes
            if total != (b - a) * size:
                raise TransferError(f"peer sends {total} bytes, expected {(b - a) * size}")
            view = self.view
            got = []
            deadline = _deadline(total)
            for i in range(a, b):
                page = view[dests[i]:dests[i] + size]
                _recv_exact(sock, page, deadline)
                got.append(page_checksum(page))
            trailer = bytearray(8 * (b - a))
            _recv_exact(sock, memoryview(trailer), deadline)
            sent = struct.unpack(f"<{b - a}Q", trailer)
            ok = True
            return [x if x == y else None for x, y in zip(got, sent, strict=True)]
        except OSError as exc:
            raise TransferError(f"data plane {remote.data_addr}: {exc}") from exc
        finally:
            if ok:
                self._put(remote.data_addr, sock)
            else:
                sock.close()

    def _connect(self, addr: str, fresh: bool = False) -> tuple[socket.socket, bool]:
        """A connection to ``addr`` and whether it was reused from the idle list."""
        if not fresh:
            with self._lock:
                idle = self._idle.get(addr)
                if idle:
                    return idle.pop(), True
        host, port = split_host_port(addr)
        try:
            sock = socket.create_connection((host, port), timeout=IO_TIMEOUT)
        except OSError as exc:
            raise TransferError(f"cannot connect to data port {addr}: {exc}") from exc
        sock.settimeout(None)  # blocking; SO_RCVTIMEO/SO_SNDTIMEO bound each call instead
        _tune(sock)
        return sock, False

    def _put(self, addr: str, sock: socket.socket) -> None:
        with self._lock:
            idle = self._idle.setdefault(addr, [])
            if len(idle) < IDLE_PER_PEER:
                idle.append(sock)
                return
        sock.close()

    def forget(self, addr: str) -> None:
        """Drop idle connections to a peer (it failed; its next pull reconnects)."""
        with self._lock:
            socks = self._idle.pop(addr, [])
        for s in socks:
            s.close()

    def close(self) -> None:
        with self._lock:
            all_socks = [s for v in self._idle.values() for s in v]
            self._idle.clear()
        for s in all_socks:
            s.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

"""The client's connections to the node stay in step with their replies and epochs.

A call cut short by any exception, ``KeyboardInterrupt`` in a blocked read among them,
drops its socket: the node's reply to it may still arrive, and the thread's next call
would read it as its own (a Reserve answered with a Query's bytes: offsets of pages
committed already). The node here is a thread that echoes each frame's payload."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import pegaflow.client.client as client_mod
from pegaflow._proto import node_pb2
from pegaflow.client.client import PegaClient, _LocalLink
from pegaflow.common.local_wire import REPLY_HEADER, REQUEST_HEADER
from pegaflow.common.security import Security


def _recv(conn: socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def _echo(conn: socket.socket) -> None:
    with conn:
        try:
            while (head := _recv(conn, REQUEST_HEADER.size)) is not None:
                length, _method, _flags = REQUEST_HEADER.unpack(head)
                body = _recv(conn, length) if length else b""
                if body is None:
                    return
                conn.sendall(REPLY_HEADER.pack(len(body), 0) + body)
        except OSError:  # the client dropped this connection
            return


@pytest.fixture
def echo_socket(tmp_path: Path) -> Iterator[str]:
    path = str(tmp_path / "node.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen()

    def accept() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=_echo, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield path
    finally:
        srv.close()


def test_a_call_interrupted_in_its_read_never_hands_its_reply_to_the_next_call(
        echo_socket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    link = _LocalLink(echo_socket, timeout=5.0)
    assert link.call(1, b"warm-up") == (0, b"warm-up")
    real = client_mod._recv_exactly

    def interrupted(s: socket.socket, n: int) -> bytes:
        monkeypatch.setattr(client_mod, "_recv_exactly", real)
        raise KeyboardInterrupt  # Ctrl-C while the call waits for its reply

    monkeypatch.setattr(client_mod, "_recv_exactly", interrupted)
    with pytest.raises(KeyboardInterrupt):
        link.call(1, b"first")
    assert link.call(1, b"second") == (0, b"second"), "the interrupted call's reply was taken as this one's"
    link.close()


class _Stream:
    def __iter__(self) -> Iterator[object]:
        return iter(())

    def cancel(self) -> None:
        pass


class _Pool:
    """A stand-in for the pool's mapping: its bytes say which epoch's pool it is."""

    epoch = 0

    def __init__(self, path: str, size: int, fd: int | None = None) -> None:
        self.tensor = torch.full((4,), _Pool.epoch, dtype=torch.uint8)


def test_a_re_registration_never_pairs_one_epochs_pool_with_the_other_epoch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The node restarted (epoch 1 -> 2) and the client registers again on its own thread while
    a worker asks for the pool of the epoch its offsets belong to: at every step of the
    re-registration the answer is that epoch's pool or nothing."""
    seen: list[tuple[int, int | None]] = []

    class Watched(PegaClient):
        def __setattr__(self, name: str, value: object) -> None:
            super().__setattr__(name, value)
            if "_bound" in self.__dict__:
                for epoch in (1, 2):
                    pool = self.pool_of(epoch)
                    seen.append((epoch, None if pool is None else int(pool[0])))

    c = Watched("127.0.0.1:1", security=Security())
    def register_reply(*args: object, **kw: object) -> node_pb2.RegisterResponse:
        _Pool.epoch += 1
        return node_pb2.RegisterResponse(session_id=7, epoch=_Pool.epoch, pool_path="/x", pool_bytes=4, node_id="n")

    monkeypatch.setattr(c, "_call", register_reply)
    monkeypatch.setattr(client_mod, "_Mapping", _Pool)
    monkeypatch.setattr(c._stub, "Session", lambda req: _Stream())
    c.register({"ns": 4})
    assert c.pool_of(1) is not None and int(c.pool_of(1)[0]) == 1
    seen.clear()
    with c._lock:
        c._register_locked()
    assert seen and all(pool in (None, epoch) for epoch, pool in seen), seen
    assert c.pool_of(2) is not None and c.pool_of(1) is None

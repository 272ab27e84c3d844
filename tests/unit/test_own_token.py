"""A node's own token (pegaflow/common/security.py): when a node makes one, where it keeps
it, and how clients find it. The end-to-end check against another uid is
tests/integration/test_default_auth.py."""

from __future__ import annotations

import os
import stat

import pytest

from pegaflow.common.security import (
    OwnToken,
    Security,
    SecurityError,
    _NodeToken,
    default_socket_path,
    group_id,
    node_token_paths,
    own_token_wanted,
    token_for_node,
    token_path,
)


@pytest.mark.parametrize("configured, no_auth, listeners, wanted", [
    ("", False, ["127.0.0.1:50055"], True),
    ("", False, ["localhost:50055", "127.0.0.1:0"], True),
    ("", False, ["[::1]:50055"], True),
    ("", False, ["0.0.0.0:50055"], False),  # beyond loopback: today's behaviour (and its warning)
    ("", False, ["127.0.0.1:50055", "0.0.0.0:0"], False),  # the data port counts
    ("", False, ["10.0.0.1:50055"], False),
    ("", True, ["127.0.0.1:50055"], False),  # --no-auth
    ("tok", False, ["127.0.0.1:50055"], False),  # a configured token is used as is
])
def test_a_node_makes_its_own_token_only_with_every_listener_on_loopback(configured, no_auth, listeners, wanted):
    assert own_token_wanted(configured, no_auth, listeners) is wanted


def test_clients_look_beside_the_default_sockets_of_a_loopback_address(monkeypatch):
    env = {"XDG_RUNTIME_DIR": "/run/user/7"}
    paths = node_token_paths("127.0.0.1:5005", env)
    assert paths[0] == token_path(default_socket_path("127.0.0.1", 5005, env)) == \
        "/run/user/7/pegaflow-node-127.0.0.1-5005.sock.token"
    assert token_path(default_socket_path("127.0.0.1", 5005, env, shared=True)) in paths  # --access-group
    assert "/tmp/pegaflow-node-localhost-5005.sock.token" in paths  # a node bound to another loopback name
    assert node_token_paths("[::1]:5005", {})[0] == "/tmp/pegaflow-node-::1-5005.sock.token"
    assert node_token_paths("10.0.0.1:5005", env) == [] and node_token_paths("nonsense", env) == []


def test_the_token_file_is_0600_replaces_a_stale_one_and_goes_at_exit(tmp_path):
    sock = str(tmp_path / "n.sock")
    path = token_path(sock)
    with open(path, "w") as f:  # a killed node's leftover
        f.write("stale")
    own = OwnToken(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert open(path).read().strip() == own.token and len(own.token) >= 40
    assert OwnToken(str(tmp_path / "other.token")).token != own.token
    own.remove()
    assert not os.path.exists(path)
    os.mkdir(path)  # a path it cannot take: one line
    with pytest.raises(SecurityError, match="cannot write the node's token file"):
        OwnToken(path)


def test_a_replaced_token_file_is_left_to_its_new_owner(tmp_path):
    path = str(tmp_path / "n.sock.token")
    first = OwnToken(path)
    second = OwnToken(path)  # a newer node on the same path
    first.remove()
    assert open(path).read().strip() == second.token


def test_a_group_reads_the_token(tmp_path):
    gid = os.getgid()
    own = OwnToken(str(tmp_path / "g.token"), gid)
    st = os.stat(own.path)
    assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o640, gid)
    with pytest.raises(SecurityError, match="no such group"):
        group_id("no-such-group-pf")


def test_channels_reread_the_token_when_the_node_restarts(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    addr = "127.0.0.1:6011"
    path = node_token_paths(addr)[0]
    source = _NodeToken(addr)
    assert source.get() == "" and token_for_node(addr) == ""
    first = OwnToken(path)
    assert source.get() == first.token == token_for_node(addr) == Security().token_for(addr)
    second = OwnToken(path)  # restarted: a new token in a new file
    assert source.get() == second.token
    assert Security(token="configured").token_for(addr) == "configured"

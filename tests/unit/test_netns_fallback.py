"""tests/harness/netns.py's loopback fallback (no root or no ip(8)): clusters open at once in
one process never share addresses (bench/backup.py runs two at once), and a closed
cluster's addresses can be handed out again."""

from __future__ import annotations

import pytest

from tests.harness import netns


def test_fallback_clusters_open_at_once_never_share_addresses(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_namespaces(n: int) -> netns.Cluster:
        raise OSError("no namespaces here")

    monkeypatch.setattr(netns, "_netns_cluster", no_namespaces)
    clusters = [netns.make_cluster(2) for _ in range(198)]  # every base there is
    try:
        assert all(c.fallback_reason for c in clusters)
        ips = [h.ip for c in clusters for h in (c.hub, *c.hosts)]
        assert len(set(ips)) == len(ips) == 198 * 3
    finally:
        for c in clusters[1:]:
            c.close()
    again = netns.make_cluster(1)  # only the first's base is still held
    try:
        assert again.hub.ip != clusters[0].hub.ip
    finally:
        again.close()
        clusters[0].close()
    assert not netns._LOOPBACK_BASES

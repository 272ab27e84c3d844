"""``pegaflow-meta rebuild`` swaps its scratch index over the live one only while the
replicas are still paused: a pause that ended (expired under a long replay, lifted by hand)
or leases still held mean replicas applied, or still apply, updates that the swap would
drop though they are acknowledged. Then it changes nothing and says so in one line. (A
rebuild that keeps its pause: tests/integration/test_meta_index.py, on a real redis-server,
whose Lua has the struct library the swap uses.)"""

from __future__ import annotations

import random

import fakeredis
import pytest

from pegaflow.cluster import keys, registry
from pegaflow.cluster.keys import stream_key
from pegaflow.meta import rebuild as rebuild_mod
from pegaflow.meta.events.codec import FIELD, encode
from pegaflow.meta.events.schema import Event, Op
from pegaflow.meta.index import Index

NS = "llama|fp16|bs16|tp1"


@pytest.fixture
def r() -> fakeredis.FakeRedis:
    pytest.importorskip("lupa", reason="fakeredis runs Lua scripts only with lupa (pip install 'fakeredis[lua]')")
    return fakeredis.FakeRedis()


def _streams(r: fakeredis.FakeRedis) -> list[bytes]:
    rng = random.Random(3)
    hs = [rng.randbytes(16) for _ in range(40)]
    nid, epoch = registry.register(r, "a", "h:1", 60_000, switch=True)
    for i in range(0, 40, 4):
        r.xadd(stream_key("a"), {FIELD: encode(Event("a", nid, epoch, i, Op.INSERT, NS, b"".join(hs[i:i + 4])))})
    return hs


def test_a_rebuild_whose_pause_ended_midway_changes_nothing(r: fakeredis.FakeRedis,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    hs = _streams(r)
    monkeypatch.setattr(rebuild_mod, "XRANGE_COUNT", 2)
    monkeypatch.setattr(rebuild_mod, "PAUSE_RENEW_S", 0.0)
    real = Index.apply_many
    calls = [0]

    def slow_replay(self, updates, native=None):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] == 2:
            r.delete(keys.PAUSE)  # the pause expired meanwhile: replicas apply again
        return real(self, updates, native)

    monkeypatch.setattr(Index, "apply_many", slow_replay)
    before = Index(r).query(NS, hs)
    with pytest.raises(rebuild_mod.RebuildError, match="pause ended"):
        rebuild_mod.rebuild(r, wait_leases=1.0)
    assert Index(r).query(NS, hs) == before, "the live index was swapped after the pause ended"


def test_a_rebuild_with_a_lease_still_held_changes_nothing(r: fakeredis.FakeRedis) -> None:
    hs = _streams(r)
    r.set(keys.owner_key("a"), "replica-that-does-not-let-go", px=60_000)
    before = Index(r).query(NS, hs)
    with pytest.raises(rebuild_mod.RebuildError, match="still hold the stream leases"):
        rebuild_mod.rebuild(r, wait_leases=0.2)
    assert Index(r).query(NS, hs) == before and r.get(keys.PAUSE) is None


"""Holder tiers (L1 / SSD) in events, the index's holder lists and the node's publisher glue,
without Redis: the codec, the prefix computation against a brute-force reference, and
HolderTiers' rules (a DRAM eviction of a block on SSD is a tier change, not an EVICT)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from pegaflow.cluster import keys
from pegaflow.core.block_index import IndexEvent
from pegaflow.core.tiers import LOCAL_TIERS, Tier
from pegaflow.meta.events.codec import decode, encode
from pegaflow.meta.events.schema import FLAG_LAST, FLAG_SSD, Event, Op, Update
from pegaflow.meta.index import Held, nid_bytes, prefix_holders, prefix_tiers
from pegaflow.node.publishing import HolderTiers

H = [bytes([i]) * 16 for i in range(8)]


def test_ssd_flag_round_trips_and_old_events_are_l1() -> None:
    ev = Event.make("n", 3, 1, 7, Op.INSERT, "ns", H[:2], FLAG_SSD)
    back = decode(encode(ev))
    assert back == ev and back.tier is Tier.SSD and Update.of(back).tier is Tier.SSD
    old = decode(encode(Event.make("n", 3, 1, 8, Op.INSERT, "ns", H[:2])))
    assert old.tier is Tier.L1 and Update.of(old).tier is Tier.L1
    snap = decode(encode(Event.make("n", 3, 1, 9, Op.SNAPSHOT, "ns", H[:1], FLAG_SSD | FLAG_LAST)))
    assert snap.tier is Tier.SSD and snap.last
    # The flag means nothing on an EVICT: gone from every tier.
    assert decode(encode(Event.make("n", 3, 1, 10, Op.EVICT, "ns", H[:1], FLAG_SSD))).tier is Tier.L1
    # The same bytes as before the flag existed: one header byte, no new field.
    assert len(encode(ev)) == len(encode(Event.make("n", 3, 1, 7, Op.INSERT, "ns", H[:2])))


def test_holder_entry_carries_the_tier_in_the_top_bit() -> None:
    assert nid_bytes(5) == (5).to_bytes(keys.NID_BYTES, "big")
    assert int.from_bytes(nid_bytes(5, Tier.SSD), "big") == 5 | keys.TIER_BIT
    try:
        nid_bytes(keys.TIER_BIT)
    except ValueError:
        pass
    else:
        raise AssertionError("a nid reaching the tier bit must be refused")


def _reference(lists: list[dict[int, Tier] | None]) -> dict[int, Held]:
    out: dict[int, Held] = {}
    if not lists or lists[0] is None:
        return out
    for nid in lists[0]:
        n = ssd = 0
        for held in lists:
            if held is None or nid not in held:
                break
            n += 1
            ssd += held[nid] is Tier.SSD
        out[nid] = Held(n, ssd)
    return out


def _encode(held: dict[int, Tier] | None) -> bytes | None:
    return None if held is None else b"".join(nid_bytes(n, t) for n, t in held.items())


def test_prefix_tiers_equals_a_brute_force_reference() -> None:
    rng = random.Random(1)
    for _ in range(3000):
        nids = rng.sample(range(1, 9), rng.randint(1, 4))
        lists: list[dict[int, Tier] | None] = []
        cur = {n: rng.choice(LOCAL_TIERS) for n in nids}
        for _ in range(rng.randint(1, 12)):
            r = rng.random()
            if r < 0.05:
                lists.append(None)
                continue
            if r < 0.4:  # change something: a tier, drop or add a holder
                cur = dict(cur)
                n = rng.choice(nids)
                if rng.random() < 0.5:
                    cur[n] = rng.choice(LOCAL_TIERS)
                elif n in cur and len(cur) > 1:
                    del cur[n]
                else:
                    cur[n] = Tier.L1
            lists.append(dict(rng.sample(list(cur.items()), len(cur))))  # order within a list is free
        values = [_encode(x) for x in lists]
        want = _reference(lists)
        assert prefix_tiers(values) == want, lists
        assert prefix_holders(values) == {n: h.prefix_len for n, h in want.items()}


def test_held_tier_is_the_slowest_of_the_prefix() -> None:
    v = [_encode({1: Tier.L1, 2: Tier.SSD}), _encode({1: Tier.SSD, 2: Tier.SSD})]
    got = prefix_tiers(v)
    assert got == {1: Held(2, 1), 2: Held(2, 2)}
    assert got[1].tier is Tier.SSD and Held(3, 0).tier is Tier.L1


# --- HolderTiers: the node's rules -------------------------------------------------------


@dataclass
class _Ns:
    id: int
    name: str


@dataclass
class _Index:
    l1: set[tuple[int, bytes]] = field(default_factory=set)
    nss: dict[int, _Ns] = field(default_factory=dict)

    def contains(self, ns: _Ns, h: bytes) -> bool:
        return (ns.id, h) in self.l1

    def namespace_by_id(self, i: int) -> _Ns | None:
        return self.nss.get(i)

    def resident(self) -> list:
        @dataclass
        class B:
            ns: _Ns
            hash: bytes
        return [B(self.nss[i], h) for i, h in sorted(self.l1)]


class _Pub:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, list[bytes], Tier]] = []

    def on_tier(self, ns: str, hashes, tier: Tier) -> None:
        self.events.append(("insert", ns, list(hashes), tier))

    def on_evict(self, ns: str, hashes) -> None:
        self.events.append(("evict", ns, list(hashes), Tier.L1))


def _setup() -> tuple[_Ns, _Index, dict, _Pub, HolderTiers]:
    ns = _Ns(1, "m")
    idx = _Index(nss={1: ns})
    ssd: dict[tuple[int, bytes], object] = {}
    pub = _Pub()
    return ns, idx, ssd, pub, HolderTiers(pub, idx, ssd)  # type: ignore[arg-type]


def test_dram_eviction_of_a_block_on_ssd_is_a_tier_change() -> None:
    ns, idx, ssd, pub, t = _setup()
    idx.l1.update({(1, H[0]), (1, H[1])})
    t.on_index_event(IndexEvent.INSERT, ns, [H[0], H[1]])  # type: ignore[arg-type]
    ssd[(1, H[0])] = object()
    t.ssd_stored(ns, [H[0]])  # type: ignore[arg-type]  # in DRAM: L1 is better, nothing to say
    assert pub.events == [("insert", "m", [H[0], H[1]], Tier.L1)]
    pub.events.clear()
    idx.l1.clear()
    t.on_index_event(IndexEvent.EVICT, ns, [H[0], H[1]])  # type: ignore[arg-type]
    assert sorted(pub.events) == [("evict", "m", [H[1]], Tier.L1), ("insert", "m", [H[0]], Tier.SSD)]
    pub.events.clear()
    del ssd[(1, H[0])]
    t.ssd_removed(ns, [H[0]])  # type: ignore[arg-type]
    assert pub.events == [("evict", "m", [H[0]], Tier.L1)]


def test_ssd_store_after_dram_eviction_and_ssd_eviction_of_a_dram_block() -> None:
    ns, idx, ssd, pub, t = _setup()
    ssd[(1, H[2])] = object()  # the write landed after the block left DRAM
    t.ssd_stored(ns, [H[2]])  # type: ignore[arg-type]
    assert pub.events == [("insert", "m", [H[2]], Tier.SSD)]
    pub.events.clear()
    idx.l1.add((1, H[2]))  # promoted back
    t.on_index_event(IndexEvent.INSERT, ns, [H[2]])  # type: ignore[arg-type]
    del ssd[(1, H[2])]
    t.ssd_removed(ns, [H[2]])  # type: ignore[arg-type]  # still in DRAM: no EVICT
    assert pub.events == [("insert", "m", [H[2]], Tier.L1)]


def test_snapshot_lists_dram_blocks_as_l1_and_ssd_only_blocks_as_ssd() -> None:
    ns, idx, ssd, pub, t = _setup()
    idx.l1.update({(1, H[0]), (1, H[1])})
    ssd.update({(1, H[1]): 0, (1, H[3]): 0, (9, H[4]): 0})  # ns 9: unknown here, left out
    snap = t.snapshot()  # the cut, on the node's loop: it copies, the publisher thread groups
    idx.l1.clear()  # the loop goes on changing both tiers meanwhile
    ssd.clear()
    ssd[(1, H[5])] = 0
    assert sorted(map(str, snap)) == sorted(map(str, [("m", [H[0], H[1]]), ("m", [H[3]], Tier.SSD)]))

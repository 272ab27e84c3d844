"""A live engine slower than the node's TTLs never sees, or writes, someone else's bytes.

Against a real node whose pool holds exactly 8 pages and whose TTLs are a fraction of a
second: a writer holds its reservation past ``--reservation-ttl`` while another engine
asks for pages; a reader holds its lease past ``--lease-ttl`` while another engine writes.
Before the TTLs were tied to the session, the late writer's pages were handed to the
other engine (its commit then failed, after it had overwritten them), and the late reader
copied the other engine's bytes.
"""

from __future__ import annotations

import pytest
import torch
import xxhash

from pegaflow.client import PegaClient
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

PAGE = 64 << 10
PAGES = 8
TTL = "0.2"


def hashes(tag: str, n: int = PAGES) -> list[bytes]:
    return [xxhash.xxh3_128_digest(f"{tag}:{i}".encode()) for i in range(n)]


def pattern(tag: str, i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(xxhash.xxh32_intdigest(f"{tag}:{i}".encode()))
    return torch.randint(0, 256, (PAGE,), dtype=torch.uint8, generator=g)


def write(c: PegaClient, tag: str, offsets: list[int]) -> None:
    for i, off in enumerate(offsets):
        if off >= 0:
            c.pool[off:off + PAGE] = pattern(tag, i)


def wait_metric(node, kind: str, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    wait_until(lambda: node.metric("pegaflow_node_expired_total", f'kind="{kind}"') >= 1, timeout,
               f"the node to report a late {kind}", every=0.02)


@pytest.fixture
def tiny_node(node_factory):  # type: ignore[no-untyped-def]
    return node_factory(f"{PAGES * PAGE >> 10}kb", ["--reservation-ttl", TTL, "--lease-ttl", TTL])


def test_a_writer_slower_than_the_reservation_ttl_keeps_its_pages(tiny_node):  # type: ignore[no-untyped-def]
    with PegaClient(tiny_node.addr) as late, PegaClient(tiny_node.addr) as other:
        late.register({"m": PAGE})
        other.register({"m": PAGE})
        r = late.reserve("m", hashes("late"))
        assert sum(o >= 0 for o in r.offsets) == PAGES
        wait_metric(tiny_node, "reservation")
        o = other.reserve("m", hashes("other"))
        taken = [off for off in o.offsets if off >= 0]
        assert not set(taken) & set(r.offsets), "a late writer's pages were given to another engine"
        write(other, "other", o.offsets)
        if o.reservation_id:
            other.commit(o.reservation_id)
        write(late, "late", r.offsets)  # the late writer's copy, after the TTL
        assert late.commit(r.reservation_id) == PAGES  # and its save lands
        q = late.query(["m"], hashes("late"))
        assert q.hit_blocks == PAGES
        for i, off in enumerate(q.offsets["m"]):
            assert torch.equal(q.pool[off:off + PAGE], pattern("late", i))
        late.release(q.lease_id)
        assert late.stats().active_reservations == 0


def test_a_reader_slower_than_the_lease_ttl_copies_the_pages_it_leased(tiny_node):  # type: ignore[no-untyped-def]
    with PegaClient(tiny_node.addr) as reader, PegaClient(tiny_node.addr) as writer:
        reader.register({"m": PAGE})
        writer.register({"m": PAGE})
        r = writer.reserve("m", hashes("a"))
        write(writer, "a", r.offsets)
        assert writer.commit(r.reservation_id) == PAGES
        q = reader.query(["m"], hashes("a"))
        assert q.hit_blocks == PAGES and q.lease_id
        wait_metric(tiny_node, "lease")
        w = writer.reserve("m", hashes("b"))  # would evict the leased pages if the lease had lapsed
        assert not {off for off in w.offsets if off >= 0} & set(q.offsets["m"])
        write(writer, "b", w.offsets)
        if w.reservation_id:
            writer.commit(w.reservation_id)
        for i, off in enumerate(q.offsets["m"]):  # the late reader's copy
            assert torch.equal(q.pool[off:off + PAGE], pattern("a", i)), f"block {i}: someone else's bytes"
        reader.release(q.lease_id)

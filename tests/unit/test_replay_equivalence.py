"""Replay equals the node's rules written out longhand, and the allocator choice is invisible.

The reference below is the node's LRU + pending-page rules as a plain OrderedDict model
(prefix lookup touches hits; the blocks after the prefix are reserved in order: resident
ones are touched, new ones take free space, then the LRU head; a request's own pending
pages are never victims; once a block gets no page the later ones get none). Random
prefix-chained traces must give the same per-request hits through ``pegaflow replay``,
which runs the real ``BlockIndex`` with its batched fast paths.
"""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from pegaflow.config.capacity import Capacity
from pegaflow.core.trace import read_trace
from pegaflow.replay.model import Scenario
from pegaflow.replay.run import replay


def reference(reqs: list[list[int]], cap: int) -> list[int]:
    lru: OrderedDict[int, None] = OrderedDict()
    hits = []
    for hs in reqs:
        h = 0
        while h < len(hs) and hs[h] in lru:
            h += 1
        for k in hs[:h]:
            lru.move_to_end(k)
        hits.append(h)
        pending: list[int] = []
        full = False
        for k in hs[h:]:
            if k in lru:
                lru.move_to_end(k)
                continue
            if full or k in pending:
                continue
            if len(lru) + len(pending) < cap:
                pending.append(k)
            elif lru:
                lru.popitem(last=False)
                pending.append(k)
            else:
                full = True
        for k in pending:
            lru[k] = None
    return hits


def random_trace(seed: int, requests: int = 400) -> list[list[int]]:
    """Prompts that share prefixes (a random tree of ids), sometimes with repeated ids."""
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    next_id = 0
    for _ in range(requests):
        if prompts and rng.random() < 0.7:
            base = rng.choice(prompts)
            ids = base[: rng.randint(0, len(base))]
        else:
            ids = []
        for _ in range(rng.randint(1, 12)):
            ids.append(next_id)
            next_id += 1
        if rng.random() < 0.05 and ids:
            ids.append(rng.choice(ids))  # a repeat inside one request
        prompts.append(ids)
    return prompts


def as_lines(reqs: list[list[int]]) -> list[str]:
    import json

    return [
        json.dumps({"timestamp": i, "input_length": 512 * len(r), "output_length": 1, "hash_ids": r})
        for i, r in enumerate(reqs)
    ]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("cap", [1, 3, 17, 64, 300])
def test_replay_hits_equal_the_reference_rules(seed, cap):
    reqs = random_trace(seed)
    trace = read_trace(as_lines(reqs))
    got = replay(trace, Scenario(Capacity(cap, "blocks"))).request_hits
    assert got == reference(reqs, cap)


@pytest.mark.parametrize("cap", [5, 40])
def test_bytes_and_blocks_give_the_same_run(cap):
    # Capacity in bytes with 64 KiB pages exercises the same code with real page sizes.
    reqs = random_trace(7)
    trace = read_trace(as_lines(reqs))
    blocks = replay(trace, Scenario(Capacity(cap, "blocks")))
    by_bytes = replay(trace, Scenario(Capacity(cap * 65536 + 1000, "bytes"), page_bytes=65536))
    assert by_bytes.l1_capacity_blocks == cap
    assert by_bytes.request_hits == blocks.request_hits
    assert by_bytes.evictions == blocks.evictions

"""bench/traces.py: the shaped traces are seeded (the same lines every time), parse as
Mooncake traces, and have their shapes (a dominant shared prefix for conversations, long
sessions for agents, mostly one-shot documents for the scan)."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from bench.traces import BLOCK_TOKENS, GENERATORS, agent, conversation, scan
from pegaflow.core.trace import read_trace


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_seeded_and_readable(name: str) -> None:
    gen = GENERATORS[name]
    a, b, c = gen(seed=3, requests=500), gen(seed=3, requests=500), gen(seed=4, requests=500)
    assert a == b and a != c and len(a) == 500
    rows = [json.loads(x) for x in a]
    assert [r["timestamp"] for r in rows] == sorted(r["timestamp"] for r in rows)
    for r in rows:
        n = len(r["hash_ids"])
        assert (n - 1) * BLOCK_TOKENS < r["input_length"] <= n * BLOCK_TOKENS
    trace = read_trace(a)
    assert len(trace.requests) == 500 and 0 < trace.ceiling < 1


def test_shapes() -> None:
    conv = [json.loads(x)["hash_ids"] for x in conversation(requests=2000)]
    firsts = Counter(ids[0] for ids in conv)
    assert firsts.most_common(1)[0][1] > 0.5 * len(conv)  # one system prompt dominates
    # a later turn extends an earlier prompt of its conversation
    prefixes = {tuple(ids) for ids in conv}
    assert sum(any(tuple(ids[:k]) in prefixes for k in range(len(ids) - 1, 3, -1)) for ids in conv) > 0.3 * len(conv)
    ag = read_trace(agent(requests=2000))
    assert ag.ceiling > 0.8  # long sessions over a few tool prefixes
    sc = read_trace(scan(requests=2000))
    assert sc.ceiling < 0.4  # mostly read once

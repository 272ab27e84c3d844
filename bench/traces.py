"""Seeded generators of shaped request traces, in Mooncake's JSONL form.

    python bench/traces.py conversation [--seed 1] [--out conv.jsonl]

Each line is ``{"timestamp": ms, "input_length": tokens, "output_length": tokens,
"hash_ids": [...]}`` with 512-token blocks: equal ids are equal prefixes, as in
``traces/mooncake_synthetic_trace.jsonl.gz``. The same seed gives the same lines, so the
benchmarks and tests generate them on the fly instead of keeping files.

Shapes (sizes are defaults; see :data:`SHAPES`):

- ``conversation``: multi-turn chats. A new conversation starts every 1/``rate`` s
  (Poisson) with one of a few system prompts (Zipf: most share the first); each turn's
  prompt is the previous prompt, the previous answer and a new user message, and the next
  turn follows after a think time. One popular prefix and many private continuations:
  the shape where routing by prefix alone sends everything to one engine.
- ``agent``: tool-using agents. A few agent kinds, each with a long tool-definition
  prefix; a session runs many quick steps, each appending a tool call and its output.
- ``scan``: mostly one-shot long documents (no reuse) beside a small hot set of shared
  documents asked about again and again (Zipf).
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass

BLOCK_TOKENS = 512


@dataclass(frozen=True)
class Shape:
    requests: int  # about this many (the generator stops at the first request past it)
    rate: float  # new sessions per second


SHAPES = {
    "conversation": Shape(requests=6000, rate=2.0),
    "agent": Shape(requests=6000, rate=0.5),
    "scan": Shape(requests=4000, rate=4.0),
}


class _Ids:
    def __init__(self) -> None:
        self.next = 0

    def take(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def _zipf(rng: random.Random, n: int, s: float = 1.2) -> int:
    weights = [1.0 / (k + 1) ** s for k in range(n)]
    return rng.choices(range(n), weights)[0]


def _line(t: float, blocks: list[int], tail_tokens: int, output: int) -> str:
    tokens = (len(blocks) - 1) * BLOCK_TOKENS + tail_tokens
    return json.dumps({"timestamp": int(t * 1000), "input_length": tokens, "output_length": output,
                       "hash_ids": blocks})


def conversation(seed: int = 1, requests: int | None = None, rate: float | None = None) -> list[str]:
    sh = SHAPES["conversation"]
    return _generate(seed, requests or sh.requests, rate or sh.rate, _conversation)


def agent(seed: int = 1, requests: int | None = None, rate: float | None = None) -> list[str]:
    sh = SHAPES["agent"]
    return _generate(seed, requests or sh.requests, rate or sh.rate, _agent)


def scan(seed: int = 1, requests: int | None = None, rate: float | None = None) -> list[str]:
    sh = SHAPES["scan"]
    return _generate(seed, requests or sh.requests, rate or sh.rate, _scan)


def _generate(seed: int, requests: int, rate: float, session) -> list[str]:  # noqa: ANN001
    """Sessions start as a Poisson process; their requests are merged in time order."""
    rng = random.Random(seed)
    ids = _Ids()
    shared = _shared_prefixes(rng, ids, session)
    heap: list[tuple[float, int, str]] = []
    t = 0.0
    seq = 0
    made = 0
    while made < requests:
        t += rng.expovariate(rate)
        for when, line in session(rng, ids, shared, t):
            heapq.heappush(heap, (when, seq, line))
            seq += 1
            made += 1
    out = [heapq.heappop(heap) for _ in range(len(heap))]
    return [line for _, _, line in out[:requests]]


def _shared_prefixes(rng: random.Random, ids: _Ids, session) -> list[list[int]]:  # noqa: ANN001
    if session is _conversation:
        return [ids.take(rng.randint(2, 4)) for _ in range(4)]  # system prompts
    if session is _agent:
        return [ids.take(rng.randint(8, 12)) for _ in range(3)]  # tool definitions per agent kind
    return [ids.take(rng.randint(12, 30)) for _ in range(24)]  # the hot documents


def _conversation(rng: random.Random, ids: _Ids, shared: list[list[int]], t: float) -> Iterator[tuple[float, str]]:
    prompt = list(shared[_zipf(rng, len(shared), 2.0)])
    for _ in range(min(1 + int(rng.expovariate(1 / 2.0)), 24)):
        prompt += ids.take(rng.randint(1, 16))  # the user's message (a pasted document, at times)
        yield t, _line(t, prompt, rng.randint(1, BLOCK_TOKENS), 256)
        prompt += ids.take(rng.randint(1, 2))  # the answer, part of the next prompt
        t += 5.0 + rng.expovariate(1 / 40.0)  # reading and typing


def _agent(rng: random.Random, ids: _Ids, shared: list[list[int]], t: float) -> Iterator[tuple[float, str]]:
    prompt = list(shared[rng.randrange(len(shared))]) + ids.take(rng.randint(1, 2))  # + the task
    for _ in range(rng.randint(5, 30)):
        yield t, _line(t, prompt, rng.randint(1, BLOCK_TOKENS), 64)
        prompt += ids.take(rng.randint(1, 2))  # the tool call and what it returned
        t += 0.5 + rng.expovariate(1 / 3.0)


def _scan(rng: random.Random, ids: _Ids, shared: list[list[int]], t: float) -> Iterator[tuple[float, str]]:
    if rng.random() < 0.6:
        doc = ids.take(rng.randint(16, 48))  # read once, never again
    else:
        doc = list(shared[_zipf(rng, len(shared), 1.1)]) + ids.take(1)  # a question about a hot document
    yield t, _line(t, doc, rng.randint(1, BLOCK_TOKENS), 128)


GENERATORS = {"conversation": conversation, "agent": agent, "scan": scan}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", choices=sorted(GENERATORS))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--requests", type=int, default=0, help="default: the shape's")
    ap.add_argument("--rate", type=float, default=0.0, help="new sessions per second (default: the shape's)")
    ap.add_argument("--out", default="-", help="file (default: stdout)")
    a = ap.parse_args()
    lines = GENERATORS[a.shape](a.seed, a.requests or None, a.rate or None)
    f = sys.stdout if a.out == "-" else open(a.out, "w")  # noqa: SIM115
    with f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

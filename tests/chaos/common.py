"""What every chaos scenario shares: the block universe, verifiable pages, intensity, reports.

A block's page is a pure function of its hash (:func:`page`), so any process can check any
page it is served, byte for byte: a wrong byte is never "maybe fine". Scenarios run at two
intensities: ``fast`` (the default, part of ``make test``) and ``full`` (``make chaos``),
and each reports what it tried, what failed and what was lost (where it can tell), as one line on stdout and,
with ``PEGAFLOW_CHAOS_REPORT=FILE``, one JSON line appended to FILE
(``python -m tests.chaos.report FILE`` renders the table of docs/reliability.md).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import xxhash

PAGE = 64 << 10
NS = "chaos-model"
FULL = os.environ.get("PEGAFLOW_CHAOS", "fast") == "full"


def pick(fast: float, full: float) -> float:
    """A scenario's size: ``fast`` in ``make test``, ``full`` in ``make chaos``."""
    return full if FULL else fast


def block_hash(i: int) -> bytes:
    return xxhash.xxh3_128_digest(f"chaos:{i}".encode())


def page(h: bytes, size: int = PAGE) -> np.ndarray:
    """The one right content of ``h``'s page: its hash, repeated, with the page index mixed in."""
    seed = np.frombuffer(xxhash.xxh3_128_digest(h) * 4, dtype=np.uint64)
    reps = size // seed.nbytes
    arr = np.tile(seed, reps) ^ np.arange(reps * seed.size, dtype=np.uint64)
    return arr.view(np.uint8)


def store(client: Any, hashes: list[bytes]) -> int:
    """Save ``hashes`` with their right pages through a registered ``PegaClient``; blocks committed."""
    r = client.reserve(NS, hashes)
    for h, off in zip(hashes, r.offsets, strict=True):
        if off >= 0:
            client.pool[off:off + PAGE].numpy()[:] = page(h)
    return client.commit(r.reservation_id) if r.reservation_id else 0


def page_ok(h: bytes, got: np.ndarray | memoryview | bytes) -> bool:
    return bool(np.array_equal(np.frombuffer(got, dtype=np.uint8), page(h, len(got))))


def read_back(client: Any, hashes: list[bytes]) -> tuple[int, int]:
    """Read ``hashes`` (committed earlier, nothing since should have removed them) back
    through a registered ``PegaClient``: (blocks missing, blocks served with wrong bytes)."""
    q = client.query([NS], hashes)
    try:
        wrong = sum(not page_ok(h, q.pool[off:off + PAGE].numpy())
                    for h, off in zip(hashes, q.offsets.get(NS, []), strict=False))
        return len(hashes) - q.hit_blocks, wrong
    finally:
        if q.lease_id:
            client.release(q.lease_id)


@dataclass
class Figures:
    """What one scenario did, and whether that is a pass (:meth:`bad`).

    ``wrong`` must be 0 (bytes served that were not the block's), ``crashes`` 0 (daemons
    that died of the chaos rather than of a kill), ``tracebacks`` 0, ``leaked`` 0
    (reservations, leases or sessions left once every client is gone). ``lost`` counts
    blocks that were committed and acknowledged, that the scenario's fault should not have
    removed, and that could not be read back intact; it is ``None`` where the scenario
    cannot tell such a block from one it may legitimately lose (a pool kept full evicts),
    and is then neither reported as a number nor judged. ``failed`` counts operations
    that failed; they are bad unless ``expected_failures`` says the fault makes operations
    fail by design (misses after a kill, refused attackers, rejected garbage).
    """

    scenario: str
    tried: int = 0  # operations attempted (queries, saves, RPCs, inputs)
    failed: int = 0  # operations that failed (misses, errors answered)
    lost: int | None = None
    wrong: int = 0
    crashes: int = 0
    tracebacks: int = 0
    leaked: int = 0
    seconds: float = 0.0
    expected_failures: bool = False
    notes: dict[str, float | int | str] = field(default_factory=dict)

    def bad(self) -> bool:
        unexpected_failures = 0 if self.expected_failures else self.failed
        return bool(self.wrong or self.crashes or self.tracebacks or self.leaked or self.lost
                    or unexpected_failures)


class Report:
    def __init__(self, scenario: str, expected_failures: bool = False) -> None:
        self.fig = Figures(scenario, expected_failures=expected_failures)
        self._t0 = time.monotonic()

    def done(self) -> Figures:
        f = self.fig
        f.seconds = round(time.monotonic() - self._t0, 1)
        extra = " ".join(f"{k}={v}" for k, v in f.notes.items())
        lost = "—" if f.lost is None else f.lost
        print(f"CHAOS {f.scenario}: tried={f.tried} failed={f.failed} lost={lost} wrong={f.wrong} "
              f"crashes={f.crashes} tracebacks={f.tracebacks} leaked={f.leaked} seconds={f.seconds} {extra}",
              flush=True)
        out = os.environ.get("PEGAFLOW_CHAOS_REPORT")
        if out:
            with open(out, "a") as fh:
                fh.write(json.dumps({**asdict(f), "intensity": "full" if FULL else "fast"}) + "\n")
        return f


def tracebacks_in(text: str) -> int:
    return text.count("Traceback (most recent call last)")

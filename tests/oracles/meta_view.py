"""A dict reference of ``pegaflow.meta._metaview.View`` (pegaflow/native/metaview.c): the same
methods, answers and counts, written the plainest way (a dict per namespace, the walk slot by
slot), so the tests can hold the C table equal to it operation by operation."""

from __future__ import annotations

from collections.abc import Sequence

HASH_BYTES = 16
MAX_SLOTS = 64


def split(hashes: bytes | Sequence[bytes]) -> list[bytes]:
    if isinstance(hashes, bytes):
        assert len(hashes) % HASH_BYTES == 0
        return [hashes[i : i + HASH_BYTES] for i in range(0, len(hashes), HASH_BYTES)]
    return list(hashes)


class DictView:
    """ns -> {hash: (l1 mask, ssd mask)}; a block no slot holds has no key."""

    def __init__(self) -> None:
        self.ns: dict[int, dict[bytes, tuple[int, int]]] = {}

    def update(self, ns: int, slot: int, add: bool, ssd: bool, hashes: bytes | Sequence[bytes]) -> int:
        bit = 1 << slot
        d = self.ns.setdefault(ns, {})
        changed = 0
        for h in split(hashes):
            l1, s = d.get(h, (0, 0))
            if add:
                new = (l1 & ~bit, s | bit) if ssd else (l1 | bit, s & ~bit)
            else:
                new = (l1 & ~bit, s & ~bit)
            if new != (l1, s):
                changed += 1
            if new == (0, 0):
                d.pop(h, None)
            else:
                d[h] = new
        return changed

    def clear_slot(self, slot: int) -> int:
        bit = 1 << slot
        removed = 0
        for d in self.ns.values():
            for h, (l1, s) in list(d.items()):
                if (l1 | s) & bit:
                    removed += 1
                    if (l1 | s) & ~bit:
                        d[h] = (l1 & ~bit, s & ~bit)
                    else:
                        del d[h]
        return removed

    def walk(self, ns: int, hashes: bytes | Sequence[bytes], live_mask: int) -> list[tuple[int, int, int]]:
        """Per live slot holding block 0: (slot, leading blocks it holds, of them only on SSD)."""
        d = self.ns.get(ns, {})
        hs = split(hashes)
        if not hs:
            return []
        first = sum(d.get(hs[0], (0, 0)))  # the masks are disjoint
        out = []
        for slot in range(MAX_SLOTS):
            bit = 1 << slot
            if not live_mask & first & bit:
                continue
            n = ssd = 0
            for h in hs:
                l1, s = d.get(h, (0, 0))
                if not (l1 | s) & bit:
                    break
                n += 1
                ssd += bool(s & bit)
            if n:
                out.append((slot, n, ssd))
        return out

    def holders(self, ns: int, hash_: bytes) -> tuple[int, int]:
        return self.ns.get(ns, {}).get(hash_, (0, 0))

    def dump(self, ns: int) -> dict[bytes, tuple[int, int]]:
        return dict(self.ns.get(ns, {}))

    def __len__(self) -> int:
        return sum(len(d) for d in self.ns.values())

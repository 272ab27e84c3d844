"""The pure-Python ``Block`` and ``settle``: what ``pegaflow/native/blockindex.c`` implements.

``BlockIndex``'s own Python loop (``_reserve``) is the reference of ``place``: a test runs it
alone by replacing ``place`` with one that leaves every hash to it.
"""

from __future__ import annotations

from collections.abc import Sequence

from pegaflow.core.block_index import PENDING, RESIDENT, Namespace


class PyBlock:
    """One page of the pool holding one block (the C ``Block``'s attributes, key and repr)."""

    __slots__ = ("ns", "hash", "offset", "size", "state", "pins", "reclaimable")

    def __init__(self, ns: Namespace, hash_: bytes, offset: int, reclaimable: bool = False) -> None:
        self.ns = ns
        self.hash = hash_
        self.offset = offset
        self.size = ns.page_bytes
        self.state = PENDING
        self.pins = 0
        self.reclaimable = reclaimable

    @property
    def key(self) -> tuple[int, bytes]:
        return (self.ns.id, self.hash)

    def __repr__(self) -> str:
        return f"Block(ns={self.ns.name!r}, hash={self.hash.hex()[:12]}, offset={self.offset}, pins={self.pins})"


def settle(made: Sequence[PyBlock], order: dict) -> None:
    """``insert``'s commit of fresh blocks: each becomes RESIDENT at the newest end of ``order``."""
    for b in made:
        b.state = RESIDENT
        order[b] = None


def leave_everything_to_python(*args: object) -> tuple[int, bool]:
    """A ``place`` that places nothing: ``_reserve``'s Python loop then does every step."""
    return args[4], False  # type: ignore[return-value]


def reclass(blocks: dict, hashes: list[bytes], reclaimable: bool, source: object, target: object, moved: list,
            parked: list) -> None:
    """``BlockIndex.reclassify``'s loop (``_blockindex.reclass``): RESIDENT blocks of the other
    class change class; unpinned ones leave ``source`` for the newest end of ``target``, or go
    to ``parked`` when ``source`` does not hold them."""
    for h in hashes:
        b = blocks.get(h)
        if b is None or b.state != RESIDENT or b.reclaimable is reclaimable:
            continue
        b.reclaimable = reclaimable
        moved.append(b)
        if b.pins == 0:
            if b in source:  # type: ignore[operator]
                source.pop(b)  # type: ignore[attr-defined]
                target[b] = None  # type: ignore[index]
            else:
                parked.append(b)

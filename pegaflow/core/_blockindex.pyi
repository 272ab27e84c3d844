"""Types of ``pegaflow.core._blockindex``, built by the install from pegaflow/native/blockindex.c.

What each piece does is written in the C file and in ``pegaflow/core/block_index.py``.
"""

from collections.abc import Iterator
from typing import TypeVar, overload

from pegaflow.core.block_index import Admission, Namespace, PageAllocator

_T = TypeVar("_T")

class Block:
    """One page of the pool holding one block. Mutable, owned by BlockIndex."""

    ns: Namespace
    hash: bytes  # the 16-byte block hash
    offset: int  # page offset in the pool
    size: int  # page bytes (the namespace's)
    state: int  # PENDING (0) or RESIDENT (1)
    pins: int  # leases and transfers holding the page
    reclaimable: bool  # its replacement class: reclaimable (evicted first) or retained
    def __init__(self, ns: Namespace, hash_: bytes, offset: int, reclaimable: bool = False) -> None: ...
    @property
    def key(self) -> tuple[int, bytes]: ...  # (namespace id, hash)

class LRU:
    """An insertion-ordered set of blocks by identity with OrderedDict's methods; values are None."""

    def __len__(self) -> int: ...
    def __contains__(self, key: object) -> bool: ...
    def __getitem__(self, key: Block) -> None: ...
    def __setitem__(self, key: Block, value: None) -> None: ...
    def __delitem__(self, key: Block) -> None: ...
    def __iter__(self) -> Iterator[Block]: ...  # oldest first
    def move_to_end(self, key: Block, last: bool = True) -> None: ...
    def popitem(self, last: bool = True) -> tuple[Block, None]: ...
    @overload
    def pop(self, key: Block) -> None: ...
    @overload
    def pop(self, key: Block, default: _T) -> _T | None: ...

def place(
    blocks: dict[bytes, Block],
    lru: LRU,
    ns: Namespace,
    hashes: list[bytes],
    start: int,
    reclaimable: bool,
    made: list[Block],
    evicted: list[Block],
    out: list[Block | None] | None,
    alloc: PageAllocator,
    need: int,
    admission: Admission | None,
    rlru: LRU | None = None,  # the reclaimable order (victims first); None: empty
) -> tuple[int, bool]: ...  # (the index of the first hash left to the Python loop, refused)
def settle(made: list[Block], lru: LRU) -> None: ...
def reclass(
    blocks: dict[bytes, Block],
    hashes: list[bytes],
    reclaimable: bool,
    source: LRU,
    target: LRU,
    moved: list[Block],
    parked: list[Block],
) -> None: ...

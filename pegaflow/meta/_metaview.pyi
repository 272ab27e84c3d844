"""Types of ``pegaflow.meta._metaview``, built by the install from pegaflow/native/metaview.c.

What each piece does is written in the C file and in ``pegaflow/meta/view.py``.
"""

from collections.abc import Sequence

from typing_extensions import Buffer

HASH_BYTES: int
MAX_SLOTS: int
MAX_NAMESPACES: int

class View:
    """Per (namespace id, block hash): the node slots holding it in DRAM and only on SSD."""

    def __init__(self, seed: int = 0) -> None: ...
    # add (in DRAM, or only on SSD when ssd) or evict slot for each hash; returns pairs changed
    def update(self, ns: int, slot: int, add: bool, ssd: bool, hashes: Buffer | Sequence[bytes], /) -> int: ...
    def clear_slot(self, slot: int, /) -> int: ...  # pairs removed
    # clear_slot in steps visiting <= budget entries: (pairs removed, cursor; 0: done), from cursor 0
    def clear_slot_part(self, slot: int, cursor: int, budget: int, /) -> tuple[int, int]: ...
    # [(slot, prefix_len, ssd_blocks)] of the live slots holding block 0, by slot
    def walk(self, ns: int, hashes: Buffer | Sequence[bytes], live_mask: int, /) -> list[tuple[int, int, int]]: ...
    def holders(self, ns: int, hash_: Buffer | Sequence[bytes], /) -> tuple[int, int]: ...  # (l1, ssd) masks
    def dump(self, ns: int, /) -> dict[bytes, tuple[int, int]]: ...
    def index_slots(self, ns: int, /) -> int: ...
    @property
    def nbytes(self) -> int: ...
    def __len__(self) -> int: ...

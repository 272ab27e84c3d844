"""A bounded set of recently seen keys: "has this request been seen (lately)?"."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable


class RecentKeys:
    """The last ``capacity`` distinct keys, least recently seen dropped first."""

    __slots__ = ("capacity", "_keys")

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be > 0, got {capacity}")
        self.capacity = capacity
        self._keys: OrderedDict[Hashable, None] = OrderedDict()

    def seen(self, key: Hashable) -> bool:
        """Whether ``key`` was seen lately; either way it is now the most recently seen."""
        keys = self._keys
        if key in keys:
            keys.move_to_end(key)
            return True
        keys[key] = None
        if len(keys) > self.capacity:
            keys.popitem(last=False)
        return False

    def __contains__(self, key: Hashable) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

"""A least-recently-used cache bounded by the total size of its values in bytes."""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, Hashable, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

__all__ = ["ByteLRUCache"]


class ByteLRUCache(Generic[K, V]):
    """LRU cache whose entries' declared sizes sum to at most ``limit_bytes``.

    An entry larger than the whole budget is not stored (the caller still has its value).
    Not thread-safe by itself: the owner holds its own lock around calls.
    """

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = int(limit_bytes)
        self.nbytes = 0
        self.evictions = 0
        self._items: OrderedDict[K, tuple[V, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def get(self, key: K) -> V | None:
        """The value of ``key`` (now the most recently used), or None."""
        item = self._items.get(key)
        if item is None:
            return None
        self._items.move_to_end(key)
        return item[0]

    def put(self, key: K, value: V, nbytes: int) -> bool:
        """Insert or refresh ``key``; evicts the oldest entries to fit. Returns whether stored."""
        old = self._items.pop(key, None)
        if old is not None:
            self.nbytes -= old[1]
        if nbytes > self.limit_bytes:
            return False
        while self._items and self.nbytes + nbytes > self.limit_bytes:
            _, (_, size) = self._items.popitem(last=False)
            self.nbytes -= size
            self.evictions += 1
        self._items[key] = (value, nbytes)
        self.nbytes += nbytes
        return True

    def clear(self) -> None:
        """Drop every entry."""
        self._items.clear()
        self.nbytes = 0

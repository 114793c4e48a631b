"""A least-recently-used cache bounded by the bytes of what it holds, with its figures exported.

The servers on the trusted side hold parts of a library of tens of thousands of environments: the
runtime the records of the environments in play, a sandbox worker the sources its jails were sent.
What they hold must cost in proportion to what is used, never to what is stored, so every such
cache is one of these: bounded by a byte budget (each entry's cost is given when it is put), the
least recently used entry out first, and its size, hits, misses and evictions exported as
`codegym_cache_*{cache=NAME}` (the dashboard's "Caches" row).
"""

from __future__ import annotations

from collections import OrderedDict

from codegym.server.metrics import CACHE_BYTES, CACHE_CAPACITY, CACHE_ENTRIES, CACHE_EVENTS


class BoundedCache[K, V]:
    """`get` and `put` by key; `put` evicts the least recently used entries until the new one fits.

    An entry larger than the whole budget is not kept (the caller still has it). The byte count is
    the sum of the costs of the entries held, kept beside them (entries are immutable once put).
    """

    def __init__(self, name: str, max_bytes: int) -> None:
        self.name = name
        self.max_bytes = max_bytes
        self._items: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._bytes = 0
        self._hits = CACHE_EVENTS.labels(name, "hit")
        self._misses = CACHE_EVENTS.labels(name, "miss")
        self._evictions = CACHE_EVENTS.labels(name, "eviction")
        CACHE_CAPACITY.labels(name).set(max_bytes)
        # Read when scraped: the figures are of the cache, not kept in step with it by hand.
        CACHE_BYTES.labels(name).set_function(lambda: self._bytes)
        CACHE_ENTRIES.labels(name).set_function(lambda: len(self._items))

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    @property
    def bytes(self) -> int:
        return self._bytes

    def get(self, key: K) -> V | None:
        item = self._items.get(key)
        if item is None:
            self._misses.inc()
            return None
        self._items.move_to_end(key)
        self._hits.inc()
        return item[0]

    def put(self, key: K, value: V, cost: int) -> None:
        self.discard(key)
        if cost > self.max_bytes:
            return
        self._items[key] = (value, cost)
        self._bytes += cost
        while self._bytes > self.max_bytes:
            self.discard(next(iter(self._items)))
            self._evictions.inc()

    def discard(self, key: K) -> None:
        """Drop an entry (if held): the one way anything leaves, so the byte count follows."""
        item = self._items.pop(key, None)
        if item is not None:
            self._bytes -= item[1]

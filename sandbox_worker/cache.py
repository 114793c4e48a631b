"""Content-addressed source cache, bounded in bytes, least recently used out first.

Callers send a source once and then only its sha256: a verification matrix of 10 candidates x 30
tests or a session's hundred steps should not ship the same 20 KB a thousand times.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict


class SourceCache:
    def __init__(self, max_bytes: int = 64 * 1024 * 1024) -> None:
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, str] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, source: str) -> str:
        sha = hashlib.sha256(source.encode("utf-8")).hexdigest()
        if sha in self._items:
            self._items.move_to_end(sha)
            return sha
        size = len(source.encode("utf-8"))
        if size > self.max_bytes:
            return sha
        self._items[sha] = source
        self._bytes += size
        while self._bytes > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self._bytes -= len(old.encode("utf-8"))
        return sha

    def get(self, sha: str) -> str | None:
        source = self._items.get(sha)
        if source is not None:
            self._items.move_to_end(sha)
        return source

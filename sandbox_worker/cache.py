"""Content-addressed source cache, bounded in bytes, least recently used out first.

Callers send a source once and then only its sha256: a verification matrix of 10 candidates x 30
tests or a session's hundred steps should not ship the same 20 KB a thousand times. Its figures
are exported as `codegym_cache_*{cache="worker_sources"}` (codegym/bounded_cache.py).
"""

from __future__ import annotations

import hashlib
import sys

from codegym.bounded_cache import BoundedCache


class SourceCache:
    def __init__(self, max_bytes: int = 64 * 1024 * 1024) -> None:
        self.sources: BoundedCache[str, str] = BoundedCache("worker_sources", max_bytes)

    def __len__(self) -> int:
        return len(self.sources)

    def put(self, source: str) -> str:
        """Keep `source` (unless it is larger than the whole budget); return its sha256."""
        sha = hashlib.sha256(source.encode("utf-8")).hexdigest()
        if self.sources.get(sha) is None:
            self.sources.put(sha, source, sys.getsizeof(source))
        return sha

    def get(self, sha: str) -> str | None:
        return self.sources.get(sha)

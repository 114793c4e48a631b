"""The zygote's compiled sources: each compiled once per jail, kept marshalled by bytes, mirrored by
the worker.

A request names its source by sha256 and carries the text only when the worker does not know the
jail has compiled it (`sandbox_worker/jail.py` mirrors this cache). What the cache drops is told
to the worker with the next answer, so the worker sends that text again rather than have the
request fail.

The compiled code lives marshalled in a store of its own, an anonymous mapping the zygote's
children do not inherit (MADV_DONTFORK), and each child is sent the marshalled code of the one
source it runs (unmarshalling 8 KiB of code takes about 20 us; compiling its text, a millisecond).
Kept as code objects in the zygote's heap (about 2.4 times their marshalled size), a library's
sources grew the zygote, and every fork and every child's exit walks the page tables of all of it:
after 2,400 new sources through one jail the zygote had grown from 40 to 89 MiB and a create of a
known environment cost the jail 8.05 ms of CPU instead of 3.65 (`bench/create_cost_bench.py`). A
mapping a child does not inherit costs its fork nothing: 4.30 ms after the same 2,400.

The store is a ring: entries are written one after the other and, at its end, from its start
again, overwriting the oldest. A source used again when it is more than half a store old is
written again at the head, so what is in use stays (least recently used out first, nearly) for a
copy of its bytes. Byte-bounded (`JailSettings.code_cache_bytes`): the newest entry always stays,
however small the bound.
"""

import collections
import hashlib
import marshal
import mmap
from typing import NamedTuple

from .messages import CodeCacheEvent, CodeCacheReport, Request, Result

# The store is never smaller than this, so the newest source fits even when the cache is meant
# to keep nothing else (`--code-cache-mb 0`); a source marshalling to more is compiled for its
# request alone and not kept.
MIN_STORE_BYTES = 1 << 20


class Slot(NamedTuple):
    """Where a source's marshalled code lies in the store, and the store's age when it was written."""

    offset: int
    length: int
    written_at: int


class CodeCache:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.size = max(max_bytes, MIN_STORE_BYTES)
        # Pages are touched (and counted) only as entries are written into them.
        self.store = mmap.mmap(-1, self.size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.store.madvise(mmap.MADV_DONTFORK)
        # Oldest first. Entries from the store's previous lap lie at or after `head`, in the order
        # they were written; those of this lap before it.
        self.slots: collections.OrderedDict[str, Slot] = collections.OrderedDict()
        self.lengths: dict[str, int] = {}
        self.head = 0
        # Bytes the store has advanced by so far (the space a wrap skips included): entries' ages.
        self.written = 0
        # What left, and the hits, misses and evictions, since the last answer.
        self.forgotten: list[str] = []
        self.events: collections.Counter[CodeCacheEvent] = collections.Counter()

    @property
    def held_bytes(self) -> int:
        return sum(self.lengths.values())

    def check(self, req: Request) -> Result | bytes:
        """The marshalled code of the request's source, compiled into the cache if new to this jail;
        or, as a result, why the request cannot be served."""
        sha = str(req.get("sha") or "")
        slot = self.slots.get(sha)
        if slot is not None:
            self.events["hit"] += 1
            code = self.store[slot.offset : slot.offset + slot.length]
            if self.written - slot.written_at > self.size // 2:
                self._drop(sha)
                self._keep(sha, code)
            return code
        self.events["miss"] += 1
        source = req.get("source")
        if source is None:
            return {"status": "source_needed", "message": "source not cached in the jail"}
        if hashlib.sha256(source.encode()).hexdigest() != sha:
            return {
                "status": "bad_request",
                "message": "source does not match its sha256",
                "source_rejected": True,
            }
        try:
            code = marshal.dumps(compile(source, "<env>", "exec", dont_inherit=True))
        except (SyntaxError, ValueError) as exc:
            return {
                "status": "bad_request",
                "message": f"source does not compile: {exc}",
                "source_rejected": True,
            }
        except (MemoryError, RecursionError) as exc:
            return {
                "status": "bad_request",
                "message": f"source too complex to compile: {type(exc).__name__}",
                "source_rejected": True,
            }
        self._keep(sha, code)
        return code

    def _keep(self, sha: str, code: bytes) -> None:
        """Write `code` at the head, overwriting the oldest entries in its way, then make room by
        bytes (oldest out first, the newest always kept)."""
        length = len(code)
        if length > self.size:
            self._forget(sha)  # served once, never held: the worker sends its text again
            return
        if self.head + length > self.size:
            # The rest of the store stays empty this lap: what lies there is the oldest, and goes.
            while self.slots and self._oldest()[1].offset >= self.head:
                self._evict_oldest()
            self.written += self.size - self.head
            self.head = 0
        while self.slots and self.head <= self._oldest()[1].offset < self.head + length:
            self._evict_oldest()
        self.store[self.head : self.head + length] = code
        self.slots[sha] = Slot(self.head, length, self.written)
        self.lengths[sha] = length
        self.head += length
        self.written += length
        while self.held_bytes > self.max_bytes and len(self.slots) > 1:
            self._evict_oldest()

    def _oldest(self) -> tuple[str, Slot]:
        return next(iter(self.slots.items()))

    def _drop(self, sha: str) -> None:
        del self.slots[sha]
        del self.lengths[sha]

    def _evict_oldest(self) -> None:
        sha, _ = self._oldest()
        self._drop(sha)
        self._forget(sha)

    def _forget(self, sha: str) -> None:
        self.forgotten.append(sha)
        self.events["eviction"] += 1

    def report(self, result: Result) -> None:
        """Tell the worker what changed since the last answer (a resident step looks nothing up:
        its answer carries nothing here)."""
        if self.events:
            report: CodeCacheReport = {"entries": len(self.slots), "bytes": self.held_bytes}
            for event, count in self.events.items():
                report[event] = count
            result["code_cache"] = report
            self.events.clear()
        if self.forgotten:
            result["forgotten"] = self.forgotten
            self.forgotten = []

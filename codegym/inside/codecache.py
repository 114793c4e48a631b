"""The zygote's compiled sources: each compiled once per jail, kept by bytes, mirrored by the worker.

A request names its source by sha256 and carries the text only when the worker does not know the
jail has compiled it (`sandbox_worker/jail.py` mirrors this cache). The cache is bounded by the
compiled code's marshalled size, least recently used out first; what it drops is told to the
worker with the next answer, so the worker sends that text again rather than have the request
fail. Forked children inherit the cache; the spare, forked before a source was compiled, is sent
that source's code object instead of compiling the text a second time.
"""

import collections
import hashlib
import marshal
import types

from .messages import CodeCacheEvent, CodeCacheReport, Request, Result, without


class CodeCache:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        # Least recently used first, with what each costs (its marshalled size).
        self.codes: collections.OrderedDict[str, types.CodeType] = collections.OrderedDict()
        self.costs: dict[str, int] = {}
        # What left, and the hits, misses and evictions, since the last answer.
        self.forgotten: list[str] = []
        self.events: collections.Counter[CodeCacheEvent] = collections.Counter()
        # Sources compiled since the spare was forked: it did not inherit them, so it is sent them.
        self.compiled_after_spare: set[str] = set()

    def spare_forked(self) -> None:
        self.compiled_after_spare.clear()

    def touch(self, sha: str) -> None:
        """Mark a cached source as recently used, so LRU eviction matches the worker's bookkeeping."""
        if sha in self.codes:
            self.codes.move_to_end(sha)

    def keep(self, sha: str, code: types.CodeType) -> None:
        """Cache a compiled source, and make room by bytes (least recently used out first)."""
        self.codes[sha] = code
        self.costs[sha] = len(marshal.dumps(code))
        self.compiled_after_spare.add(sha)
        while sum(self.costs.values()) > self.max_bytes and len(self.codes) > 1:
            old, _ = self.codes.popitem(last=False)
            del self.costs[old]
            self.forgotten.append(old)
            self.events["eviction"] += 1

    def for_spare(self, req: Request) -> Request:
        """The request as the spare gets it: a source compiled after the spare was forked goes as
        its code object (marshalled here, loaded there before any of its code runs), so a source
        new to the jail costs one compile, not one here and one again in the child."""
        sha = str(req.get("sha") or "")
        if sha not in self.compiled_after_spare or sha not in self.codes:
            return req
        sent = without(req, "source")
        sent["code"] = marshal.dumps(self.codes[sha])
        return sent

    def check(self, req: Request) -> Result | None:
        """Compile a source new to this jail into the cache (once), or say why it cannot be served."""
        sha = req.get("sha", "")
        source = req.get("source")
        if sha in self.codes:
            self.events["hit"] += 1
            return None
        self.events["miss"] += 1
        if source is None:
            return {"status": "source_needed", "message": "source not cached in the jail"}
        if hashlib.sha256(source.encode()).hexdigest() != sha:
            return {
                "status": "bad_request",
                "message": "source does not match its sha256",
                "source_rejected": True,
            }
        try:
            code = compile(source, "<env>", "exec", dont_inherit=True)
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
        self.keep(sha, code)
        return None

    def report(self, result: Result) -> None:
        """Tell the worker what changed since the last answer (a resident step looks nothing up:
        its answer carries nothing here)."""
        if self.events:
            report: CodeCacheReport = {"entries": len(self.codes), "bytes": sum(self.costs.values())}
            for event, count in self.events.items():
                report[event] = count
            result["code_cache"] = report
            self.events.clear()
        if self.forgotten:
            result["forgotten"] = self.forgotten
            self.forgotten = []

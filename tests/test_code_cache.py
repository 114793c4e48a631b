"""The zygote's compiled-code cache (`codegym.inside.codecache`): a ring of marshalled code in a
mapping the zygote's children do not inherit.

What must hold: every answer is the code of the source asked for, however the ring wraps, evicts
and rewrites; what it drops is said, so a worker mirroring it (as `sandbox_worker/jail.py` does)
never believes a source held that is not; it stays within its bytes, the newest always kept; and a
forked child's memory does not carry the store (the reason it is a mapping of its own: a zygote
holding a library's code grew every fork and exit). Through a real jail, the serving tests
(`test_library_serving.py`) run with it.
"""

from __future__ import annotations

import hashlib
import json
import marshal
import random
import subprocess
import sys

from codegym.inside.codecache import MIN_STORE_BYTES, CodeCache
from codegym.inside.messages import Limits, Request, Result

LIMITS: Limits = {"wall_ms": 5000, "cpu_ms": 5000, "memory_mb": 256, "output_bytes": 65536}


def source_of(n: int, lines: int) -> str:
    body = "\n".join(f"def f{i}(x):\n    return x + {n * 1000 + i}" for i in range(lines))
    return f"# source {n}\n{body}\nANSWER = {n}\n"


def request(source: str, with_text: bool) -> Request:
    req: Request = {"op": "create", "limits": LIMITS, "sha": hashlib.sha256(source.encode()).hexdigest()}
    if with_text:
        req["source"] = source
    return req


def answer_of(code: bytes) -> int:
    namespace: dict[str, object] = {}
    exec(marshal.loads(code), namespace)
    answer = namespace["ANSWER"]
    assert isinstance(answer, int)
    return answer


def test_every_answer_is_the_code_asked_for_through_wraps_evictions_and_rewrites() -> None:
    """A worker's mirror of the cache, driven like `Jail.execute` (by sha256 alone when it believes
    the jail holds the source, with the text otherwise, forgetting what the jail says it dropped),
    over sources of mixed sizes chosen with a skew (some come back often): no answer is ever
    another source's code, the mirror never believes a dropped source held, and the held bytes stay
    within the bound."""
    rng = random.Random(7)
    max_bytes = MIN_STORE_BYTES  # a store this size wraps many times over these sources
    cache = CodeCache(max_bytes)
    sources = [source_of(n, rng.choice([5, 40, 150, 400])) for n in range(400)]
    known: set[str] = set()
    hits = needed = 0
    for _ in range(3000):
        n = min(int(rng.expovariate(1 / 60)), len(sources) - 1)
        source = sources[n]
        sha = hashlib.sha256(source.encode()).hexdigest()
        answer = cache.check(request(source, with_text=sha not in known))
        if isinstance(answer, dict):
            assert answer["status"] == "source_needed"
            needed += 1
            known.discard(sha)
            answer = cache.check(request(source, with_text=True))
        assert isinstance(answer, bytes)
        assert answer_of(answer) == n
        hits += sha in known
        known.add(sha)
        report: Result = {}
        cache.report(report)
        known.difference_update(report.get("forgotten", []))
        assert known == set(cache.slots)
        assert cache.held_bytes <= max_bytes
    # Both paths were taken many times: answered from the store, and sent the text again.
    assert hits > 1000 and needed == 0 and len(known) > 20
    assert cache.written > 3 * cache.size  # the ring went round more than three times


def test_a_source_used_again_stays_while_the_ring_turns() -> None:
    """A source asked for between every few new ones is rewritten at the head before the ring
    reaches it: it is never dropped, while sources used once are."""
    cache = CodeCache(MIN_STORE_BYTES)
    hot = source_of(0, 50)
    dropped: list[str] = []
    for n in range(1, 3000):
        for source in (source_of(n, 50), hot):
            answer = cache.check(request(source, with_text=True))
            assert isinstance(answer, bytes)
        report: Result = {}
        cache.report(report)
        dropped += report.get("forgotten", [])
    hot_sha = hashlib.sha256(hot.encode()).hexdigest()
    assert len(dropped) > 1000 and hot_sha not in dropped
    assert isinstance(cache.check(request(hot, with_text=False)), bytes)


def test_the_newest_source_is_kept_however_small_the_bound_and_one_too_big_is_served_once() -> None:
    cache = CodeCache(0)
    first, second = source_of(1, 20), source_of(2, 20)
    for source in (first, second):
        assert isinstance(cache.check(request(source, with_text=True)), bytes)
    assert list(cache.slots) == [hashlib.sha256(second.encode()).hexdigest()]
    assert cache.check(request(first, with_text=False)) == {
        "status": "source_needed",
        "message": "source not cached in the jail",
    }
    huge = source_of(3, 30_000)  # marshals to more than the whole store
    code = cache.check(request(huge, with_text=True))
    assert isinstance(code, bytes) and len(code) > MIN_STORE_BYTES and answer_of(code) == 3
    report: Result = {}
    cache.report(report)
    assert hashlib.sha256(huge.encode()).hexdigest() in report["forgotten"]


def test_bad_sources_are_refused_and_not_kept() -> None:
    cache = CodeCache(1 << 20)
    good = source_of(1, 3)
    lying: Request = {"op": "create", "limits": LIMITS, "sha": "0" * 64, "source": good}
    broken = "def f(:\n"
    for req, message in ((lying, "does not match"), (request(broken, with_text=True), "does not compile")):
        answer = cache.check(req)
        assert isinstance(answer, dict) and answer["status"] == "bad_request"
        assert message in answer["message"] and answer["source_rejected"]
    assert not cache.slots


# Fill a cache with about 16 MiB of marshalled code, then fork: report the parent's and the child's
# resident memory, in a fresh interpreter (never fork pytest's).
FORKED_SIZE = """
import hashlib, json, os
from codegym.inside.codecache import CodeCache
def rss_kb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
cache = CodeCache(32 << 20)
n = 0
while cache.held_bytes < 16 << 20:
    source = "\\n".join(f"def f{i}(x):\\n    return x + {n * 1000 + i}" for i in range(300))
    sha = hashlib.sha256(source.encode()).hexdigest()
    assert isinstance(cache.check({"op": "create", "sha": sha, "source": source}), bytes)
    n += 1
read, write = os.pipe()
pid = os.fork()
if pid == 0:
    os.write(write, str(rss_kb()).encode())
    os._exit(0)
os.waitpid(pid, 0)
print(json.dumps({"parent_kb": rss_kb(), "child_kb": int(os.read(read, 64)), "held_kb": cache.held_bytes >> 10}))
"""


def test_a_forked_child_does_not_carry_the_store() -> None:
    out = subprocess.run(
        [sys.executable, "-c", FORKED_SIZE], capture_output=True, text=True, timeout=120, check=True
    )
    sizes = json.loads(out.stdout)
    # The parent holds the store's 16 MiB; the child, forked from it, does not have it mapped.
    assert sizes["parent_kb"] - sizes["child_kb"] > 0.9 * sizes["held_kb"], sizes

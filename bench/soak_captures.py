"""The soak's watch on captured episodes (bench/soak.py): the capture store must stay within its
byte bound (`--capture-bytes`) through every fault, and its count of the bytes it holds must stay
true.

The soak's runtimes keep captures in Redis (services/runtime/redis_captures.py): a hash per capture
(its summary and body), a sorted set of them in the order kept, a counter of the bytes held (what
the bound is checked against) and one of the captures ever kept. Every few seconds the watch reads
the store in one Lua script (atomic, so it never sees half of a put or an eviction): the counter,
and the bytes of the captures recounted from their hashes as `captures.Capture.size` counts them
(body + summary + id + 64). Both must be within the bound at every reading. At the end, once
every episode has ended, the counter must equal the recount, and no capture hash may be left out
of the order set (a leak the counter would not see). A reading while Redis is down (the redis
fault) is counted as unreadable, not failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench.common import Figures

PREFIX = "codegym:"  # RedisCaptureStore's default, which `codegym serve runtime` uses
READ_EVERY_S = 5.0
OVERHEAD = 64  # captures.Capture.size: what a capture costs beyond its body, summary and id

# The store as it stands: bytes held (the counter), captures kept ever (the sequence), captures held,
# their bytes recounted from their hashes, the largest one. KEYS: counter, sequence, order set.
READ = """
local held = tonumber(redis.call('GET', KEYS[1]) or 0)
local kept = tonumber(redis.call('GET', KEYS[2]) or 0)
local ids = redis.call('ZRANGE', KEYS[3], 0, -1)
local counted, largest = 0, 0
for _, id in ipairs(ids) do
  local key = ARGV[1] .. 'capture:' .. id
  local size = redis.call('HSTRLEN', key, 'body') + redis.call('HSTRLEN', key, 'summary') + #id + tonumber(ARGV[2])
  counted = counted + size
  if size > largest then largest = size end
end
return {held, kept, #ids, counted, largest}
"""


@dataclass
class CaptureWatch:
    """The readings of one soak: `readings` (each a dict of figures), `unreadable` (Redis down)."""

    bound: int
    readings: list[Figures] = field(default_factory=list)
    unreadable: int = 0
    final: Figures = field(default_factory=dict)

    def broken(self) -> list[str]:
        """What the soak must hold of the captures."""
        out = []
        over = [r for r in self.readings if max(r["held"], r["counted"]) > self.bound]
        if over:
            worst = max(over, key=lambda r: max(r["held"], r["counted"]))
            out.append(
                f"captures over their bound {self.bound:,} bytes in {len(over)} readings "
                f"(at {worst['at']}: held {worst['held']:,}, recounted {worst['counted']:,})"
            )
        f = self.final
        if not f:
            out.append("the capture store could not be read at the end")
            return out
        if f["held"] != f["counted"]:
            out.append(f"the store counts {f['held']:,} bytes held, its captures hold {f['counted']:,}")
        if f["hashes"] != f["captures"]:
            out.append(f"{f['hashes'] - f['captures']} capture hashes outside the store's order (leaked)")
        if f["held"] > self.bound:
            out.append(f"captures hold {f['held']:,} bytes at the end, over the bound {self.bound:,}")
        return out


async def read(url: str) -> Figures:
    """One reading of the store (raises when Redis cannot be reached)."""
    from redis.asyncio import Redis

    redis = Redis.from_url(url, socket_connect_timeout=2, socket_timeout=10)
    try:
        keys = [f"{PREFIX}captures-bytes", f"{PREFIX}captures-seq", f"{PREFIX}captures"]
        found: Any = await redis.eval(READ, len(keys), *keys, PREFIX, OVERHEAD)
    finally:
        await redis.aclose()
    held, kept, captures, counted, largest = (int(x) for x in found)
    return {
        "at": time.strftime("%H:%M:%S"),
        "held": held,
        "counted": counted,
        "captures": captures,
        "kept": kept,
        "evicted": kept - captures,
        "largest": largest,
    }


async def hashes(url: str) -> int:
    """Capture hashes in Redis (SCAN: read once the store is quiet)."""
    from redis.asyncio import Redis

    redis = Redis.from_url(url, socket_connect_timeout=2, socket_timeout=10)
    try:
        return len([key async for key in redis.scan_iter(match=f"{PREFIX}capture:*", count=1000)])
    finally:
        await redis.aclose()


async def watch(url_of: Callable[[], str], found: CaptureWatch, done: asyncio.Event) -> None:
    """Read the store every READ_EVERY_S until `done` is set (every path has ended: the episodes
    still in flight when the soak stops starting them are captured too)."""
    while not done.is_set():
        try:
            found.readings.append(await read(url_of()))
        except Exception:  # Redis restarting (the redis fault), or not answering for a moment
            found.unreadable += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), READ_EVERY_S)


async def final_reading(url_of: Callable[[], str], found: CaptureWatch, timeout_s: float = 60.0) -> None:
    """The reading at the end, with the hashes counted; waits for a Redis the last fault restarted."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            reading = await read(url_of())
            found.final = {**reading, "hashes": await hashes(url_of())}
            found.readings.append(reading)
            return
        except Exception:
            if time.monotonic() > deadline:
                return
            await asyncio.sleep(1.0)


def print_watch(found: CaptureWatch) -> None:
    """The readings over time, thinned to at most 20 rows (the largest held always among them)."""
    rows = found.readings
    if len(rows) > 20:
        step = len(rows) / 19
        chosen = {int(i * step) for i in range(19)} | {len(rows) - 1}
        chosen.add(max(range(len(rows)), key=lambda i: rows[i]["held"]))
        rows = [rows[i] for i in sorted(chosen)]
    print(
        f"captured episodes in Redis (bound --capture-bytes {found.bound:,} bytes; {len(found.readings)} "
        f"readings, {found.unreadable} while Redis was down):"
    )
    print(
        f"  {'at':<8} {'held KiB':>9} {'recount KiB':>11} {'of bound':>8} {'captures':>8} {'kept':>7} {'evicted':>7}"
    )
    for r in rows:
        print(
            f"  {r['at']:<8} {r['held'] / 1024:>9.1f} {r['counted'] / 1024:>11.1f} "
            f"{100 * max(r['held'], r['counted']) / found.bound:>7.1f}% {r['captures']:>8} {r['kept']:>7} "
            f"{r['evicted']:>7}"
        )
    if found.readings:
        peak = max(max(r["held"], r["counted"]) for r in found.readings)
        evicted = found.readings[-1]["evicted"]
        note = (
            ""
            if evicted
            else "; nothing evicted yet: the bound was not reached (a longer soak or a smaller bound)"
        )
        print(f"  peak {peak:,} bytes = {100 * peak / found.bound:.1f} % of the bound{note}")

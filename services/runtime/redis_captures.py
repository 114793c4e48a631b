"""Captured episodes in Redis, beside the sessions and the record, so every replica keeps and reads
one set of them and they survive a restart of every runtime.

A capture is a hash (`{prefix}capture:{id}`: its summary, its body, its size and the tags its
indexes are named by); sorted sets scored by the order captures were kept (`{prefix}captures`, and
one per tenant, run and environment, and the flagged and error-ended ones) find a filtered page
from its most selective index. Keeping one and evicting past the byte bound (the oldest first,
from every index) is one Lua script, so replicas never count each other's bytes twice.
"""

from __future__ import annotations

import logging
from typing import Any

import redis.asyncio as aioredis

from codegym_client.api.runtime.v1 import runtime_service_pb2 as rt
from services.runtime.captures import Capture, Filters

log = logging.getLogger(__name__)

# KEYS: 1 the sequence counter, 2 the all-captures set, 3 the byte total, 4 the capture's hash,
# 5.. its index sets. ARGV: 1 episode id, 2 summary, 3 body, 4 size, 5 bound, 6 key prefix,
# 7 the index names of the capture joined by '\n' (stored, so an eviction finds them).
PUT = """
if redis.call('EXISTS', KEYS[4]) == 1 then return 0 end
local seq = redis.call('INCR', KEYS[1])
redis.call('HSET', KEYS[4], 'summary', ARGV[2], 'body', ARGV[3], 'size', ARGV[4], 'indexes', ARGV[7])
redis.call('ZADD', KEYS[2], seq, ARGV[1])
for i = 5, #KEYS do redis.call('ZADD', KEYS[i], seq, ARGV[1]) end
local total = redis.call('INCRBY', KEYS[3], ARGV[4])
while total > tonumber(ARGV[5]) do
  local oldest = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
  if not oldest then break end
  local key = ARGV[6] .. 'capture:' .. oldest
  local held = redis.call('HMGET', key, 'size', 'indexes')
  redis.call('ZREM', KEYS[2], oldest)
  if held[2] then
    for index in string.gmatch(held[2], '[^\\n]+') do redis.call('ZREM', index, oldest) end
  end
  redis.call('DEL', key)
  total = redis.call('DECRBY', KEYS[3], tonumber(held[1] or 0))
end
return seq
"""
# Summaries read per round trip while a page fills, and the rounds one call makes at most (a page
# of a rare filter then comes back short, with a token to continue).
SCAN_CHUNK = 256
SCAN_ROUNDS = 16


class RedisCaptureStore:
    """A `CaptureStore` on Redis. Create inside the loop."""

    def __init__(self, url: str, bound_bytes: int, *, prefix: str = "codegym:") -> None:
        self.redis = aioredis.from_url(url, socket_connect_timeout=2, socket_timeout=10)
        self.bound = bound_bytes
        self.prefix = prefix
        self.order = f"{prefix}captures"
        self._put = self.redis.register_script(PUT)

    def key(self, episode_id: str) -> str:
        return f"{self.prefix}capture:{episode_id}"

    def index(self, kind: str, value: str = "") -> str:
        return f"{self.prefix}captures:{kind}:{value}"

    def indexes(self, summary: rt.EpisodeSummary) -> list[str]:
        names = [
            self.index("tenant", summary.tenant),
            self.index("run", summary.run_id),
            self.index("env", summary.env_id),
        ]
        if summary.flagged:
            names.append(self.index("flagged"))
        if summary.end_reason == "error":
            names.append(self.index("error"))
        return names

    async def put(self, capture: Capture) -> None:
        s = capture.summary
        if capture.size > self.bound:
            log.warning(
                "capture of %s (%d bytes) exceeds --capture-bytes; not kept", s.episode_id, capture.size
            )
            return
        indexes = self.indexes(s)
        await self._put(
            keys=[
                f"{self.prefix}captures-seq",
                self.order,
                f"{self.prefix}captures-bytes",
                self.key(s.episode_id),
                *indexes,
            ],
            args=[
                s.episode_id,
                s.SerializeToString(),
                capture.body,
                capture.size,
                self.bound,
                self.prefix,
                "\n".join(indexes),
            ],
        )

    def _driver(self, f: Filters) -> str:
        """The smallest index every match is in."""
        if f.flagged_only:
            return self.index("flagged")
        if f.errors_only:
            return self.index("error")
        if f.env_id:
            return self.index("env", f.env_id)
        if f.run_id:
            return self.index("run", f.run_id)
        if f.tenant is not None:
            return self.index("tenant", f.tenant)
        return self.order

    async def page(
        self, filters: Filters, size: int, before: int | None
    ) -> tuple[list[rt.EpisodeSummary], int | None]:
        driver = self._driver(filters)
        found: list[rt.EpisodeSummary] = []
        high: Any = f"({before}" if before is not None else "+inf"
        for _ in range(SCAN_ROUNDS):
            members: list[Any] = await self.redis.zrevrangebyscore(
                driver, high, "-inf", start=0, num=SCAN_CHUNK, withscores=True
            )
            if not members:
                return found, None
            async with self.redis.pipeline(transaction=False) as pipe:
                for member, _ in members:
                    pipe.hget(self.key(member.decode()), "summary")
                raws = await pipe.execute()
            for (_, score), raw in zip(members, raws, strict=True):
                if raw is None:
                    continue  # evicted between the two reads
                summary = rt.EpisodeSummary.FromString(raw)
                if filters.match(summary):
                    found.append(summary)
                    if len(found) == size:
                        last = int(score)
                        more = await self.redis.zcount(driver, "-inf", f"({last}")
                        return found, last if more else None
            last = int(members[-1][1])
            high = f"({last}"
            if len(members) < SCAN_CHUNK:
                return found, None
        return found, last

    async def get(self, episode_id: str) -> rt.GetEpisodeResponse | None:
        raw: Any = await self.redis.hget(self.key(episode_id), "body")
        return None if raw is None else rt.GetEpisodeResponse.FromString(bytes(raw))

    async def held_bytes(self) -> int:
        return int(await self.redis.get(f"{self.prefix}captures-bytes") or 0)

    async def close(self) -> None:
        await self.redis.aclose()

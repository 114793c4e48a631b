"""Where the episode record is kept: a SQLite file beside the library, or Redis beside the sessions.

Both hold (scope, key) → a JSON body merged by `episode_record.merge`'s rules, and the runs with
when each was last seen. SQLite serves one runtime (the default `codegym up`); Redis serves every
replica of a shared deployment, where the sessions already are, with the merge done by a Lua
script so replicas never lose each other's counts. Either survives a restart of every server
(Redis as durable as its own persistence: the k8s manifest's append-only file).
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from services.runtime.episode_record import LIST_KEEP, MAX_RUNS, WINDOWS, merge, task_scope

SCHEMA = """
CREATE TABLE IF NOT EXISTS tallies (
    scope TEXT NOT NULL,
    key   TEXT NOT NULL,
    body  TEXT NOT NULL,
    PRIMARY KEY (scope, key)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS runs (
    run       TEXT PRIMARY KEY,
    last_seen REAL NOT NULL
);
"""


def record_path_for(library: str | Path) -> Path:
    """The record's file beside a library: `library.sqlite` → `library.record.sqlite`."""
    path = Path(library)
    return path.with_name(f"{path.stem}.record.sqlite")


class SqliteRecordStore:
    """The record in a SQLite file. Writes run in a thread, one at a time (a lock), so the event
    loop never waits on the disk."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(SCHEMA)
        self.lock = asyncio.Lock()

    async def apply(self, deltas: dict[tuple[str, str], dict[str, Any]], runs: dict[str, float]) -> None:
        async with self.lock:
            await asyncio.to_thread(self._apply, deltas, runs)

    def _apply(self, deltas: dict[tuple[str, str], dict[str, Any]], runs: dict[str, float]) -> None:
        db = self.db
        by_scope: dict[str, list[str]] = {}
        for scope, key in deltas:
            by_scope.setdefault(scope, []).append(key)
        db.execute("BEGIN IMMEDIATE")
        try:
            # One read per scope and 500 keys, one write for all: a flush at 256 steps/s touches
            # hundreds of keys, and two statements each were most of what recording cost.
            held: dict[tuple[str, str], str] = {}
            for scope, keys in by_scope.items():
                for start in range(0, len(keys), 500):
                    part = keys[start : start + 500]
                    marks = ",".join("?" * len(part))
                    rows = db.execute(
                        f"SELECT key, body FROM tallies WHERE scope = ? AND key IN ({marks})", (scope, *part)
                    )
                    held.update(((scope, key), body) for key, body in rows)
            merged = []
            for (scope, key), delta in deltas.items():
                body = merge(json.loads(held[(scope, key)]) if (scope, key) in held else {}, delta)
                merged.append((scope, key, json.dumps(body, ensure_ascii=False, separators=(",", ":"))))
            db.executemany("INSERT OR REPLACE INTO tallies (scope, key, body) VALUES (?, ?, ?)", merged)
            for run, seen in runs.items():
                db.execute("INSERT OR REPLACE INTO runs (run, last_seen) VALUES (?, ?)", (run, seen))
            for (run,) in db.execute(
                "SELECT run FROM runs WHERE run != '*' ORDER BY last_seen DESC LIMIT -1 OFFSET ?", (MAX_RUNS,)
            ).fetchall():
                db.execute("DELETE FROM tallies WHERE scope = ?", (task_scope(run),))
                db.execute("DELETE FROM runs WHERE run = ?", (run,))
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    async def read(self, scope: str) -> dict[str, dict[str, Any]]:
        async with self.lock:
            rows = await asyncio.to_thread(
                lambda: self.db.execute("SELECT key, body FROM tallies WHERE scope = ?", (scope,)).fetchall()
            )
        return {key: json.loads(body) for key, body in rows}

    async def read_one(self, scope: str, key: str) -> dict[str, Any] | None:
        async with self.lock:
            row = await asyncio.to_thread(
                lambda: self.db.execute(
                    "SELECT body FROM tallies WHERE scope = ? AND key = ?", (scope, key)
                ).fetchone()
            )
        return None if row is None else dict(json.loads(row[0]))

    async def close(self) -> None:
        async with self.lock:
            self.db.close()


# KEYS: the scopes' hashes, one per delta; ARGV: pairs of (field, delta JSON), then the window
# sizes and list length as JSON. The rules are `episode_record.merge`'s, in Lua.
MERGE = """
local sizes = cjson.decode(ARGV[#ARGV])
for i = 1, #KEYS do
  local field = ARGV[2 * i - 1]
  local delta = cjson.decode(ARGV[2 * i])
  local raw = redis.call('HGET', KEYS[i], field)
  local body = {}
  if raw then body = cjson.decode(raw) end
  if delta['reset'] then
    for _, name in ipairs(delta['reset']) do body[name] = nil end
  end
  for name, value in pairs(delta) do
    if name == 'reset' then
    elseif name == 'version' then
      body[name] = math.max(tonumber(body[name] or 0), tonumber(value))
    elseif type(value) == 'number' then
      body[name] = (tonumber(body[name]) or 0) + value
    elseif type(value) == 'string' then
      local keep = sizes['windows'][name] or 256
      local joined = (body[name] or '') .. value
      body[name] = string.sub(joined, math.max(1, #joined - keep + 1))
    elseif type(value) == 'table' then
      local items = body[name] or {}
      for _, item in ipairs(value) do table.insert(items, item) end
      while #items > sizes['list'] do table.remove(items, 1) end
      body[name] = items
    else
      body[name] = value
    end
  end
  redis.call('HSET', KEYS[i], field, cjson.encode(body))
end
return #KEYS
"""


class RedisRecordStore:
    """The record in Redis: a hash per scope (`{prefix}record:{scope}`), runs in a sorted set."""

    def __init__(self, url: str, *, prefix: str = "codegym:") -> None:
        self.redis = aioredis.from_url(url, socket_connect_timeout=2, socket_timeout=10)
        self.prefix = prefix
        self.runs_key = f"{prefix}record-runs"
        self._merge = self.redis.register_script(MERGE)
        self.sizes = json.dumps({"windows": WINDOWS, "list": LIST_KEEP})

    def hash(self, scope: str) -> str:
        return f"{self.prefix}record:{scope}"

    async def apply(self, deltas: dict[tuple[str, str], dict[str, Any]], runs: dict[str, float]) -> None:
        items = list(deltas.items())
        for start in range(0, len(items), 500):
            part = items[start : start + 500]
            keys = [self.hash(scope) for (scope, _), _ in part]
            args: list[str] = []
            for (_, key), delta in part:
                args += [key, json.dumps(delta, ensure_ascii=False)]
            await self._merge(keys=keys, args=[*args, self.sizes])
        if runs:
            await self.redis.zadd(self.runs_key, {run: seen for run, seen in runs.items()})
            for raw in await self.redis.zrevrange(self.runs_key, MAX_RUNS, -1):
                run = raw.decode() if isinstance(raw, bytes) else str(raw)
                if run != "*":
                    await self.redis.delete(self.hash(task_scope(run)))
                    await self.redis.zrem(self.runs_key, run)

    async def read(self, scope: str) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        async for field, raw in self.redis.hscan_iter(self.hash(scope), count=2000):
            out[field.decode()] = json.loads(raw)
        return out

    async def read_one(self, scope: str, key: str) -> dict[str, Any] | None:
        raw = await self.redis.hget(self.hash(scope), key)
        return None if raw is None else dict(json.loads(raw))

    async def close(self) -> None:
        await self.redis.aclose()

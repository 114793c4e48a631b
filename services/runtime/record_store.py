"""Where the episode record is kept: a SQLite file beside the library, or Redis beside the sessions.

Both hold (scope, key) → a JSON body merged by its tally's declaration (`tallies.py`), the runs
with when each was last seen, and what lets a reader pay for what it asks rather than for what is
stored, kept up to date as each body changes:
- per task scope, each played task's pool score and recent rate (an indexed table; sorted sets),
  so "the tasks every run fails" or "how many tasks are mastered" is a range, not a walk;
- per task scope, the count of tasks in each class (`tallies.CLASS_RANGES`): what the gauges and
  the history read;
- the quarantined environments, and the environments with a failed step by their share of them
  (what Health lists first: the worst few are a range, not a walk);
- per run, its history: the pools of its played tasks at each policy version it reached (the
  last flush at that version), and its counts per version (`tallies.account`: its (task, version)
  groups, zero-variance ones among them, and its tasks that moved pools), changed by each merge of
  a task's body (in the same transaction, or the same Lua call); at most `HISTORY_KEEP` versions
  (the oldest go first, their counts with them).

SQLite serves one runtime (the default `codegym up`); Redis serves every replica of a shared
deployment, where the sessions already are, with the merge done by a Lua script generated from the
tallies' declaration so replicas never lose each other's counts. Either survives a restart of every
server (Redis as durable as its own persistence: the k8s manifest's append-only file).
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any, cast

import redis.asyncio as aioredis

from services.runtime.episode_record import ALL_RUNS, ENV_SCOPE, MAX_RUNS, run_of, schema_of, task_scope
from services.runtime.tallies import (
    CLASS_RANGES,
    HISTORY_KEEP,
    LUA_MERGE,
    HistoryPoint,
    TaskTally,
    account,
    classes,
    encode,
    error_score,
    merge,
    pool_counts,
    pool_score,
    quarantined,
    recent_score,
)

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
CREATE TABLE IF NOT EXISTS task_index (
    scope  TEXT NOT NULL,
    key    TEXT NOT NULL,
    pool   REAL,
    recent REAL,
    PRIMARY KEY (scope, key)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS task_index_pool ON task_index (scope, pool);
CREATE TABLE IF NOT EXISTS class_counts (
    scope TEXT NOT NULL,
    class TEXT NOT NULL,
    n     INTEGER NOT NULL,
    PRIMARY KEY (scope, class)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS quarantined (env_id TEXT PRIMARY KEY) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS env_errors (env_id TEXT PRIMARY KEY, rate REAL NOT NULL) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS env_errors_rate ON env_errors (rate);
CREATE TABLE IF NOT EXISTS history (
    run       TEXT NOT NULL,
    version   INTEGER NOT NULL,
    at        REAL NOT NULL,
    played    INTEGER NOT NULL,
    learnable INTEGER NOT NULL,
    mastered  INTEGER NOT NULL,
    unsolved  INTEGER NOT NULL,
    PRIMARY KEY (run, version)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS version_counts (
    run     TEXT NOT NULL,
    version INTEGER NOT NULL,
    name    TEXT NOT NULL,
    n       INTEGER NOT NULL,
    PRIMARY KEY (run, version, name)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS record_meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
"""

# Redis: a run's history points by version, written per flush: the flush's latest version's point
# replaced, the point of each other version it holds added when there is none, then the history
# kept to its last versions and the counts of versions it no longer keeps dropped. KEYS: the
# history (sorted set), the counts (hash). ARGV: the bound, then per version (version, point JSON,
# '1' to replace).
LUA_HISTORY = """
for i = 2, #ARGV, 3 do
  local version = ARGV[i]
  if ARGV[i + 2] == '1' or redis.call('ZCOUNT', KEYS[1], version, version) == 0 then
    redis.call('ZREMRANGEBYSCORE', KEYS[1], version, version)
    redis.call('ZADD', KEYS[1], version, ARGV[i + 1])
  end
end
if redis.call('ZREMRANGEBYRANK', KEYS[1], 0, -tonumber(ARGV[1]) - 1) > 0 then
  local oldest = tonumber(redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')[2])
  for _, version in ipairs(redis.call('HKEYS', KEYS[2])) do
    if tonumber(version) < oldest then redis.call('HDEL', KEYS[2], version) end
  end
end
return 0
"""


# What the indexes beside the bodies hold, by version: a record indexed by an earlier version is
# indexed again when first opened (2: the environments' errors index).
INDEXES = "2"


def history_point(version: int, counts: dict[str, int]) -> HistoryPoint:
    pools = pool_counts(counts)
    return HistoryPoint(
        version, time.time(), sum(pools.values()), pools["learnable"], pools["mastered"], pools["unsolved"]
    )


def versions_of(deltas: dict[tuple[str, str], dict[str, Any]]) -> dict[str, list[int]]:
    """The policy versions each task scope's deltas hold (a task's latest, and its groups'), the
    last `HISTORY_KEEP` of them, oldest first (scopes with none left out): the flush writes a
    history point for each (its latest replaced, the others added when missing)."""
    found: dict[str, set[int]] = {}
    for (scope, _), delta in deltas.items():
        if run_of(scope) is None:
            continue
        versions = {int(g[0]) for g in delta.get("groups", ())}
        if "version" in delta:
            versions.add(int(delta["version"]))
        if versions:
            found.setdefault(scope, set()).update(versions)
    return {scope: sorted(versions)[-HISTORY_KEEP:] for scope, versions in found.items()}


def attach(points: list[HistoryPoint], counts: dict[int, dict[str, int]]) -> list[HistoryPoint]:
    """The points with their versions' counts (a version's counts without a point are not shown:
    only while a flush is between its two writes, or for a version past the history's bound)."""
    return [point.counted(counts.get(point.version, {})) for point in points]


def successor(prefix: str) -> str | None:
    """The first string after every string starting with `prefix` (its last character's next;
    SQLite orders text by its UTF-8 bytes, which follow code points), None past the last one."""
    last = ord(prefix[-1]) + 1
    if 0xD800 <= last <= 0xDFFF:  # surrogates are no characters: the next one is U+E000
        last = 0xE000
    return prefix[:-1] + chr(last) if last <= 0x10FFFF else None


def record_path_for(library: str | Path) -> Path:
    """The record's file beside a library: `library.sqlite` → `library.record.sqlite`."""
    path = Path(library)
    return path.with_name(f"{path.stem}.record.sqlite")


class SqliteRecordStore:
    """The record in a SQLite file. Calls run in a thread, one at a time (a lock), so the event
    loop never waits on the disk."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(SCHEMA)
        self.lock = asyncio.Lock()
        found = self.db.execute("SELECT value FROM record_meta WHERE name = 'indexed'").fetchone()
        if found is None or found[0] != INDEXES:
            self._index_all()

    def _index_all(self) -> None:
        """Index a record written before the indexes were kept (once, when it is first opened)."""
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        try:
            for table in ("task_index", "class_counts", "quarantined", "env_errors"):
                db.execute(f"DELETE FROM {table}")
            rows = db.execute("SELECT scope, key, body FROM tallies").fetchall()
            self._write_indexes(((scope, key, None, json.loads(body)) for scope, key, body in rows))
            db.execute("INSERT OR REPLACE INTO record_meta (name, value) VALUES ('indexed', ?)", (INDEXES,))
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    def _write_indexes(
        self, changes: Iterable[tuple[str, str, dict[str, Any] | None, dict[str, Any]]]
    ) -> None:
        """Bring the indexes from each (scope, key)'s old body to its new one."""
        db = self.db
        counted: Counter[tuple[str, str]] = Counter()
        index_rows: list[tuple[str, str, float | None, float | None]] = []
        gone: list[tuple[str, str]] = []
        sick: list[tuple[str]] = []
        well: list[tuple[str]] = []
        erring: list[tuple[str, float]] = []
        for scope, key, old, new in changes:
            if scope == ENV_SCOPE:
                (sick if quarantined(new) else well).append((key,))
                rate = error_score(new)
                if rate is not None:
                    erring.append((key, rate))
                continue
            pool, recent = pool_score(new), recent_score(new)
            if pool is None and recent is None:
                gone.append((scope, key))
            else:
                index_rows.append((scope, key, pool, recent))
            before, after = classes(old), classes(new)
            for name in after - before:
                counted[(scope, name)] += 1
            for name in before - after:
                counted[(scope, name)] -= 1
        db.executemany(
            "INSERT OR REPLACE INTO task_index (scope, key, pool, recent) VALUES (?, ?, ?, ?)", index_rows
        )
        db.executemany("DELETE FROM task_index WHERE scope = ? AND key = ?", gone)
        db.executemany("INSERT OR IGNORE INTO quarantined (env_id) VALUES (?)", sick)
        db.executemany("DELETE FROM quarantined WHERE env_id = ?", well)
        # A body's failed steps only grow (a lift resets the window, not the counters): an
        # environment once in the errors index stays, its rate kept current.
        db.executemany("INSERT OR REPLACE INTO env_errors (env_id, rate) VALUES (?, ?)", erring)
        db.executemany(
            "INSERT INTO class_counts (scope, class, n) VALUES (?, ?, ?)"
            " ON CONFLICT (scope, class) DO UPDATE SET n = n + excluded.n",
            [(scope, name, n) for (scope, name), n in counted.items() if n],
        )

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
            merged, changes = [], []
            counted: Counter[tuple[str, int, str]] = Counter()
            for (scope, key), delta in deltas.items():
                old = json.loads(held[(scope, key)]) if (scope, key) in held else None
                schema = schema_of(scope)
                body = merge(schema, dict(old or {}), delta)
                if schema == TaskTally.SCHEMA:
                    for version, names in account(old, body, delta).items():
                        counted.update(
                            {(cast(str, run_of(scope)), version, name): n for name, n in names.items()}
                        )
                merged.append((scope, key, encode(body)))
                changes.append((scope, key, old, body))
            db.executemany("INSERT OR REPLACE INTO tallies (scope, key, body) VALUES (?, ?, ?)", merged)
            self._write_indexes(changes)
            db.executemany(
                "INSERT INTO version_counts (run, version, name, n) VALUES (?, ?, ?, ?)"
                " ON CONFLICT (run, version, name) DO UPDATE SET n = n + excluded.n",
                [(*at, n) for at, n in counted.items() if n],
            )
            for scope, versions in versions_of(deltas).items():
                run = run_of(scope)
                point = history_point(versions[-1], self._counts(scope))
                for version in versions:
                    db.execute(
                        f"INSERT OR {'REPLACE' if version == versions[-1] else 'IGNORE'} INTO history"
                        " (run, version, at, played, learnable, mastered, unsolved) VALUES (?, ?, ?, ?, ?, ?, ?)",
                        (run, version, *list(point.pools().values())[1:]),
                    )
                db.execute(
                    "DELETE FROM history WHERE run = ? AND version < (SELECT version FROM history WHERE run = ?"
                    " ORDER BY version DESC LIMIT 1 OFFSET ?)",
                    (run, run, HISTORY_KEEP - 1),
                )
            # The counts of versions the history no longer keeps go (a range of the key; a count
            # back at 0 stays until then, and is not read).
            for run in {run for run, _, _ in counted}:
                db.execute(
                    "DELETE FROM version_counts WHERE run = ? AND version <"
                    " (SELECT COALESCE(MIN(version), -1) FROM history WHERE run = ?)",
                    (run, run),
                )
            for run, seen in runs.items():
                db.execute("INSERT OR REPLACE INTO runs (run, last_seen) VALUES (?, ?)", (run, seen))
            for (run,) in db.execute(
                "SELECT run FROM runs WHERE run != ? ORDER BY last_seen DESC LIMIT -1 OFFSET ?",
                (ALL_RUNS, MAX_RUNS),
            ).fetchall():
                for table in ("tallies", "task_index", "class_counts"):
                    db.execute(f"DELETE FROM {table} WHERE scope = ?", (task_scope(run),))
                db.execute("DELETE FROM history WHERE run = ?", (run,))
                db.execute("DELETE FROM version_counts WHERE run = ?", (run,))
                db.execute("DELETE FROM runs WHERE run = ?", (run,))
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    async def _call(self, query: Any) -> Any:
        async with self.lock:
            return await asyncio.to_thread(query)

    async def read(self, scope: str) -> dict[str, dict[str, Any]]:
        rows = await self._call(
            lambda: self.db.execute("SELECT key, body FROM tallies WHERE scope = ?", (scope,)).fetchall()
        )
        return {key: json.loads(body) for key, body in rows}

    async def read_many(self, scope: str, keys: Iterable[str]) -> dict[str, dict[str, Any]]:
        """The bodies of `keys` in `scope` (keys without one left out)."""
        wanted = list(keys)

        def query() -> list[tuple[str, str]]:
            rows = []
            for start in range(0, len(wanted), 500):
                part = wanted[start : start + 500]
                marks = ",".join("?" * len(part))
                rows += self.db.execute(
                    f"SELECT key, body FROM tallies WHERE scope = ? AND key IN ({marks})", (scope, *part)
                ).fetchall()
            return rows

        return {key: json.loads(body) for key, body in await self._call(query)}

    async def read_one(self, scope: str, key: str) -> dict[str, Any] | None:
        row = await self._call(
            lambda: self.db.execute(
                "SELECT body FROM tallies WHERE scope = ? AND key = ?", (scope, key)
            ).fetchone()
        )
        return None if row is None else dict(json.loads(row[0]))

    async def read_prefix(self, scope: str, prefix: str) -> dict[str, dict[str, Any]]:
        """The keys starting with `prefix`: a range of the primary key, [prefix, its successor)."""
        if not prefix:
            return await self.read(scope)
        sql = "SELECT key, body FROM tallies WHERE scope = ? AND key >= ?"
        args: tuple[str, ...] = (scope, prefix)
        end = successor(prefix)
        if end is not None:
            sql, args = sql + " AND key < ?", (*args, end)
        rows = await self._call(lambda: self.db.execute(sql, args).fetchall())
        return {key: json.loads(body) for key, body in rows if key.startswith(prefix)}

    async def scored(self, scope: str, low: float, high: float) -> list[str]:
        """The keys of a task scope whose pool score is in [low, high] (an index range)."""
        rows = await self._call(
            lambda: self.db.execute(
                "SELECT key FROM task_index WHERE scope = ? AND pool BETWEEN ? AND ?", (scope, low, high)
            ).fetchall()
        )
        return [key for (key,) in rows]

    def _counts(self, scope: str) -> dict[str, int]:
        rows = self.db.execute("SELECT class, n FROM class_counts WHERE scope = ?", (scope,))
        return {name: int(n) for name, n in rows if n}

    async def counts(self, scope: str) -> dict[str, int]:
        """A task scope's tasks by class (`tallies.CLASS_RANGES`), as kept: no walk."""
        result: dict[str, int] = await self._call(lambda: self._counts(scope))
        return result

    async def quarantined(self) -> set[str]:
        rows = await self._call(lambda: self.db.execute("SELECT env_id FROM quarantined").fetchall())
        return {env_id for (env_id,) in rows}

    async def worst_envs(self, n: int) -> list[str]:
        """The `n` environments with the highest share of failed steps, the worst first (ties: the
        greater id first, as Redis orders them)."""
        rows = await self._call(
            lambda: self.db.execute(
                "SELECT env_id FROM env_errors ORDER BY rate DESC, env_id DESC LIMIT ?", (n,)
            ).fetchall()
        )
        return [env_id for (env_id,) in rows]

    async def runs(self) -> set[str]:
        rows = await self._call(lambda: self.db.execute("SELECT run FROM runs").fetchall())
        return {run for (run,) in rows}

    async def history(self, run: str) -> list[HistoryPoint]:
        """The run's history with each version's counts, oldest version first."""

        def query() -> tuple[list[Any], list[Any]]:
            points = self.db.execute(
                "SELECT version, at, played, learnable, mastered, unsolved FROM history WHERE run = ?"
                " ORDER BY version",
                (run or ALL_RUNS,),
            ).fetchall()
            counts = self.db.execute(
                "SELECT version, name, n FROM version_counts WHERE run = ? AND n != 0", (run or ALL_RUNS,)
            ).fetchall()
            return points, counts

        points, rows = await self._call(query)
        counts: dict[int, dict[str, int]] = {}
        for version, name, n in rows:
            counts.setdefault(int(version), {})[name] = int(n)
        return attach([HistoryPoint(*row) for row in points], counts)

    async def close(self) -> None:
        async with self.lock:
            self.db.close()


class RedisRecordStore:
    """The record in Redis: a hash per scope (`{prefix}record:{scope}`), beside it the scope's pool
    index and recent index (sorted sets `record-pool:`, `record-recent:`), the quarantined
    environments (a set), the environments with a failed step by their share of them (a sorted
    set, `record-env-errors`), the runs by when each was last seen and each run's history (sorted
    sets by time and by version). Counts are ZCOUNTs of the indexes: no walk."""

    def __init__(self, url: str, *, prefix: str = "codegym:") -> None:
        self.redis = aioredis.from_url(url, socket_connect_timeout=2, socket_timeout=10)
        self.prefix = prefix
        self.runs_key = f"{prefix}record-runs"
        self.quarantine_key = f"{prefix}record-quarantined"
        self.indexed_key = f"{prefix}record-indexed"
        self.errors_key = f"{prefix}record-env-errors"
        self._merge = self.redis.register_script(LUA_MERGE)
        self._history = self.redis.register_script(LUA_HISTORY)
        self._indexed = False

    def hash(self, scope: str) -> str:
        return f"{self.prefix}record:{scope}"

    def index(self, name: str, scope: str) -> str:
        return f"{self.prefix}record-{name}:{scope}"

    def history_key(self, run: str) -> str:
        return f"{self.prefix}record-history:{run or ALL_RUNS}"

    def versions_key(self, scope: str) -> str:
        """A scope's counts per policy version (a hash: version -> JSON counts)."""
        return f"{self.prefix}record-versions:{scope}"

    async def _index_all(self) -> None:
        """Index a record written before the indexes were kept (once: a marker key says it is done).
        Each body is merged with an empty delta, which rewrites it and its indexes unchanged."""
        if self._indexed:
            return
        if await self.redis.get(self.indexed_key) != INDEXES.encode():
            async for name in self.redis.scan_iter(match=f"{self.prefix}record:*", count=500):
                hash_key = name.decode() if isinstance(name, bytes) else str(name)
                scope = hash_key.removeprefix(f"{self.prefix}record:")
                fields = [
                    f.decode() if isinstance(f, bytes) else str(f) for f in await self.redis.hkeys(hash_key)
                ]
                for start in range(0, len(fields), 500):
                    await self._merge_part([((scope, field), {}) for field in fields[start : start + 500]])
            await self.redis.set(self.indexed_key, INDEXES)
        self._indexed = True

    async def _merge_part(self, part: list[tuple[tuple[str, str], dict[str, Any]]]) -> None:
        keys: list[str] = []
        args: list[str] = []
        for (scope, key), delta in part:
            if scope == ENV_SCOPE:  # an environment: its scope's errors index (the third key unused)
                keys += [self.hash(scope), self.errors_key, self.index("recent", scope)]
            else:
                keys += [self.hash(scope), self.index("pool", scope), self.index("recent", scope)]
            keys.append(self.versions_key(scope))  # the environments' is never written
            args += [schema_of(scope), key, json.dumps(delta, ensure_ascii=False)]
        await self._merge(keys=[*keys, self.quarantine_key], args=args)

    async def apply(self, deltas: dict[tuple[str, str], dict[str, Any]], runs: dict[str, float]) -> None:
        await self._index_all()
        items = list(deltas.items())
        for start in range(0, len(items), 500):
            await self._merge_part(items[start : start + 500])
        for scope, versions in versions_of(deltas).items():
            point = history_point(versions[-1], await self.counts(scope))
            args: list[Any] = [HISTORY_KEEP]
            for version in versions:
                pools = {**point.pools(), "version": version}
                args += [version, json.dumps(pools), int(version == versions[-1])]
            await self._history(
                keys=[self.history_key(run_of(scope) or ""), self.versions_key(scope)], args=args
            )
        if runs:
            await self.redis.zadd(self.runs_key, {run: seen for run, seen in runs.items()})
            for raw in await self.redis.zrevrange(self.runs_key, MAX_RUNS, -1):
                run = raw.decode() if isinstance(raw, bytes) else str(raw)
                if run != ALL_RUNS:
                    scope = task_scope(run)
                    await self.redis.delete(
                        self.hash(scope),
                        self.index("pool", scope),
                        self.index("recent", scope),
                        self.history_key(run),
                        self.versions_key(scope),
                    )
                    await self.redis.zrem(self.runs_key, run)

    async def read(self, scope: str) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        async for field, raw in self.redis.hscan_iter(self.hash(scope), count=2000):
            out[field.decode()] = json.loads(raw)
        return out

    async def read_many(self, scope: str, keys: Iterable[str]) -> dict[str, dict[str, Any]]:
        wanted = list(keys)
        out: dict[str, dict[str, Any]] = {}
        for start in range(0, len(wanted), 1000):
            part = wanted[start : start + 1000]
            for key, raw in zip(part, await self.redis.hmget(self.hash(scope), part), strict=True):
                if raw is not None:
                    out[key] = json.loads(raw)
        return out

    async def read_one(self, scope: str, key: str) -> dict[str, Any] | None:
        raw = await self.redis.hget(self.hash(scope), key)
        return None if raw is None else dict(json.loads(raw))

    async def read_prefix(self, scope: str, prefix: str) -> dict[str, dict[str, Any]]:
        """The keys starting with `prefix`, matched by Redis (HSCAN MATCH): only they are sent and
        parsed, though Redis looks at every key of the hash."""
        if not prefix:
            return await self.read(scope)
        pattern = "".join(f"\\{c}" if c in "*?[]\\^" else c for c in prefix) + "*"
        out: dict[str, dict[str, Any]] = {}
        async for field, raw in self.redis.hscan_iter(self.hash(scope), match=pattern, count=2000):
            key = field.decode()
            if key.startswith(prefix):
                out[key] = json.loads(raw)
        return out

    async def scored(self, scope: str, low: float, high: float) -> list[str]:
        await self._index_all()
        members = await self.redis.zrangebyscore(self.index("pool", scope), low, high)
        return [m.decode() if isinstance(m, bytes) else str(m) for m in members]

    async def counts(self, scope: str) -> dict[str, int]:
        await self._index_all()
        async with self.redis.pipeline(transaction=False) as pipe:
            for index, low, high, low_open, high_open in CLASS_RANGES.values():
                pipe.zcount(
                    self.index(index, scope),
                    f"({low}" if low_open else low,
                    f"({high}" if high_open else high,
                )
            found = await pipe.execute()
        return {name: int(n) for name, n in zip(CLASS_RANGES, found, strict=True) if n}

    async def quarantined(self) -> set[str]:
        await self._index_all()
        return {
            m.decode() if isinstance(m, bytes) else str(m)
            for m in await self.redis.smembers(self.quarantine_key)
        }

    async def worst_envs(self, n: int) -> list[str]:
        await self._index_all()
        members = await self.redis.zrevrange(self.errors_key, 0, n - 1) if n > 0 else []
        return [m.decode() if isinstance(m, bytes) else str(m) for m in members]

    async def runs(self) -> set[str]:
        return {
            m.decode() if isinstance(m, bytes) else str(m)
            for m in await self.redis.zrange(self.runs_key, 0, -1)
        }

    async def history(self, run: str) -> list[HistoryPoint]:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.zrange(self.history_key(run), 0, -1)
            pipe.hgetall(self.versions_key(task_scope(run)))
            found, held = await pipe.execute()
        counts = {int(version): json.loads(raw) for version, raw in held.items()}
        return attach([HistoryPoint(**json.loads(cast(bytes, raw))) for raw in found], counts)

    async def close(self) -> None:
        await self.redis.aclose()

"""Captured episodes in SQLite: the record's file (`LIBRARY.record.sqlite`) for one runtime, or
memory (`":memory:"`) when the runtime keeps no record file.

One row per capture, numbered in the order kept (`seq`), indexed by tenant, run and environment
so a page of a filtered list reads its page; the bytes held are summed once at open and kept
current by this process (one runtime writes a file), and past the bound the oldest rows go in the
same transaction as the row that crossed it.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from pathlib import Path
from typing import Any

from codegym_client.api.runtime.v1 import runtime_service_pb2 as rt
from services.runtime.captures import Capture, Filters

log = logging.getLogger(__name__)

SCHEMA = """
CREATE TABLE IF NOT EXISTS captures (
    seq         INTEGER PRIMARY KEY AUTOINCREMENT,
    episode_id  TEXT NOT NULL UNIQUE,
    tenant      TEXT NOT NULL,
    run_id      TEXT NOT NULL,
    env_id      TEXT NOT NULL,
    rewarded    INTEGER NOT NULL,
    flagged     INTEGER NOT NULL,
    error       INTEGER NOT NULL,
    size        INTEGER NOT NULL,
    summary     BLOB NOT NULL,
    body        BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS captures_tenant ON captures(tenant, seq);
CREATE INDEX IF NOT EXISTS captures_run ON captures(run_id, seq);
CREATE INDEX IF NOT EXISTS captures_env ON captures(env_id, seq);
"""


class SqliteCaptureStore:
    """Captures in a SQLite file (or memory). Calls run in a thread, one at a time."""

    def __init__(self, path: str | Path, bound_bytes: int) -> None:
        self.bound = bound_bytes
        self.db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        if str(path) != ":memory:":
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(SCHEMA)
        self.held = int(self.db.execute("SELECT COALESCE(SUM(size), 0) FROM captures").fetchone()[0])
        self.lock = asyncio.Lock()

    async def _run(self, call: Any, *args: Any) -> Any:
        async with self.lock:
            return await asyncio.to_thread(call, *args)

    async def put(self, capture: Capture) -> None:
        await self._run(self._put, capture)

    def _put(self, capture: Capture) -> None:
        s = capture.summary
        if capture.size > self.bound:
            log.warning(
                "capture of %s (%d bytes) exceeds --capture-bytes; not kept", s.episode_id, capture.size
            )
            return
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        try:
            added = db.execute(
                "INSERT OR IGNORE INTO captures (episode_id, tenant, run_id, env_id, rewarded, flagged, error,"
                " size, summary, body) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    s.episode_id,
                    s.tenant,
                    s.run_id,
                    s.env_id,
                    int(s.reward > 0),
                    int(s.flagged),
                    int(s.end_reason == "error"),
                    capture.size,
                    s.SerializeToString(),
                    capture.body,
                ),
            ).rowcount
            held = self.held + (capture.size if added else 0)
            while held > self.bound:
                oldest = db.execute("SELECT seq, size FROM captures ORDER BY seq LIMIT 64").fetchall()
                for seq, size in oldest:
                    if held <= self.bound:
                        break
                    db.execute("DELETE FROM captures WHERE seq = ?", (seq,))
                    held -= size
            db.execute("COMMIT")
            self.held = held
        except BaseException:
            db.execute("ROLLBACK")
            raise

    async def page(
        self, filters: Filters, size: int, before: int | None
    ) -> tuple[list[rt.EpisodeSummary], int | None]:
        rows = await self._run(self._page, filters, size, before)
        summaries = [rt.EpisodeSummary.FromString(raw) for _, raw in rows[:size]]
        return summaries, rows[size - 1][0] if len(rows) > size else None

    def _page(self, f: Filters, size: int, before: int | None) -> list[tuple[int, bytes]]:
        clauses: list[str] = ["seq < ?"]
        args: list[object] = [before if before is not None else 1 << 62]
        for column, value in (
            ("tenant", f.tenant),
            ("run_id", f.run_id or None),
            ("env_id", f.env_id or None),
        ):
            if value is not None:
                clauses.append(f"{column} = ?")
                args.append(value)
        if f.rewarded is not None:
            clauses.append("rewarded = ?")
            args.append(int(f.rewarded))
        if f.flagged_only:
            clauses.append("flagged = 1")
        if f.errors_only:
            clauses.append("error = 1")
        return self.db.execute(
            f"SELECT seq, summary FROM captures WHERE {' AND '.join(clauses)} ORDER BY seq DESC LIMIT ?",
            (*args, size + 1),
        ).fetchall()

    async def get(self, episode_id: str) -> rt.GetEpisodeResponse | None:
        row = await self._run(
            lambda: self.db.execute(
                "SELECT body FROM captures WHERE episode_id = ?", (episode_id,)
            ).fetchone()
        )
        return None if row is None else rt.GetEpisodeResponse.FromString(row[0])

    async def held_bytes(self) -> int:
        return self.held

    async def close(self) -> None:
        async with self.lock:
            self.db.close()

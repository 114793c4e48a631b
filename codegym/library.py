"""The environment library: one SQLite file holding environment sources and task configs.

Everything stored here is derived statically (with the contract checker's `ast` reading), so
importing never runs environment code. The runtime loads the whole library into memory at start:
a few thousand environments are a few tens of MB, and a step must not wait on disk.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable
from contextlib import closing
from pathlib import Path
from typing import Any

from codegym.library_import import add_task, import_paths, import_source
from codegym.library_records import EnvRecord, ImportReport, TaskRecord, Tool, canonical_config

# The records are part of the library's API (`from codegym.library import EnvRecord`).
__all__ = [
    "EnvRecord",
    "ImportReport",
    "Library",
    "TaskRecord",
    "Tool",
    "canonical_config",
    "default_library_path",
    "load_library",
]

SCHEMA = """
CREATE TABLE IF NOT EXISTS envs (
    env_id      TEXT PRIMARY KEY,
    code_id     TEXT NOT NULL,
    env_class   TEXT NOT NULL,
    source      TEXT NOT NULL,
    sha256      TEXT NOT NULL,
    tools_json  TEXT NOT NULL,
    tools_text  TEXT NOT NULL,
    task_text   TEXT NOT NULL DEFAULT '',
    metadata    TEXT NOT NULL DEFAULT '{}',
    updated_at  REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS tasks (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    env_id          TEXT NOT NULL REFERENCES envs(env_id) ON DELETE CASCADE,
    config_json     TEXT NOT NULL,
    difficulty      TEXT NOT NULL DEFAULT '',
    solve_fc_round  INTEGER NOT NULL DEFAULT 0,
    origin          TEXT NOT NULL DEFAULT '',
    scores          TEXT NOT NULL DEFAULT '{}',
    guess_rate      REAL,
    UNIQUE (env_id, config_json)
);
CREATE INDEX IF NOT EXISTS tasks_env ON tasks(env_id);
"""


class Library:
    """A SQLite environment library. Cheap to open; not shared between threads.

    Owns the connection and the schema; importing (library_import.py) is functions of the
    connection, called from here.
    """

    def __init__(self, path: str | Path, *, read_only: bool = False) -> None:
        self.path = Path(path)
        if read_only:
            # Reading only (the runtime): nothing is created or changed. On a read-only volume (a
            # runtime pod) SQLite cannot even make its lock files: open the file as immutable then.
            uri = f"file:{self.path.resolve()}?mode=ro"
            try:
                self.db = sqlite3.connect(uri, uri=True)
                self.db.execute("SELECT COUNT(*) FROM envs").fetchone()
            except sqlite3.OperationalError:
                self.db = sqlite3.connect(uri + "&immutable=1", uri=True)
            return
        if self.path.parent and not self.path.parent.exists():
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.path)
        self.db.execute("PRAGMA foreign_keys = ON")
        self.db.execute("PRAGMA journal_mode = WAL")
        self.db.executescript(SCHEMA)
        columns = {row[1] for row in self.db.execute("PRAGMA table_info(tasks)")}
        if "scores" not in columns:  # a library written before evaluation scores existed
            with self.db:
                self.db.execute("ALTER TABLE tasks ADD COLUMN scores TEXT NOT NULL DEFAULT '{}'")
        if "guess_rate" not in columns:  # a library written before guessability was measured
            with self.db:
                self.db.execute("ALTER TABLE tasks ADD COLUMN guess_rate REAL")

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> Library:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def import_paths(self, paths: Iterable[str | Path]) -> ImportReport:
        """Import env files (`{code_id}__{Env}.py`), folders of them, and training-instance JSONL."""
        return import_paths(self.db, paths)

    def add_tasks(self, tasks: Iterable[TaskRecord], origin: str = "") -> ImportReport:
        report = ImportReport()
        with self.db:
            for task in tasks:
                add_task(self.db, task, origin, report)
        return report

    def put_environment(
        self,
        env_id: str,
        source: str,
        *,
        task_text: str,
        metadata: dict[str, Any],
        tasks: Iterable[TaskRecord],
    ) -> ImportReport:
        """Write one verified environment and exactly these task configs (the pipeline's output).

        Unlike an import, the environment's earlier task configs are replaced: a pipeline run is
        the authority on which configs passed its filters.
        """
        with self.db:
            report = import_source(self.db, env_id, source, task_text=task_text, metadata=metadata)
            if report.skipped:
                return report
            self.db.execute(
                "UPDATE envs SET metadata = ?, task_text = ? WHERE env_id = ?",
                (json.dumps(metadata), task_text, env_id),
            )
            self.db.execute("DELETE FROM tasks WHERE env_id = ?", (env_id,))
            for task in tasks:
                add_task(self.db, task, "pipeline", report)
        return report

    def get(self, env_id: str) -> EnvRecord | None:
        row = self.db.execute(
            "SELECT env_id, code_id, env_class, source, sha256, tools_json, tools_text, task_text, metadata"
            " FROM envs WHERE env_id = ?",
            (env_id,),
        ).fetchone()
        if row is None:
            return None
        return self._record(row, self._tasks(env_id))

    def load_all(self) -> dict[str, EnvRecord]:
        """The whole library in memory (what a runtime serves from)."""
        tasks: dict[str, list[TaskRecord]] = {}
        for env_id, config_json, difficulty, rounds, scores, guess in self.db.execute(
            f"SELECT env_id, config_json, difficulty, solve_fc_round, scores, {self._guess_column()}"
            " FROM tasks ORDER BY id"
        ):
            tasks.setdefault(env_id, []).append(
                TaskRecord(env_id, config_json, difficulty, rounds, json.loads(scores), guess)
            )
        rows = self.db.execute(
            "SELECT env_id, code_id, env_class, source, sha256, tools_json, tools_text, task_text, metadata"
            " FROM envs ORDER BY env_id"
        )
        return {row[0]: self._record(row, tasks.get(row[0], [])) for row in rows}

    def counts(self) -> tuple[int, int]:
        envs = self.db.execute("SELECT COUNT(*) FROM envs").fetchone()[0]
        tasks = self.db.execute("SELECT COUNT(*) FROM tasks").fetchone()[0]
        return int(envs), int(tasks)

    def _tasks(self, env_id: str) -> list[TaskRecord]:
        rows = self.db.execute(
            f"SELECT env_id, config_json, difficulty, solve_fc_round, scores, {self._guess_column()}"
            " FROM tasks WHERE env_id = ? ORDER BY id",
            (env_id,),
        )
        return [TaskRecord(e, c, d, r, json.loads(sc), g) for e, c, d, r, sc, g in rows]

    def _guess_column(self) -> str:
        """`guess_rate`, or NULL in a read-only library written before the column existed."""
        columns = {row[1] for row in self.db.execute("PRAGMA table_info(tasks)")}
        return "guess_rate" if "guess_rate" in columns else "NULL"

    def set_scores(self, scores: Iterable[tuple[str, str, str, float]]) -> int:
        """Record (env_id, config_json, score name, value) for task configs in the library; returns how many matched."""
        matched = 0
        with self.db:
            for env_id, config_json, name, value in scores:
                row = self.db.execute(
                    "SELECT id, scores FROM tasks WHERE env_id = ? AND config_json = ?", (env_id, config_json)
                ).fetchone()
                if row is None:
                    continue
                merged = {**json.loads(row[1]), name: value}
                self.db.execute("UPDATE tasks SET scores = ? WHERE id = ?", (json.dumps(merged), row[0]))
                matched += 1
        return matched

    @staticmethod
    def _record(row: tuple[Any, ...], tasks: list[TaskRecord]) -> EnvRecord:
        tools = [Tool(t["name"], t["signature"], t["text"], t["schema"]) for t in json.loads(row[5])]
        return EnvRecord(
            env_id=row[0],
            code_id=row[1],
            env_class=row[2],
            source=row[3],
            sha256=row[4],
            tools=tools,
            tools_text=row[6],
            task_text=row[7],
            metadata=json.loads(row[8]),
            tasks=tasks,
        )


def load_library(path: str | Path) -> dict[str, EnvRecord]:
    """Open, read everything, close: the runtime's start-up (and reload) path."""
    if not Path(path).exists():
        raise FileNotFoundError(f"library {path} does not exist: build it with 'codegym library import'")
    with closing(Library(path, read_only=True)) as library:
        return library.load_all()


def default_library_path() -> Path:
    """`$CODEGYM_LIBRARY`, else `$XDG_DATA_HOME/codegym/library.db` (~/.local/share by default)."""
    import os

    if os.environ.get("CODEGYM_LIBRARY"):
        return Path(os.environ["CODEGYM_LIBRARY"])
    base = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    return base / "codegym" / "library.db"

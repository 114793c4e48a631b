"""The environment library: one SQLite file holding environment sources and task configs.

Everything stored here is derived statically (with the contract checker's `ast` reading), so
importing never runs environment code. Readers take one environment or task at a time (by key, or
streamed in id order): CodeGym's published library is 20,000+ environments and 80,000+ task
configs, and the runtime holds only the ones in use (`services/runtime/catalog.py`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sqlite3
from collections.abc import Iterable, Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

from codegym.library import search as search_index
from codegym.library.importing import ImportProgress, import_paths
from codegym.library.records import EnvRecord, ImportReport, TaskRecord, Tool, canonical_config
from codegym.library.writes import add_task, put_environment

# The records are part of the library's API (`from codegym.library.store import EnvRecord`).
__all__ = [
    "EnvRecord",
    "ImportReport",
    "Library",
    "TaskRecord",
    "Tool",
    "canonical_config",
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
    config_text     TEXT NOT NULL DEFAULT '',
    source_sha      TEXT NOT NULL DEFAULT '',
    extra           TEXT NOT NULL DEFAULT '{}',
    learnability    TEXT NOT NULL DEFAULT '',
    UNIQUE (env_id, config_json)
);
CREATE INDEX IF NOT EXISTS tasks_env ON tasks(env_id);
CREATE INDEX IF NOT EXISTS envs_class ON envs(env_class);
CREATE TABLE IF NOT EXISTS variants (
    sha256      TEXT PRIMARY KEY,
    env_id      TEXT NOT NULL,
    source      TEXT NOT NULL,
    tools_json  TEXT NOT NULL,
    tools_text  TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS trajectories (
    task_id     INTEGER PRIMARY KEY REFERENCES tasks(id) ON DELETE CASCADE,
    std_traj    TEXT NOT NULL,
    obs_traj    TEXT NOT NULL
);
"""
# Columns added to `tasks` after the first release, with their definitions: an older library
# gains them when opened for writing (`Library.__init__`), and is read without them otherwise.
#   config_text: the config exactly as it was published ('' = `config_json` is that text), so an
#                ability string built from it round-trips byte for byte; `config_json` stays the
#                canonical spelling that finds duplicates.
#   source_sha:  the code the task was recorded with, when it is not its environment's (a row of
#                `variants`); '' = the environment's own source.
#   extra:       the published fields kept with the task (extra_info keys, unknown columns).
#   learnability: unsolved / learnable / mastered from a run's served episodes ('' = unlabelled),
#                written by `codegym library label`; apart from the published `difficulty`.
ENV_COLUMNS = "env_id, code_id, env_class, source, sha256, tools_json, tools_text, task_text, metadata"
TASK_COLUMNS = {
    "scores": "TEXT NOT NULL DEFAULT '{}'",
    "guess_rate": "REAL",
    "config_text": "TEXT NOT NULL DEFAULT ''",
    "source_sha": "TEXT NOT NULL DEFAULT ''",
    "extra": "TEXT NOT NULL DEFAULT '{}'",
    "learnability": "TEXT NOT NULL DEFAULT ''",
}


class Library:
    """A SQLite environment library. Cheap to open; not shared between threads.

    Owns the connection and the schema; importing (library_import.py) is functions of the
    connection, called from here.
    """

    def __init__(self, path: str | Path, *, read_only: bool = False) -> None:
        self.path = Path(path)
        self._task_select: str | None = None
        self._table_names: set[str] | None = None
        # Where the search index is read: the file's own, or (a read-only library written before
        # the index existed) one built into memory at the first search.
        self._search_schema: str | None = None
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
        columns = {row[1] for row in self.db.execute("PRAGMA table_info(tasks)")}
        if columns:  # a library written by an earlier release: add what it lacks first
            with self.db:
                for name, definition in TASK_COLUMNS.items():
                    if name not in columns:
                        self.db.execute(f"ALTER TABLE tasks ADD COLUMN {name} {definition}")
        self.db.executescript(SCHEMA)
        if not search_index.has_index(self.db):  # new, or written before the index existed
            with self.db:
                search_index.refresh(self.db)

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> Library:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def import_paths(
        self,
        paths: Iterable[str | Path],
        *,
        on_conflict: str = "refuse",
        progress: ImportProgress | None = None,
        jobs: int | None = None,
    ) -> ImportReport:
        """Import everything CodeGym publishes under `paths` (library_published.py lists the forms):
        a batch per transaction, an environment key with other code refused unless `on_conflict`
        is "keep" or "replace"; `jobs` processes check sources (default: one per core)."""
        report = import_paths(self.db, paths, on_conflict=on_conflict, progress=progress, jobs=jobs)
        with self.db:
            search_index.refresh(self.db)
        return report

    def add_tasks(self, tasks: Iterable[TaskRecord], origin: str = "") -> ImportReport:
        report = ImportReport()
        counts = report.source(origin, "tasks")
        touched: set[str] = set()
        with self.db:
            for task in tasks:
                touched.add(task.env_id)
                if add_task(self.db, task, origin):
                    counts.tasks_added += 1
                else:
                    counts.tasks_present += 1
            search_index.refresh(self.db, touched)
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

        Unlike an import, the environment's code and earlier task configs are replaced: a pipeline
        run is the authority on which configs passed its filters.
        """
        with self.db:
            report = put_environment(
                self.db, env_id, source, task_text=task_text, metadata=metadata, tasks=tasks
            )
            search_index.refresh(self.db, [env_id])
            return report

    # ---- reading: one environment or task at a time, or streamed; never the whole library ----

    def get(self, env_id: str, *, tasks: bool = True) -> EnvRecord | None:
        """One environment, with its task configs unless `tasks=False` (a create needs none)."""
        row = self.db.execute(f"SELECT {ENV_COLUMNS} FROM envs WHERE env_id = ?", (env_id,)).fetchone()
        if row is None:
            return None
        return self._record(row, self.tasks_of(env_id) if tasks else [])

    def iter_envs(self, prefix: str = "", *, tasks: bool = True) -> Iterator[EnvRecord]:
        """Every environment whose id starts with `prefix`, in id order, one at a time: a command
        over 20,000 environments holds one of them, not the library."""
        after = ""
        while True:
            rows = self.db.execute(
                f"SELECT {ENV_COLUMNS} FROM envs WHERE env_id > ? AND substr(env_id, 1, ?) = ?"
                " ORDER BY env_id LIMIT 256",
                (after, len(prefix), prefix),
            ).fetchall()
            if not rows:
                return
            for row in rows:
                yield self._record(row, self.tasks_of(row[0]) if tasks else [])
            after = rows[-1][0]

    def iter_tasks(self, prefix: str = "") -> Iterator[TaskRecord]:
        """Every task config of the environments whose id starts with `prefix`, in (env id, row)
        order, read a page at a time: a sampler over 80,000 tasks holds one page of them."""
        after = ("", -1)
        while True:
            rows = self.db.execute(
                f"SELECT id, {self._task_columns()} FROM tasks WHERE (env_id, id) > (?, ?)"
                " AND substr(env_id, 1, ?) = ? ORDER BY env_id, id LIMIT 1024",
                (*after, len(prefix), prefix),
            ).fetchall()
            if not rows:
                return
            for row in rows:
                yield self._task(row[1:])
            after = (rows[-1][1], rows[-1][0])

    def load_all(self) -> dict[str, EnvRecord]:
        """The whole library in memory: for small libraries and tests only (the runtime reads on
        demand, `services/runtime/catalog.py`)."""
        return {record.env_id: record for record in self.iter_envs()}

    def ids_of_class(self, env_class: str, limit: int = 6) -> list[str]:
        """Env ids whose class is `env_class` (CodeGym's env strings name only the class)."""
        rows = self.db.execute(
            "SELECT env_id FROM envs WHERE env_class = ? ORDER BY env_id LIMIT ?", (env_class, limit)
        )
        return [row[0] for row in rows]

    def page(self, prefix: str, after: str, size: int) -> list[tuple[str, list[str], int]]:
        """(env_id, tool names, task count) of up to `size` environments after `after`, by id."""
        rows = self.db.execute(
            "SELECT e.env_id, e.tools_json, (SELECT COUNT(*) FROM tasks t WHERE t.env_id = e.env_id)"
            " FROM envs e WHERE e.env_id > ? AND substr(e.env_id, 1, ?) = ? ORDER BY e.env_id LIMIT ?",
            (after, len(prefix), prefix, size),
        )
        return [(env_id, [t["name"] for t in json.loads(tools)], int(n)) for env_id, tools, n in rows]

    def task(self, env_id: str, config_json: str) -> TaskRecord | None:
        """The stored task config of `env_id` whose canonical spelling is `config_json`."""
        row = self.db.execute(
            f"SELECT {self._task_columns()} FROM tasks WHERE env_id = ? AND config_json = ?",
            (env_id, config_json),
        ).fetchone()
        return None if row is None else self._task(row)

    def task_source(self, env_id: str, config_json: str) -> str:
        """The sha256 of the code the task (by its canonical config) was recorded with, when it is
        not its environment's; "" otherwise. What every create asks: one indexed column, not the
        task's published fields."""
        if "source_sha" not in self._task_columns():
            return ""
        row = self.db.execute(
            "SELECT source_sha FROM tasks WHERE env_id = ? AND config_json = ?", (env_id, config_json)
        ).fetchone()
        return "" if row is None else str(row[0])

    def tasks_of(self, env_id: str) -> list[TaskRecord]:
        rows = self.db.execute(
            f"SELECT {self._task_columns()} FROM tasks WHERE env_id = ? ORDER BY id", (env_id,)
        )
        return [self._task(row) for row in rows]

    def variant(self, sha256: str) -> EnvRecord | None:
        """The environment as a task recorded with other code saw it: its env's record with the
        variant's source and tools (no task configs)."""
        if "variants" not in self._tables():
            return None
        row = self.db.execute(
            "SELECT env_id, source, tools_json, tools_text FROM variants WHERE sha256 = ?", (sha256,)
        ).fetchone()
        if row is None:
            return None
        env = self.get(row[0], tasks=False)
        if env is None:
            return None
        return dataclasses.replace(
            env, source=row[1], sha256=sha256, tools=tools_of(row[2]), tools_text=row[3], tasks=[]
        )

    def source_of(self, sha256: str) -> str | None:
        """The source text whose sha256 this is, from an environment or a variant."""
        row = self.db.execute("SELECT source FROM envs WHERE sha256 = ? LIMIT 1", (sha256,)).fetchone()
        if row is None and "variants" in self._tables():
            row = self.db.execute("SELECT source FROM variants WHERE sha256 = ?", (sha256,)).fetchone()
        return None if row is None else str(row[0])

    def counts(self) -> tuple[int, int]:
        envs = self.db.execute("SELECT COUNT(*) FROM envs").fetchone()[0]
        tasks = self.db.execute("SELECT COUNT(*) FROM tasks").fetchone()[0]
        return int(envs), int(tasks)

    def _tables(self) -> set[str]:
        if self._table_names is None:
            self._table_names = {
                row[0] for row in self.db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
            }
        return self._table_names

    def _task_columns(self) -> str:
        """The task columns `_task` reads; in a read-only library written before a column existed,
        its default instead (`TASK_COLUMNS`)."""
        if self._task_select is None:
            have = {row[1] for row in self.db.execute("PRAGMA table_info(tasks)")}
            defaults = {"scores": "'{}'", "guess_rate": "NULL", "config_text": "''", "source_sha": "''"}
            defaults["extra"] = "'{}'"
            defaults["learnability"] = "''"
            optional = [name if name in have else defaults[name] for name in TASK_COLUMNS]
            self._task_select = ", ".join(
                ["env_id", "config_json", "difficulty", "solve_fc_round", *optional]
            )
        return self._task_select

    @staticmethod
    def _task(row: tuple[Any, ...]) -> TaskRecord:
        env_id, config_json, difficulty, rounds, scores, guess, text, sha, extra, learnability = row
        return TaskRecord(
            env_id,
            config_json,
            difficulty,
            rounds,
            json.loads(scores),
            guess,
            config_text=text,
            source_sha=sha,
            extra=json.loads(extra),
            learnability=learnability,
        )

    def set_scores(self, scores: Iterable[tuple[str, str, str, float]]) -> int:
        """Record (env_id, config_json, score name, value) for task configs in the library; returns how many matched."""
        matched = 0
        touched: set[str] = set()
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
                touched.add(env_id)
            search_index.refresh(self.db, touched)
        return matched

    def set_learnability(self, labels: Iterable[tuple[str, str, str]]) -> int:
        """Record (env_id, config_json, label) for task configs in the library (the config in its
        canonical spelling, `canonical_config`); returns how many matched."""
        matched = 0
        touched: set[str] = set()
        with self.db:
            for env_id, config_json, label in labels:
                changed = self.db.execute(
                    "UPDATE tasks SET learnability = ? WHERE env_id = ? AND config_json = ?",
                    (label, env_id, config_json),
                ).rowcount
                matched += changed
                if changed:
                    touched.add(env_id)
            search_index.refresh(self.db, touched)
        return matched

    def search(self, query: search_index.Query) -> tuple[list[search_index.Hit], str, int]:
        """A page of environments matching `query` (search.py), the next page's token and the
        number matching."""
        if self._search_schema is None:
            if search_index.has_index(self.db):
                self._search_schema = "main"
            else:
                self.db.execute("ATTACH DATABASE ':memory:' AS search")
                with self.db:
                    count = search_index.refresh(self.db, schema="search")
                logging.getLogger(__name__).info(
                    "library %s has no search index: %d environments indexed in memory", self.path, count
                )
                self._search_schema = "search"
        return search_index.search(self.db, query, self._search_schema)

    @staticmethod
    def _record(row: tuple[Any, ...], tasks: list[TaskRecord]) -> EnvRecord:
        return EnvRecord(
            env_id=row[0],
            code_id=row[1],
            env_class=row[2],
            source=row[3],
            sha256=row[4],
            tools=tools_of(row[5]),
            tools_text=row[6],
            task_text=row[7],
            metadata=json.loads(row[8]),
            tasks=tasks,
        )


def tools_of(tools_json: str) -> list[Tool]:
    return [Tool(t["name"], t["signature"], t["text"], t["schema"]) for t in json.loads(tools_json)]


def load_library(path: str | Path) -> dict[str, EnvRecord]:
    """Open, read everything, close: the runtime's start-up (and reload) path."""
    if not Path(path).exists():
        raise FileNotFoundError(f"library {path} does not exist: build it with 'codegym library import'")
    with closing(Library(path, read_only=True)) as library:
        return library.load_all()

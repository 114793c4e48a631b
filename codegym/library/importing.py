"""Writing into the environment library: everything CodeGym publishes (read by library_published.py),
checked statically, a batch per transaction.

Nothing is executed: a source is compiled (so code this Python cannot compile never reaches a
jail) and read by the contract checker (`ast`), and each distinct source is checked once per import,
in worker processes when a batch brings many. Each batch of rows is one transaction, so an import
that stops (a broken shard, Ctrl-C) leaves whole batches behind, and running it again adds what is
missing and reports the rest present: importing is idempotent.

What is never done silently: an environment key met with other code (a changed file, CodeGym's
English and Chinese sets sharing a key) is a conflict, refused unless `on_conflict` says to keep
the library's code or replace it; a task row recorded with code other than its environment's keeps
its own code (a row of `variants`, the task's `source_sha`); every row skipped is counted with its
reason. Functions of the library's SQLite connection: `Library` (library.py) owns the connection and
its schema and hands it over.

Checking a source is library_analysis.py's, writing one environment or task library_writes.py's;
this module reads the sources and decides what becomes of each row.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from codegym.contract import EnvStringError, parse_config, sha256_text
from codegym.library.analysis import PYTHON, Analyzer, unfit
from codegym.library.published import BadRow, EnvRow, Row, Source, TaskRow, find_sources
from codegym.library.records import (
    ON_CONFLICT,
    Conflict,
    ImportReport,
    SourceReport,
    TaskRecord,
    canonical_config,
)
from codegym.library.writes import (
    add_task,
    find_task,
    insert_task,
    keep_recordings,
    merge_task,
    put_environment,
    store_env,
)

# What was imported from here before checking (library_analysis.py) and single writes
# (library_writes.py) had modules of their own.
__all__ = [
    "ON_CONFLICT",
    "PYTHON",
    "ImportProgress",
    "add_task",
    "import_paths",
    "put_environment",
]


class ImportProgress(Protocol):
    """Told what an import reads, for a progress bar: each source, then its rows as they are read."""

    def start(self, name: str, total: int | None) -> None: ...

    def advance(self, rows: int) -> None: ...


def import_paths(
    db: sqlite3.Connection,
    paths: Iterable[str | Path],
    *,
    on_conflict: str = "refuse",
    progress: ImportProgress | None = None,
    jobs: int | None = None,
) -> ImportReport:
    """Import every source under `paths` (library_published.py says which forms), a batch per
    transaction. `on_conflict` decides for an environment key whose code differs from the
    library's: "refuse" it (reported), "keep" the library's, or "replace" it."""
    if on_conflict not in ON_CONFLICT:
        raise ValueError(f"on_conflict must be one of {', '.join(ON_CONFLICT)}, not {on_conflict!r}")
    sources, problems = find_sources(paths)
    report = ImportReport()
    for problem in problems:
        report.source(problem.where, "file").skip(problem.reason, problem.where, problem.detail)
    # Durable at each checkpoint rather than each commit: a batch stays atomic, and an import is
    # thousands of commits.
    db.execute("PRAGMA synchronous = NORMAL")
    analyzer = Analyzer(jobs)
    try:
        writer = Writer(db, report, analyzer, on_conflict)
        for source in sources:
            writer.read(source, progress)
    finally:
        analyzer.close()
    return report


@dataclass(frozen=True)
class KnownEnv:
    sha256: str
    task_text: str


class Writer:
    """Writes rows into the library, a batch per transaction, and counts what became of each."""

    def __init__(
        self, db: sqlite3.Connection, report: ImportReport, analyzer: Analyzer, on_conflict: str
    ) -> None:
        self.db = db
        self.report = report
        self.analyzer = analyzer
        self.on_conflict = on_conflict
        # Environment rows met in this import ("env_id sha256") -> the source first read from, so a
        # copy of a table (the card's data/envs_*.parquet) is told apart from new rows.
        self.envs_seen: dict[str, str] = {}
        # Tasks met in this import (8-byte digests of env id and canonical config).
        self.tasks_seen: set[bytes] = set()
        self._last_code = ("", "")  # (source, sha256): task rows repeat their env's code

    def read(self, source: Source, progress: ImportProgress | None) -> None:
        counts = self.report.source(source.name, source.kind)
        if progress is not None:
            progress.start(source.name, source.total)
        for batch in source.batches():
            self.write(batch, counts)
            if progress is not None:
                progress.advance(sum(row.rows if isinstance(row, BadRow) else 1 for row in batch))
            del batch  # not held while the next batch is read

    def write(self, batch: list[Row], counts: SourceReport) -> None:
        """One batch, one transaction."""
        self.analyzer.prefetch(self._to_analyze(batch))
        with self.db:
            for row in batch:
                if isinstance(row, BadRow):
                    counts.rows += row.rows
                    counts.skip(row.reason, row.where, row.detail)
                elif isinstance(row, EnvRow):
                    counts.rows += 1
                    self.env_row(row, counts)
                else:
                    counts.rows += 1
                    self.task_row(row, counts)
        self.analyzer.end_batch()

    # ---- environments ---------------------------------------------------------------------------

    def env_row(self, row: EnvRow, counts: SourceReport) -> None:
        sha = sha256_text(row.source)
        seen = f"{row.env_id} {sha}"
        first = self.envs_seen.get(seen)
        if first is not None:
            counts.env_duplicates[first] = counts.env_duplicates.get(first, 0) + 1
            return
        known = self.known_env(row.env_id)
        if known is not None and known.sha256 == sha:
            self.envs_seen[seen] = counts.name
            if row.task_text and row.task_text != known.task_text:
                self.db.execute("UPDATE envs SET task_text = ? WHERE env_id = ?", (row.task_text, row.env_id))
                counts.envs_updated += 1
                self.report.updated.append(row.env_id)
            else:
                counts.envs_unchanged += 1
                self.report.unchanged.append(row.env_id)
            return
        if known is not None and self.on_conflict != "replace":
            self.envs_seen[seen] = counts.name
            self._conflict(row, "refused" if self.on_conflict == "refuse" else "kept")
            counts.conflicts += 1
            return
        failure = self.write_env(row, sha, replacing=known)
        if failure is not None:
            counts.skip(*failure)
            return
        self.envs_seen[seen] = counts.name
        if known is not None:
            self._conflict(row, "replaced")
            counts.envs_updated += 1
            self.report.updated.append(row.env_id)
        else:
            counts.envs_added += 1
            self.report.added.append(row.env_id)

    def known_env(self, env_id: str) -> KnownEnv | None:
        row = self.db.execute("SELECT sha256, task_text FROM envs WHERE env_id = ?", (env_id,)).fetchone()
        return None if row is None else KnownEnv(row[0], row[1])

    def write_env(self, row: EnvRow, sha: str, *, replacing: KnownEnv | None) -> tuple[str, str, str] | None:
        """Check and write an environment; (reason, where, detail) when it cannot serve."""
        analysis = self.analyzer.get(row.source, sha)
        failure = unfit(analysis, row.env_id)
        if failure is not None:
            return failure[0], row.where, failure[1]
        if replacing is not None:
            keep_recordings(self.db, row.env_id, replacing.sha256, sha)
        store_env(self.db, row.env_id, row.source, analysis, task_text=row.task_text, metadata=row.metadata)
        return None

    def _conflict(self, row: EnvRow, resolution: str) -> None:
        held = self.db.execute("SELECT metadata FROM envs WHERE env_id = ?", (row.env_id,)).fetchone()
        other = str(json.loads(held[0]).get("file") or "") if held else ""
        here = str(row.metadata.get("file") or row.where)
        self.report.conflicts.append(Conflict(row.env_id, here, other or "the library", resolution))

    # ---- tasks ----------------------------------------------------------------------------------

    def task_row(self, row: TaskRow, counts: SourceReport) -> None:
        try:
            config_json = canonical_config(parse_config(row.config_text))
        except (EnvStringError, TypeError, ValueError) as exc:
            counts.skip("invalid config", row.where, str(exc))
            return
        env = self.known_env(row.env_id)
        if env is None and row.gym_env is not None:
            # A task row whose env is nowhere else brings it: its own code, under the ability's key.
            made = EnvRow(row.where, row.env_id, row.gym_env, row.task_text, {"file": counts.name})
            failure = self.write_env(made, self._sha(row.gym_env), replacing=None)
            if failure is not None:
                counts.skip(*failure)
                return
            self.envs_seen[f"{row.env_id} {self._sha(row.gym_env)}"] = counts.name
            counts.envs_added += 1
            self.report.added.append(row.env_id)
            env = self.known_env(row.env_id)
        if env is None:
            detail = f"environment {row.env_id} is not in the library: import its source first"
            counts.skip("environment not in the library", row.where, detail)
            return
        digest = hashlib.blake2b(f"{row.env_id}\0{config_json}".encode(), digest_size=8).digest()
        if digest in self.tasks_seen:
            counts.task_duplicates += 1
            return
        source_sha = ""
        if row.gym_env is not None and self._sha(row.gym_env) != env.sha256:
            source_sha = self._sha(row.gym_env)
            counts.other_code += 1
        config_text = "" if row.config_text == config_json else row.config_text
        task = TaskRecord(
            row.env_id,
            config_json,
            row.difficulty,
            row.solve_fc_round,
            row.scores,
            config_text=config_text,
            source_sha=source_sha,
            extra=row.extra,
        )
        existing = find_task(self.db, row.env_id, config_json)
        if existing is not None:
            task_id = merge_task(self.db, existing, task)
            counts.tasks_present += 1
        else:
            if source_sha:
                unfit = self._variant(row.env_id, row.gym_env or "", source_sha)
                if unfit is not None:
                    counts.skip(unfit[0], row.where, unfit[1])
                    return
            task_id = insert_task(self.db, task, counts.name)
            counts.tasks_added += 1
        if row.trajectory is not None:
            counts.trajectories += self.db.execute(
                "INSERT OR IGNORE INTO trajectories (task_id, std_traj, obs_traj) VALUES (?, ?, ?)",
                (task_id, *row.trajectory),
            ).rowcount
        self.tasks_seen.add(digest)
        if row.task_text and not env.task_text:
            self.db.execute("UPDATE envs SET task_text = ? WHERE env_id = ?", (row.task_text, row.env_id))

    def _variant(self, env_id: str, source: str, sha: str) -> tuple[str, str] | None:
        """Keep the code a task was recorded with (checked like an environment's), once."""
        if self.db.execute("SELECT 1 FROM variants WHERE sha256 = ?", (sha,)).fetchone():
            return None
        analysis = self.analyzer.get(source, sha)
        failure = unfit(analysis, env_id)
        if failure is not None:
            return f"recorded code: {failure[0]}", failure[1]
        self.db.execute(
            "INSERT INTO variants (sha256, env_id, source, tools_json, tools_text) VALUES (?, ?, ?, ?, ?)",
            (sha, env_id, source, analysis.tools_json, analysis.tools_text),
        )
        return None

    def _sha(self, source: str) -> str:
        if source != self._last_code[0]:
            self._last_code = (source, sha256_text(source))
        return self._last_code[1]

    def _to_analyze(self, batch: list[Row]) -> dict[str, str]:
        """The sources this batch will need checked (sha256 -> source), so they are checked together."""
        wanted: dict[str, str] = {}
        for row in batch:
            if isinstance(row, EnvRow):
                sha = sha256_text(row.source)
                if f"{row.env_id} {sha}" in self.envs_seen:
                    continue
                known = self.known_env(row.env_id)
                if known is None or (known.sha256 != sha and self.on_conflict == "replace"):
                    wanted[sha] = row.source
            elif isinstance(row, TaskRow) and row.gym_env is not None:
                sha = self._sha(row.gym_env)
                known = self.known_env(row.env_id)
                if known is None or (
                    known.sha256 != sha
                    and not self.db.execute("SELECT 1 FROM variants WHERE sha256 = ?", (sha,)).fetchone()
                ):
                    wanted[sha] = row.gym_env
        return wanted

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
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import sqlite3
import sys
import time
import warnings
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from codegym.contract import (
    EnvStringError,
    analyze_source,
    parse_config,
    sha256_text,
    split_env_id,
    tool_text,
    tools_schema,
    tools_text,
)
from codegym.library_published import BadRow, EnvRow, Row, Source, TaskRow, find_sources
from codegym.library_records import Conflict, ImportReport, SourceReport, TaskRecord, canonical_config

ON_CONFLICT = ("refuse", "keep", "replace")
# Sources to check in a batch before worker processes are worth starting for them.
PARALLEL_MIN = 16
PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"


class ImportProgress(Protocol):
    """Told what an import reads, for a progress bar: each source, then its rows as they are read."""

    def start(self, name: str, total: int | None) -> None: ...

    def advance(self, rows: int) -> None: ...


@dataclass(frozen=True)
class Analysis:
    """What the contract checker makes of one source: its class and tools, or why it cannot serve."""

    sha256: str
    env_class: str = ""
    tools_json: str = ""
    tools_text: str = ""
    reason: str = ""  # "" = it can serve
    detail: str = ""


def analyze(source: str) -> Analysis:
    """Compile `source` (this Python's parser and compiler, nothing run) and check it statically."""
    digest = sha256_text(source)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SyntaxWarnings of LLM-written code are not the import's
        try:
            compile(source, "<env>", "exec", dont_inherit=True)
        except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
            line = getattr(exc, "lineno", None)
            detail = f"{getattr(exc, 'msg', None) or exc}" + (f" (line {line})" if line else "")
            return Analysis(digest, reason=f"does not compile on Python {PYTHON}", detail=detail)
    spec = analyze_source(source)
    if spec.violations:
        detail = "; ".join(f"{v.code}: {v.message}" for v in spec.violations[:5])
        return Analysis(digest, reason="contract violations", detail=detail)
    tools = [
        {"name": t.name, "signature": t.signature, "text": tool_text(t), "schema": s}
        for t, s in zip(spec.tools, tools_schema(spec), strict=True)
    ]
    return Analysis(digest, spec.class_name, json.dumps(tools), tools_text(spec))


class Analyzer:
    """Each distinct source analysed once per import.

    A batch's sources are analysed together, in worker processes when there are many (a compile and
    the contract checker cost about 15 ms a source: the published 22,366 environments are minutes
    of one core). What failed is remembered for the whole import (task rows repeat their code in
    every row); what passed only for the batch, which writes it into the library.
    """

    def __init__(self, jobs: int | None = None) -> None:
        self.jobs = jobs or len(os.sched_getaffinity(0))
        self._pool: ProcessPoolExecutor | None = None
        self._batch: dict[str, Analysis] = {}
        self._failed: dict[str, Analysis] = {}

    def prefetch(self, sources: dict[str, str]) -> None:
        """Analyse these sources (by sha256) now, side by side when there are enough of them."""
        todo = [s for sha, s in sources.items() if sha not in self._failed and sha not in self._batch]
        results: Iterable[Analysis] = ()
        if self.jobs > 1 and len(todo) >= PARALLEL_MIN:
            try:
                results = list(
                    self._workers().map(analyze, todo, chunksize=max(1, len(todo) // (4 * self.jobs)))
                )
            except BrokenProcessPool:  # a worker died (a source crashing the compiler): go on here
                self._pool = None
        for analysis in results or map(analyze, todo):
            self._keep(analysis)

    def get(self, source: str, sha: str) -> Analysis:
        found = self._failed.get(sha) or self._batch.get(sha)
        if found is None:
            found = analyze(source)
            self._keep(found)
        return found

    def end_batch(self) -> None:
        self._batch.clear()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None

    def _keep(self, analysis: Analysis) -> None:
        (self._failed if analysis.reason else self._batch)[analysis.sha256] = analysis

    def _workers(self) -> ProcessPoolExecutor:
        if self._pool is None:
            # spawn: the importing process may hold threads (a progress bar) that fork must not copy.
            context = multiprocessing.get_context("spawn")
            self._pool = ProcessPoolExecutor(max_workers=self.jobs, mp_context=context)
        return self._pool


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
        failure = _unfit(analysis, row.env_id)
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
        failure = _unfit(analysis, env_id)
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


def _unfit(analysis: Analysis, env_id: str) -> tuple[str, str] | None:
    """(reason, detail) when checked code cannot serve as environment `env_id`."""
    if analysis.reason:
        return analysis.reason, f"{env_id}: {analysis.detail}"
    env_class = split_env_id(env_id)[1]
    if analysis.env_class != env_class:
        return "wrong env class", f"the source defines {analysis.env_class}, not {env_class}"
    return None


def store_env(
    db: sqlite3.Connection,
    env_id: str,
    source: str,
    analysis: Analysis,
    *,
    task_text: str,
    metadata: dict[str, Any],
) -> None:
    """Write an environment (new, or its code replaced); an empty task text keeps the one stored."""
    code_id, env_class = split_env_id(env_id)
    db.execute(
        "INSERT INTO envs (env_id, code_id, env_class, source, sha256, tools_json, tools_text, task_text,"
        " metadata, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
        " ON CONFLICT(env_id) DO UPDATE SET source = excluded.source, sha256 = excluded.sha256,"
        " tools_json = excluded.tools_json, tools_text = excluded.tools_text,"
        " task_text = CASE excluded.task_text WHEN '' THEN envs.task_text ELSE excluded.task_text END,"
        " metadata = excluded.metadata, updated_at = excluded.updated_at",
        (
            env_id,
            code_id,
            env_class,
            source,
            analysis.sha256,
            analysis.tools_json,
            analysis.tools_text,
            task_text,
            json.dumps(metadata, ensure_ascii=False, default=str),
            time.time(),
        ),
    )


def keep_recordings(db: sqlite3.Connection, env_id: str, old_sha: str, new_sha: str) -> None:
    """Before an environment's code is replaced: tasks that carry a reference trajectory recorded
    with the old code keep that code (a variant); tasks recorded with the new code now have it."""
    recorded = "env_id = ? AND source_sha = '' AND id IN (SELECT task_id FROM trajectories)"
    if db.execute(f"SELECT 1 FROM tasks WHERE {recorded} LIMIT 1", (env_id,)).fetchone():
        db.execute(
            "INSERT OR IGNORE INTO variants (sha256, env_id, source, tools_json, tools_text)"
            " SELECT sha256, env_id, source, tools_json, tools_text FROM envs WHERE env_id = ?",
            (env_id,),
        )
        db.execute(f"UPDATE tasks SET source_sha = ? WHERE {recorded}", (old_sha, env_id))
    db.execute("UPDATE tasks SET source_sha = '' WHERE env_id = ? AND source_sha = ?", (env_id, new_sha))


def put_environment(
    db: sqlite3.Connection,
    env_id: str,
    source: str,
    *,
    task_text: str,
    metadata: dict[str, Any],
    tasks: Iterable[TaskRecord],
) -> ImportReport:
    """One verified environment and exactly these task configs (the pipeline's output), replacing
    the environment's code and task configs if it had any: a pipeline run is the authority."""
    report = ImportReport()
    counts = report.source("pipeline", "pipeline")
    analysis = analyze(source)
    failure = _unfit(analysis, env_id)
    if failure is not None:
        counts.skip(failure[0], env_id, failure[1])
        return report
    existed = db.execute("SELECT 1 FROM envs WHERE env_id = ?", (env_id,)).fetchone() is not None
    store_env(db, env_id, source, analysis, task_text=task_text, metadata=metadata)
    db.execute("DELETE FROM tasks WHERE env_id = ?", (env_id,))
    (report.updated if existed else report.added).append(env_id)
    for task in tasks:
        if add_task(db, task, "pipeline"):
            counts.tasks_added += 1
        else:
            counts.tasks_present += 1
    return report


# ---- task rows: one spelling per config (`canonical_config`), the published text kept -----------

TASK_FIELDS = "id, difficulty, solve_fc_round, scores, extra, guess_rate"


def find_task(db: sqlite3.Connection, env_id: str, config_json: str) -> tuple[Any, ...] | None:
    row: tuple[Any, ...] | None = db.execute(
        f"SELECT {TASK_FIELDS} FROM tasks WHERE env_id = ? AND config_json = ?", (env_id, config_json)
    ).fetchone()
    return row


def insert_task(db: sqlite3.Connection, task: TaskRecord, origin: str) -> int:
    cursor = db.execute(
        "INSERT INTO tasks (env_id, config_json, difficulty, solve_fc_round, origin, scores, guess_rate,"
        " config_text, source_sha, extra) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (
            task.env_id,
            task.config_json,
            task.difficulty,
            task.solve_fc_round,
            origin,
            json.dumps(task.scores),
            task.guess_rate,
            task.config_text,
            task.source_sha,
            json.dumps(task.extra, ensure_ascii=False, default=str),
        ),
    )
    return int(cursor.lastrowid or 0)


def merge_task(db: sqlite3.Connection, existing: tuple[Any, ...], task: TaskRecord) -> int:
    """A task seen again keeps what it had and learns what it lacked (difficulty, oracle rounds,
    scores, guessability, published fields); written only when something was learnt."""
    task_id, difficulty, rounds, scores, extra, guess = existing
    had = json.loads(scores)
    merged = {**task.scores, **had}
    learnt = (
        difficulty or task.difficulty,
        rounds or task.solve_fc_round,
        merged,
        extra if extra != "{}" or not task.extra else json.dumps(task.extra, ensure_ascii=False, default=str),
        task.guess_rate if task.guess_rate is not None else guess,
    )
    if learnt != (difficulty, rounds, had, extra, guess):
        db.execute(
            "UPDATE tasks SET difficulty = ?, solve_fc_round = ?, scores = ?, extra = ?, guess_rate = ?"
            " WHERE id = ?",
            (learnt[0], learnt[1], json.dumps(merged), learnt[3], learnt[4], task_id),
        )
    return int(task_id)


def add_task(db: sqlite3.Connection, task: TaskRecord, origin: str) -> bool:
    """Insert a task config, or merge it into the one stored; True when it was new."""
    existing = find_task(db, task.env_id, task.config_json)
    if existing is None:
        insert_task(db, task, origin)
        return True
    merge_task(db, existing, task)
    return False

"""Rows written into the library one at a time: an environment (its code replaced, the recordings
made with the old code kept), the pipeline's verified environment with its task configs, and task
rows, one spelling per config. Functions of the library's SQLite connection, as importing is
(library_import.py); the caller holds the transaction."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterable
from typing import Any

from codegym.contract import split_env_id
from codegym.library.analysis import Analysis, analyze, unfit
from codegym.library.records import ImportReport, TaskRecord


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
    failure = unfit(analysis, env_id)
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

"""Importing into the environment library: env files (`{code_id}__{Env}.py`), folders of them,
and CodeGym task / training-instance JSONL. Everything is read statically (the contract checker's
`ast` reading); nothing is executed.

Functions of the library's SQLite connection rather than methods: `Library` (library.py) owns
the connection and its schema and hands it over, so what these read and write is in their
arguments. `import_paths` is one transaction (an import lands whole or not at all); the others
leave the transaction to their caller, so `Library.put_environment` can replace an environment
and its task configs at once.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from codegym.contract import (
    ContractError,
    EnvStringError,
    analyze_source,
    parse_ability,
    split_env_id,
    tool_text,
    tools_schema,
    tools_text,
)
from codegym.library_records import (
    DIFFICULTIES,
    ImportReport,
    TaskRecord,
    canonical_config,
    task_text_from_prompt,
)


def import_paths(db: sqlite3.Connection, paths: Iterable[str | Path]) -> ImportReport:
    """Import env files (`{code_id}__{Env}.py`), folders of them, and training-instance JSONL.

    Sources go first, so that a JSONL naming an env imported in the same call finds it.
    """
    report = ImportReport()
    sources: list[Path] = []
    jsonl: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            sources += sorted(p for p in path.rglob("*.py") if p.name != "__init__.py")
            jsonl += sorted(path.rglob("*.jsonl"))
        elif path.suffix == ".py":
            sources.append(path)
        elif path.suffix in (".jsonl", ".json"):
            jsonl.append(path)
        elif not path.exists():
            report.skipped.append((str(path), "no such file or folder"))
        else:
            report.skipped.append((str(path), "not a .py env file, a folder or a .jsonl file"))
    with db:
        for path in sources:
            report.merge(import_env_file(db, path))
        for path in jsonl:
            report.merge(import_jsonl(db, path))
    return report


def import_env_file(db: sqlite3.Connection, path: Path) -> ImportReport:
    """One `{code_id}__{Env}.py` file, with its task text from a `.task.md` beside it if any."""
    report = ImportReport()
    try:
        split_env_id(path.stem)
    except EnvStringError:
        report.skipped.append((str(path), "file name is not {code_id}__{EnvClass}.py"))
        return report
    try:
        source = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        report.skipped.append((str(path), f"unreadable: {exc}"))
        return report
    task_file = path.with_suffix(".task.md")
    task_text = task_file.read_text(encoding="utf-8").strip() if task_file.exists() else ""
    report = import_source(db, path.stem, source, task_text=task_text, metadata={"file": path.name})
    report.skipped = [(str(path), why) for _, why in report.skipped]
    return report


def import_source(
    db: sqlite3.Connection, env_id: str, source: str, *, task_text: str, metadata: dict[str, Any]
) -> ImportReport:
    """Add or update one environment from its source, checked statically against the contract;
    an unchanged source (same sha256, no new task text) is reported unchanged, not rewritten."""
    report = ImportReport()
    try:
        code_id, env_class = split_env_id(env_id)
    except EnvStringError as exc:
        report.skipped.append((env_id, str(exc)))
        return report
    spec = analyze_source(source)
    if spec.violations:
        reasons = "; ".join(f"{v.code}: {v.message}" for v in spec.violations[:5])
        report.skipped.append((env_id, f"contract violations: {reasons}"))
        return report
    if spec.class_name != env_class:
        report.skipped.append((env_id, f"the source defines {spec.class_name}, not {env_class}"))
        return report
    schemas = tools_schema(spec)
    tools = [
        {"name": t.name, "signature": t.signature, "text": tool_text(t), "schema": s}
        for t, s in zip(spec.tools, schemas, strict=True)
    ]
    row = db.execute("SELECT sha256, task_text FROM envs WHERE env_id = ?", (env_id,)).fetchone()
    if row is not None and row[0] == spec.sha256 and (not task_text or row[1] == task_text):
        report.unchanged.append(env_id)
        return report
    if row is not None and not task_text:
        task_text = row[1]
    db.execute(
        "INSERT INTO envs (env_id, code_id, env_class, source, sha256, tools_json, tools_text, task_text,"
        " metadata, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
        " ON CONFLICT(env_id) DO UPDATE SET source = excluded.source, sha256 = excluded.sha256,"
        " tools_json = excluded.tools_json, tools_text = excluded.tools_text,"
        " task_text = excluded.task_text, metadata = excluded.metadata, updated_at = excluded.updated_at",
        (
            env_id,
            code_id,
            env_class,
            source,
            spec.sha256,
            json.dumps(tools),
            tools_text(spec),
            task_text,
            json.dumps(metadata),
            time.time(),
        ),
    )
    (report.updated if row is not None else report.added).append(env_id)
    return report


def import_jsonl(db: sqlite3.Connection, path: Path) -> ImportReport:
    """Task configs from training instances (`ability`, ...) or task lines (`env_id`, `config`)."""
    report = ImportReport()
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        report.skipped.append((str(path), f"unreadable: {exc}"))
        return report
    for number, line in enumerate(lines, 1):
        where = f"{path}:{number}"
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            if not isinstance(item, dict):
                raise ValueError("line is not a JSON object")
            task, task_text = task_from_item(item)
        except (ValueError, EnvStringError, ContractError) as exc:
            report.skipped.append((where, str(exc)))
            continue
        known = db.execute("SELECT task_text FROM envs WHERE env_id = ?", (task.env_id,)).fetchone()
        if known is None:
            report.skipped.append(
                (where, f"environment {task.env_id} is not in the library: import its source first")
            )
            continue
        if task_text and not known[0]:
            db.execute("UPDATE envs SET task_text = ? WHERE env_id = ?", (task_text, task.env_id))
        add_task(db, task, str(path.name), report)
    return report


def task_from_item(item: dict[str, Any]) -> tuple[TaskRecord, str]:
    """A JSONL line as a task config and the task text its prompt carries ("" for a task line)."""
    if "ability" in item:
        ability = parse_ability(str(item["ability"]))
        extra = item.get("extra_info")
        rounds = int(extra.get("solve_fc_round") or 0) if isinstance(extra, dict) else 0
        prompt = item.get("prompt")
        prompt = prompt if isinstance(prompt, list) else []
        task = TaskRecord(ability.env_id, canonical_config(ability.config), "", rounds)
        return task, task_text_from_prompt(prompt)
    if "env_id" in item and isinstance(item.get("config"), dict):
        split_env_id(str(item["env_id"]))
        difficulty = str(item.get("difficulty", "")).lower()
        if difficulty not in DIFFICULTIES:
            raise ValueError(f"difficulty {difficulty!r} is not easy, medium or hard")
        rounds = int(item.get("solve_fc_round") or 0)
        return TaskRecord(str(item["env_id"]), canonical_config(item["config"]), difficulty, rounds), ""
    raise ValueError("line has neither 'ability' (training instance) nor 'env_id' + 'config' (task)")


def add_task(db: sqlite3.Connection, task: TaskRecord, origin: str, report: ImportReport) -> None:
    """Insert a task config, or merge it into the one already stored (counted in `report`)."""
    row = db.execute(
        "SELECT id, difficulty, solve_fc_round FROM tasks WHERE env_id = ? AND config_json = ?",
        (task.env_id, task.config_json),
    ).fetchone()
    if row is None:
        db.execute(
            "INSERT INTO tasks (env_id, config_json, difficulty, solve_fc_round, origin, guess_rate)"
            " VALUES (?, ?, ?, ?, ?, ?)",
            (
                task.env_id,
                task.config_json,
                task.difficulty,
                task.solve_fc_round,
                origin,
                task.guess_rate,
            ),
        )
        report.tasks_added += 1
        return
    # A task seen again keeps what it had, and learns what it lacked (difficulty, oracle rounds).
    db.execute(
        "UPDATE tasks SET difficulty = ?, solve_fc_round = ?, guess_rate = COALESCE(?, guess_rate)"
        " WHERE id = ?",
        (row[1] or task.difficulty, row[2] or task.solve_fc_round, task.guess_rate, row[0]),
    )
    report.tasks_present += 1

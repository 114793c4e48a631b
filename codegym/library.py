"""The environment library: one SQLite file holding environment sources and task configs.

Everything stored here is derived statically (with the contract checker's `ast` reading), so
importing never runs environment code. The runtime loads the whole library into memory at start:
a few thousand environments are a few tens of MB, and a step must not wait on disk.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterable
from contextlib import closing
from dataclasses import dataclass, field
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
DIFFICULTIES = ("", "easy", "medium", "hard")
QUESTION_MARKER = "\nQuestion:\n"


@dataclass(frozen=True)
class Tool:
    """One agent-facing tool, as stored: name, signature line, CodeGym text and OpenAI schema."""

    name: str
    signature: str
    text: str
    schema: dict[str, Any]


@dataclass(frozen=True)
class TaskRecord:
    env_id: str
    config_json: str
    difficulty: str = ""
    solve_fc_round: int = 0
    # Success rates of evaluated models, e.g. {"gpt-4o-mini_Bo4_score": 0.25} (`codegym eval`).
    scores: dict[str, float] = field(default_factory=dict, compare=False)
    # The chance a blind Done is right on this config (verification's guessability), None = unmeasured.
    guess_rate: float | None = field(default=None, compare=False)


@dataclass
class EnvRecord:
    """Everything the runtime needs about an environment, without ever importing it."""

    env_id: str
    code_id: str
    env_class: str
    source: str
    sha256: str
    tools: list[Tool]
    tools_text: str
    task_text: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    tasks: list[TaskRecord] = field(default_factory=list)

    @property
    def tool_names(self) -> list[str]:
        return [t.name for t in self.tools]


@dataclass
class ImportReport:
    """What an import did, item by item, so nothing is skipped silently."""

    added: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    tasks_added: int = 0
    tasks_present: int = 0
    skipped: list[tuple[str, str]] = field(default_factory=list)

    def merge(self, other: ImportReport) -> None:
        self.added += other.added
        self.updated += other.updated
        self.unchanged += other.unchanged
        self.tasks_added += other.tasks_added
        self.tasks_present += other.tasks_present
        self.skipped += other.skipped


def canonical_config(config: dict[str, Any]) -> str:
    """One spelling per config, so re-importing the same task is a no-op.

    Key order is kept: an environment may show its config, and what it shows must not change.
    """
    return json.dumps(config, ensure_ascii=False)


def task_text_from_prompt(prompt: list[dict[str, Any]]) -> str:
    """The task statement of a training instance: the user message after its `Question:` line."""
    for message in prompt:
        if message.get("role") == "user":
            content = str(message.get("content", ""))
            _, sep, question = content.partition(QUESTION_MARKER)
            return (question if sep else content).strip()
    return ""


class Library:
    """A SQLite environment library. Cheap to open; not shared between threads."""

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

    # ---- import -------------------------------------------------------------------------------

    def import_paths(self, paths: Iterable[str | Path]) -> ImportReport:
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
        with self.db:
            for path in sources:
                report.merge(self._import_env_file(path))
            for path in jsonl:
                report.merge(self._import_jsonl(path))
        return report

    def add_tasks(self, tasks: Iterable[TaskRecord], origin: str = "") -> ImportReport:
        report = ImportReport()
        with self.db:
            for task in tasks:
                self._add_task(task, origin, report)
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
            report = self._import_source(env_id, source, task_text=task_text, metadata=metadata)
            if report.skipped:
                return report
            self.db.execute(
                "UPDATE envs SET metadata = ?, task_text = ? WHERE env_id = ?",
                (json.dumps(metadata), task_text, env_id),
            )
            self.db.execute("DELETE FROM tasks WHERE env_id = ?", (env_id,))
            for task in tasks:
                self._add_task(task, "pipeline", report)
        return report

    def _import_env_file(self, path: Path) -> ImportReport:
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
        report = self._import_source(path.stem, source, task_text=task_text, metadata={"file": path.name})
        report.skipped = [(str(path), why) for _, why in report.skipped]
        return report

    def _import_source(
        self, env_id: str, source: str, *, task_text: str, metadata: dict[str, Any]
    ) -> ImportReport:
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
        row = self.db.execute("SELECT sha256, task_text FROM envs WHERE env_id = ?", (env_id,)).fetchone()
        if row is not None and row[0] == spec.sha256 and (not task_text or row[1] == task_text):
            report.unchanged.append(env_id)
            return report
        if row is not None and not task_text:
            task_text = row[1]
        self.db.execute(
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

    def _import_jsonl(self, path: Path) -> ImportReport:
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
                task, task_text = self._task_from_item(item)
            except (ValueError, EnvStringError, ContractError) as exc:
                report.skipped.append((where, str(exc)))
                continue
            known = self.db.execute("SELECT task_text FROM envs WHERE env_id = ?", (task.env_id,)).fetchone()
            if known is None:
                report.skipped.append(
                    (where, f"environment {task.env_id} is not in the library: import its source first")
                )
                continue
            if task_text and not known[0]:
                self.db.execute("UPDATE envs SET task_text = ? WHERE env_id = ?", (task_text, task.env_id))
            self._add_task(task, str(path.name), report)
        return report

    @staticmethod
    def _task_from_item(item: dict[str, Any]) -> tuple[TaskRecord, str]:
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

    def _add_task(self, task: TaskRecord, origin: str, report: ImportReport) -> None:
        row = self.db.execute(
            "SELECT id, difficulty, solve_fc_round FROM tasks WHERE env_id = ? AND config_json = ?",
            (task.env_id, task.config_json),
        ).fetchone()
        if row is None:
            self.db.execute(
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
        self.db.execute(
            "UPDATE tasks SET difficulty = ?, solve_fc_round = ?, guess_rate = COALESCE(?, guess_rate)"
            " WHERE id = ?",
            (row[1] or task.difficulty, row[2] or task.solve_fc_round, task.guess_rate, row[0]),
        )
        report.tasks_present += 1

    # ---- read ---------------------------------------------------------------------------------

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

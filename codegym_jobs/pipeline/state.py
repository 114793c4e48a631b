"""Per-problem, per-stage status of a pipeline run, in SQLite under the work folder.

A stage that finished (passed or rejected) is final and is never run again: a rerun reads its
outcome and data from here. A stage that failed for a reason outside the generated code (an LLM
endpoint or sandbox workers unreachable) is recorded as an error and run again next time. This is
what makes `codegym pipeline run` resumable at any point.
"""

from __future__ import annotations

import json
import sqlite3
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from codegym.synthesis.v1 import synthesis_service_pb2 as sy

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS problems (
    problem_id  TEXT PRIMARY KEY,
    position    INTEGER NOT NULL,
    row_json    TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS stages (
    problem_id         TEXT NOT NULL,
    stage              TEXT NOT NULL,
    status             TEXT NOT NULL,            -- passed | rejected | error
    reason             TEXT NOT NULL DEFAULT '',
    data               TEXT NOT NULL DEFAULT '{}',
    prompt_tokens      INTEGER NOT NULL DEFAULT 0,
    completion_tokens  INTEGER NOT NULL DEFAULT 0,
    llm_requests       INTEGER NOT NULL DEFAULT 0,
    cache_hits         INTEGER NOT NULL DEFAULT 0,
    wall_s             REAL NOT NULL DEFAULT 0,
    attempts           INTEGER NOT NULL DEFAULT 1,
    finished_at        REAL NOT NULL,
    PRIMARY KEY (problem_id, stage)
);
"""
FINAL = ("passed", "rejected")


@dataclass
class StageOutcome:
    """What one stage did for one problem."""

    status: str
    reason: str = ""
    data: dict[str, Any] = field(default_factory=dict)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    llm_requests: int = 0
    cache_hits: int = 0
    wall_s: float = 0.0

    @property
    def final(self) -> bool:
        return self.status in FINAL


@dataclass
class StageRow:
    """One line of the summary table."""

    stage: str
    entered: int = 0
    passed: int = 0
    rejected: int = 0
    errors: int = 0
    reasons: Counter[str] = field(default_factory=Counter)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    llm_requests: int = 0
    cache_hits: int = 0
    wall_s: float = 0.0


def reason_class(reason: str) -> str:
    """The counting token of a reason `class: detail`."""
    head = reason.split(":", 1)[0].strip()
    return head[:48] if head else "unknown"


class PipelineState:
    """The work folder's `pipeline.db`. One connection, used from the pipeline's event loop thread."""

    def __init__(self, work: str | Path) -> None:
        self.work = Path(work)
        self.work.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.work / "pipeline.db")
        self.db.execute("PRAGMA journal_mode = WAL")
        self.db.execute("PRAGMA synchronous = NORMAL")
        self.db.executescript(SCHEMA)

    @classmethod
    def open_existing(cls, work: str | Path) -> PipelineState:
        if not (Path(work) / "pipeline.db").exists():
            raise FileNotFoundError(f"{work} holds no pipeline run (no pipeline.db)")
        return cls(work)

    def close(self) -> None:
        self.db.close()

    def run_id(self) -> str:
        """Stable for the work folder: every library entry it writes names the same run."""
        row = self.db.execute("SELECT value FROM meta WHERE key = 'run_id'").fetchone()
        if row is not None:
            return str(row[0])
        value = time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:8]
        with self.db:
            self.db.execute("INSERT INTO meta (key, value) VALUES ('run_id', ?)", (value,))
        return value

    def set_meta(self, key: str, value: Any) -> None:
        with self.db:
            self.db.execute(
                "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                (key, json.dumps(value)),
            )

    def meta(self, key: str, default: Any = None) -> Any:
        row = self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return json.loads(row[0]) if row is not None else default

    def add_problems(self, rows: list[tuple[str, dict[str, Any]]]) -> None:
        with self.db:
            for position, (problem_id, row) in enumerate(rows):
                self.db.execute(
                    "INSERT INTO problems (problem_id, position, row_json) VALUES (?, ?, ?)"
                    " ON CONFLICT(problem_id) DO UPDATE SET row_json = excluded.row_json",
                    (problem_id, position, json.dumps(row)),
                )

    def outcome(self, problem_id: str, stage: str) -> StageOutcome | None:
        """The recorded final outcome of a stage, or None when it must (still) run."""
        row = self.db.execute(
            "SELECT status, reason, data, prompt_tokens, completion_tokens, llm_requests, cache_hits, wall_s"
            " FROM stages WHERE problem_id = ? AND stage = ?",
            (problem_id, stage),
        ).fetchone()
        if row is None or row[0] not in FINAL:
            return None
        return StageOutcome(row[0], row[1], json.loads(row[2]), *row[3:])

    def record(self, problem_id: str, stage: str, outcome: StageOutcome) -> None:
        with self.db:
            self.db.execute(
                "INSERT INTO stages (problem_id, stage, status, reason, data, prompt_tokens, completion_tokens,"
                " llm_requests, cache_hits, wall_s, finished_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
                " ON CONFLICT(problem_id, stage) DO UPDATE SET status = excluded.status,"
                " reason = excluded.reason, data = excluded.data,"
                " prompt_tokens = stages.prompt_tokens + excluded.prompt_tokens,"
                " completion_tokens = stages.completion_tokens + excluded.completion_tokens,"
                " llm_requests = stages.llm_requests + excluded.llm_requests,"
                " cache_hits = stages.cache_hits + excluded.cache_hits,"
                " wall_s = stages.wall_s + excluded.wall_s, attempts = stages.attempts + 1,"
                " finished_at = excluded.finished_at",
                (
                    problem_id,
                    stage,
                    outcome.status,
                    outcome.reason,
                    json.dumps(outcome.data),
                    outcome.prompt_tokens,
                    outcome.completion_tokens,
                    outcome.llm_requests,
                    outcome.cache_hits,
                    outcome.wall_s,
                    time.time(),
                ),
            )

    def summary(self, stages: tuple[str, ...]) -> tuple[list[StageRow], int]:
        """Per stage: problems that entered, passed, were rejected (by reason), errors; and the problem count."""
        rows = {stage: StageRow(stage) for stage in stages}
        for stage, status, reason, pt, ct, req, hits, wall in self.db.execute(
            "SELECT stage, status, reason, prompt_tokens, completion_tokens, llm_requests, cache_hits, wall_s"
            " FROM stages"
        ):
            row = rows.setdefault(stage, StageRow(stage))
            row.entered += 1
            if status == "passed":
                row.passed += 1
            elif status == "rejected":
                row.rejected += 1
                row.reasons[reason_class(reason)] += 1
            else:
                row.errors += 1
                row.reasons[f"error: {reason_class(reason)}"] += 1
            row.prompt_tokens += pt
            row.completion_tokens += ct
            row.llm_requests += req
            row.cache_hits += hits
            row.wall_s += wall
        problems = int(self.db.execute("SELECT COUNT(*) FROM problems").fetchone()[0])
        ordered = [rows[s] for s in stages] + [r for s, r in rows.items() if s not in stages]
        return ordered, problems

    def problem_reports(self) -> list[dict[str, Any]]:
        """Where every problem ended: its last stage, status and reason (for `pipeline status --problems`)."""
        order = {pid: pos for pid, pos in self.db.execute("SELECT problem_id, position FROM problems")}
        last: dict[str, tuple[float, str, str, str]] = {}
        for pid, stage, status, reason, at in self.db.execute(
            "SELECT problem_id, stage, status, reason, finished_at FROM stages"
        ):
            if pid not in last or at >= last[pid][0]:
                last[pid] = (at, stage, status, reason)
        reports = []
        for pid in sorted(order, key=lambda p: order[p]):
            at, stage, status, reason = last.get(pid, (0.0, "", "pending", ""))
            reports.append({"problem_id": pid, "stage": stage, "status": status, "reason": reason})
        return reports


# ---- building outcomes -----------------------------------------------------------------------


def usage_fields(usage: sy.TokenUsage) -> dict[str, int]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "llm_requests": usage.requests,
        "cache_hits": usage.cache_hits,
    }


def parse_status(status: int) -> str:
    return sy.ParseStatus.Name(status).removeprefix("PARSE_STATUS_").lower()  # type: ignore[arg-type]


def with_usage(outcome: StageOutcome, usage: dict[str, int] | None) -> StageOutcome:
    for key, value in (usage or {}).items():
        setattr(outcome, key, value)
    return outcome


def passed(data: dict[str, Any], usage: dict[str, int] | None = None) -> StageOutcome:
    return with_usage(StageOutcome("passed", data=data), usage)


def rejected(
    reason: str, data: dict[str, Any] | None = None, usage: dict[str, int] | None = None
) -> StageOutcome:
    return with_usage(StageOutcome("rejected", reason=reason, data=data or {}), usage)

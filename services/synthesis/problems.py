"""Reading problem sets: JSONL or Parquet rows with KodCode-style fields.

Required: `question_id`, `question`, `solution`; optional: `tests` (or `test`), `subset`, and
`entry_point` + `arg_names` (the solution's function and which config keys are its arguments,
used by verification to cross-check reference answers). Every
row that cannot be used is reported with its position and the reason; none is dropped silently.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REQUIRED = ("question_id", "question", "solution")
ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class Problem:
    question_id: str
    question: str
    solution: str
    tests: str = ""
    subset: str = ""
    entry_point: str = ""
    arg_names: tuple[str, ...] = ()


@dataclass(frozen=True)
class ProblemError:
    where: str
    reason: str


def _rows(path: Path) -> list[tuple[str, Any]]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        return [(f"{path.name}:row {i + 1}", row) for i, row in enumerate(table.to_pylist())]
    rows: list[tuple[str, Any]] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append((f"{path.name}:{number}", json.loads(line)))
        except ValueError as exc:
            rows.append((f"{path.name}:{number}", exc))
    return rows


def load_problems(path: str | Path) -> tuple[list[Problem], list[ProblemError]]:
    """Problems in file order, and the rows that were refused (with reasons)."""
    path = Path(path)
    if path.suffix not in (".jsonl", ".json", ".parquet"):
        raise ValueError(f"{path}: expected a .jsonl or .parquet file")
    problems: list[Problem] = []
    errors: list[ProblemError] = []
    seen: dict[str, str] = {}
    for where, row in _rows(path):
        if isinstance(row, Exception):
            errors.append(ProblemError(where, f"not valid JSON: {row}"))
            continue
        if not isinstance(row, dict):
            errors.append(ProblemError(where, "row is not an object"))
            continue
        missing = [k for k in REQUIRED if k not in row or row[k] is None]
        if missing:
            errors.append(ProblemError(where, f"missing field(s): {', '.join(missing)}"))
            continue
        qid = str(row["question_id"]).strip()
        if not ID_PATTERN.match(qid):
            errors.append(ProblemError(where, f"question_id {qid!r} is not usable as a code id"))
            continue
        if qid in seen:
            errors.append(ProblemError(where, f"duplicate question_id {qid} (first at {seen[qid]})"))
            continue
        if not str(row["question"]).strip():
            errors.append(ProblemError(where, f"{qid}: empty question"))
            continue
        if not str(row["solution"]).strip():
            errors.append(ProblemError(where, f"{qid}: empty solution"))
            continue
        arg_names = row.get("arg_names") or []
        if not isinstance(arg_names, list) or not all(isinstance(a, str) for a in arg_names):
            errors.append(ProblemError(where, f"{qid}: arg_names must be a list of config keys"))
            continue
        seen[qid] = where
        tests = row.get("tests", row.get("test", ""))
        problems.append(
            Problem(
                question_id=qid,
                question=str(row["question"]),
                solution=str(row["solution"]),
                tests=tests if isinstance(tests, str) else json.dumps(tests),
                subset=str(row.get("subset", "")),
                entry_point=str(row.get("entry_point") or ""),
                arg_names=tuple(arg_names),
            )
        )
    return problems, errors

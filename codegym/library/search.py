"""The library's search index: one row per environment with what a search filters on, so a search
page costs an indexed read of its page, never a pass over 80,000 task rows.

`env_search` holds per environment its class name, a description (its task statement), where it
was imported from (the `code_id` of `{code_id}__{Env}`), its task count, the mean published Bo4 and
Bo8 pass rates over its tasks that publish one (`*_Bo4_score`, `*_Bo8_score`) and its pass rate
(Bo8's when published, else Bo4's), its tasks per learnability label (`codegym library label`'s,
`unlabelled` for none) and those labels as bits; `env_search_text` is an FTS5 trigram index of id,
name and description, so a substring of three characters or more is found through the index.

A page is read in index-row order (env id order as the index was built; an environment rewritten
since comes last), continuing after the last row of the page before: a search with text walks the
FTS index's matches in that order, one without walks the table, each filter a check of the row, so
a page stops as soon as it is full. The total is counted up to `COUNT_CAP` matches.

The library's writes keep it current (`refresh` of the environments a write touched, all of them
after an import). A library written before the index existed gains it when opened for writing; a
read-only one (a runtime's) without it is indexed once into memory by `SearchIndex`, at its first
search.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import sqlite3
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

UNLABELLED = "unlabelled"
LABELS = ("unsolved", "learnable", "mastered", UNLABELLED)
# Page sizes of a search, and the longest text searched for.
DEFAULT_PAGE = 50
MAX_PAGE = 500
MAX_TEXT = 256
# Matches counted for a search's total; past it the answer says the total is capped.
COUNT_CAP = 10_000
# Description kept per environment (the start of its task statement): what text search reads.
DESCRIPTION_CHARS = 600

SCHEMA = """
CREATE TABLE IF NOT EXISTS {db}env_search (
    id           INTEGER PRIMARY KEY,
    env_id       TEXT NOT NULL UNIQUE,
    name         TEXT NOT NULL,
    description  TEXT NOT NULL,
    source       TEXT NOT NULL,
    task_count   INTEGER NOT NULL,
    bo4          REAL,
    bo8          REAL,
    pass_rate    REAL,
    labels       TEXT NOT NULL,
    label_bits   INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS {db}env_search_source ON env_search(source, id);
CREATE VIRTUAL TABLE IF NOT EXISTS {db}env_search_text USING fts5(
    env_id, name, description, content='env_search', content_rowid='id', tokenize='trigram'
);
"""

# Per environment: its row's fields from the envs and tasks tables (one env's tasks by the tasks_env
# index). Scores are averaged per task first (several models may publish a Bo4), then over tasks.
ROW = """
SELECT e.env_id, e.env_class, substr(e.task_text, 1, {chars}), e.code_id,
       (SELECT COUNT(*) FROM tasks t WHERE t.env_id = e.env_id),
       (SELECT AVG(s) FROM (SELECT AVG(j.value) AS s FROM tasks t, json_each(t.scores) j
            WHERE t.env_id = e.env_id AND j.key LIKE '%\\_Bo4\\_score' ESCAPE '\\' GROUP BY t.id)),
       (SELECT AVG(s) FROM (SELECT AVG(j.value) AS s FROM tasks t, json_each(t.scores) j
            WHERE t.env_id = e.env_id AND j.key LIKE '%\\_Bo8\\_score' ESCAPE '\\' GROUP BY t.id)),
       (SELECT json_group_object(l, n) FROM (SELECT CASE t.learnability WHEN '' THEN '{unlabelled}'
            ELSE t.learnability END AS l, COUNT(*) AS n FROM tasks t WHERE t.env_id = e.env_id GROUP BY l))
FROM envs e
"""


def has_index(db: sqlite3.Connection, schema: str = "main") -> bool:
    """Whether the library holds the index in this release's form."""
    columns = {row[1] for row in db.execute(f"PRAGMA {schema}.table_info(env_search)")}
    return "label_bits" in columns


def create(db: sqlite3.Connection, schema: str = "main") -> None:
    db.executescript(SCHEMA.format(db=f"{schema}."))


def refresh(db: sqlite3.Connection, env_ids: Iterable[str] | None = None, schema: str = "main") -> int:
    """Rewrite the index rows of `env_ids` (None: every environment, the index made afresh) from the
    envs and tasks tables of `db`'s main schema into `schema`'s index; returns the rows written.
    The caller holds the transaction."""
    create(db, schema)
    row_sql = ROW.format(chars=DESCRIPTION_CHARS, unlabelled=UNLABELLED)
    if env_ids is None:  # afresh, in env id order (the order pages are read in)
        for table in ("env_search_text", "env_search", "env_labels"):
            db.execute(f"DROP TABLE IF EXISTS {schema}.{table}")
        create(db, schema)
        rows: Iterable[tuple[object, ...]] = db.execute(row_sql + " ORDER BY e.env_id")
        written = _write(db, schema, rows)
        return written
    written = 0
    for env_id in sorted(set(env_ids)):
        _drop(db, schema, env_id)
        written += _write(db, schema, db.execute(row_sql + " WHERE e.env_id = ?", (env_id,)))
    return written


def _drop(db: sqlite3.Connection, schema: str, env_id: str) -> None:
    old = db.execute(
        f"SELECT id, env_id, name, description FROM {schema}.env_search WHERE env_id = ?", (env_id,)
    ).fetchone()
    if old is None:
        return
    db.execute(
        f"INSERT INTO {schema}.env_search_text(env_search_text, rowid, env_id, name, description)"
        " VALUES ('delete', ?, ?, ?, ?)",
        old,
    )
    db.execute(f"DELETE FROM {schema}.env_search WHERE id = ?", (old[0],))


def _write(db: sqlite3.Connection, schema: str, rows: Iterable[tuple[object, ...]]) -> int:
    written = 0
    for env_id, name, description, source, count, bo4, bo8, labels in list(rows):
        labels = str(labels or "{}")
        rate = bo8 if bo8 is not None else bo4
        cursor = db.execute(
            f"INSERT INTO {schema}.env_search (env_id, name, description, source, task_count, bo4, bo8,"
            " pass_rate, labels, label_bits) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                env_id,
                name,
                description,
                source,
                count,
                bo4,
                bo8,
                rate,
                labels,
                label_bits(json.loads(labels)),
            ),
        )
        db.execute(
            f"INSERT INTO {schema}.env_search_text(rowid, env_id, name, description) VALUES (?, ?, ?, ?)",
            (cursor.lastrowid, env_id, name, description),
        )
        written += 1
    return written


def label_bits(labels: Iterable[str]) -> int:
    """The labels as bits of LABELS' order (a label outside it has none)."""
    return sum(1 << LABELS.index(label) for label in set(labels) if label in LABELS)


@dataclass(frozen=True)
class Query:
    """A search: filters (AND; empty ones match all) and a page after index row `after`."""

    text: str = ""
    source: str = ""
    labels: Sequence[str] = ()
    min_rate: float | None = None
    max_rate: float | None = None
    size: int = 50
    after: int = 0


@dataclass
class Hit:
    env_id: str
    name: str
    description: str
    source: str
    task_count: int
    bo4: float | None
    bo8: float | None
    labels: dict[str, int] = field(default_factory=dict)


class BadQuery(ValueError):
    """A search that cannot be run as asked (its message says why)."""


def page_token(after: int) -> str:
    return base64.urlsafe_b64encode(f"e2:{after}".encode()).decode()


def read_token(token: str) -> int:
    """The index row a page token continues after (0 for none)."""
    if not token:
        return 0
    try:
        text = base64.urlsafe_b64decode(token.encode("ascii")).decode("ascii")
        if not text.startswith("e2:"):
            raise ValueError
        after = int(text[3:])
        if after < 0:
            raise ValueError
        return after
    except (ValueError, UnicodeError, binascii.Error):
        raise BadQuery(f"page_token {token[:40]!r} is not one this search gave") from None


def search(db: sqlite3.Connection, query: Query, schema: str = "main") -> tuple[list[Hit], str, int]:
    """A page of hits, the next page's token ('' at the end) and how many match (at most
    COUNT_CAP + 1: counting stops past the cap)."""
    words = query.text.split()
    indexed = [w for w in words if len(w) >= 3]
    where, args = _filters(query, [w for w in words if len(w) < 3])
    columns = "s.id, s.env_id, s.name, s.description, s.source, s.task_count, s.bo4, s.bo8, s.labels"
    if indexed:
        match = " ".join('"' + w.replace('"', '""') + '"' for w in indexed)
        source = (
            f"{schema}.env_search_text f JOIN {schema}.env_search s ON s.id = f.rowid"
            f" WHERE f.env_search_text MATCH ? AND {where}"
        )
        args = [match, *args]
        row = "f.rowid"
    else:
        source = f"{schema}.env_search s WHERE {where}"
        row = "s.id"
    total = db.execute(
        f"SELECT COUNT(*) FROM (SELECT 1 FROM {source} LIMIT {COUNT_CAP + 1})", args
    ).fetchone()[0]
    rows = db.execute(
        f"SELECT {columns} FROM {source} AND {row} > ? ORDER BY {row} LIMIT ?",
        (*args, query.after, query.size + 1),
    ).fetchall()
    hits = [Hit(r[1], r[2], r[3], r[4], int(r[5]), r[6], r[7], json.loads(r[8])) for r in rows[: query.size]]
    more = len(rows) > query.size
    return hits, page_token(rows[query.size - 1][0]) if more else "", int(total)


def _filters(query: Query, short_words: Sequence[str]) -> tuple[str, list[object]]:
    """The filters as checks of one row (no subquery): a page stops reading when it is full."""
    clauses: list[str] = ["1"]
    args: list[object] = []
    if query.source:
        clauses.append("s.source = ?")
        args.append(query.source)
    if query.min_rate is not None:
        clauses.append("s.pass_rate >= ?")
        args.append(query.min_rate)
    if query.max_rate is not None:
        clauses.append("s.pass_rate <= ?")
        args.append(query.max_rate)
    if query.labels:
        clauses.append("(s.label_bits & ?) != 0")
        args.append(label_bits(query.labels))
    for word in short_words:  # shorter than a trigram: read the (bounded) columns of the row
        clauses.append("(instr(lower(s.env_id || ' ' || s.name || ' ' || s.description), ?) > 0)")
        args.append(word.lower())
    return " AND ".join(clauses), args

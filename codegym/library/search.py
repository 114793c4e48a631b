"""The library's search index: one row per environment with what a search filters on, so a search
page costs an indexed read of its page, never a pass over 80,000 task rows.

`env_search` holds per environment its class name, a description (its task statement), where it
was imported from (the `code_id` of `{code_id}__{Env}`), its task count, the mean published Bo4 and
Bo8 pass rates over its tasks that publish one (`*_Bo4_score`, `*_Bo8_score`) and its pass rate
(Bo8's when published, else Bo4's); `env_labels` lists which learnability labels its tasks carry
(`codegym library label`'s, `unlabelled` for none); `env_search_text` is an FTS5 trigram index of
id, name and description, so a substring of three characters or more is found through the index.

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
    labels       TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS {db}env_search_source ON env_search(source, env_id);
CREATE INDEX IF NOT EXISTS {db}env_search_rate ON env_search(pass_rate, env_id);
CREATE TABLE IF NOT EXISTS {db}env_labels (
    label   TEXT NOT NULL,
    env_id  TEXT NOT NULL,
    PRIMARY KEY (label, env_id)
) WITHOUT ROWID;
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
    row = db.execute(
        f"SELECT 1 FROM {schema}.sqlite_master WHERE type = 'table' AND name = 'env_search'"
    ).fetchone()
    return row is not None


def create(db: sqlite3.Connection, schema: str = "main") -> None:
    db.executescript(SCHEMA.format(db=f"{schema}."))


def refresh(db: sqlite3.Connection, env_ids: Iterable[str] | None = None, schema: str = "main") -> int:
    """Rewrite the index rows of `env_ids` (None: every environment, the index made afresh) from the
    envs and tasks tables of `db`'s main schema into `schema`'s index; returns the rows written.
    The caller holds the transaction."""
    create(db, schema)
    row_sql = ROW.format(chars=DESCRIPTION_CHARS, unlabelled=UNLABELLED)
    if env_ids is None:
        db.execute(f"DELETE FROM {schema}.env_search")
        db.execute(f"DELETE FROM {schema}.env_labels")
        db.execute(f"INSERT INTO {schema}.env_search_text(env_search_text) VALUES ('delete-all')")
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
    db.execute(f"DELETE FROM {schema}.env_labels WHERE env_id = ?", (env_id,))


def _write(db: sqlite3.Connection, schema: str, rows: Iterable[tuple[object, ...]]) -> int:
    written = 0
    for env_id, name, description, source, count, bo4, bo8, labels in list(rows):
        labels = str(labels or "{}")
        rate = bo8 if bo8 is not None else bo4
        cursor = db.execute(
            f"INSERT INTO {schema}.env_search (env_id, name, description, source, task_count, bo4, bo8,"
            " pass_rate, labels) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (env_id, name, description, source, count, bo4, bo8, rate, labels or "{}"),
        )
        db.execute(
            f"INSERT INTO {schema}.env_search_text(rowid, env_id, name, description) VALUES (?, ?, ?, ?)",
            (cursor.lastrowid, env_id, name, description),
        )
        for label in json.loads(labels or "{}"):
            db.execute(
                f"INSERT OR IGNORE INTO {schema}.env_labels (label, env_id) VALUES (?, ?)", (label, env_id)
            )
        written += 1
    return written


@dataclass(frozen=True)
class Query:
    """A search: filters (AND; empty ones match all) and a page after `after` (an env id)."""

    text: str = ""
    source: str = ""
    labels: Sequence[str] = ()
    min_rate: float | None = None
    max_rate: float | None = None
    size: int = 50
    after: str = ""


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


def page_token(after: str) -> str:
    return base64.urlsafe_b64encode(b"e1:" + after.encode()).decode()


def read_token(token: str) -> str:
    """The env id a page token continues after ('' for none)."""
    if not token:
        return ""
    try:
        raw = base64.urlsafe_b64decode(token.encode("ascii"))
        if not raw.startswith(b"e1:"):
            raise ValueError
        return raw[3:].decode("utf-8")
    except (ValueError, UnicodeError, binascii.Error):
        raise BadQuery(f"page_token {token[:40]!r} is not one this search gave") from None


def search(db: sqlite3.Connection, query: Query, schema: str = "main") -> tuple[list[Hit], str, int]:
    """A page of hits (by env id), the next page's token ('' at the end) and how many match."""
    where, args = _filters(query, schema)
    total = db.execute(f"SELECT COUNT(*) FROM {schema}.env_search s WHERE {where}", args).fetchone()[0]
    rows = db.execute(
        f"SELECT s.env_id, s.name, s.description, s.source, s.task_count, s.bo4, s.bo8, s.labels"
        f" FROM {schema}.env_search s WHERE {where} AND s.env_id > ? ORDER BY s.env_id LIMIT ?",
        (*args, query.after, query.size + 1),
    ).fetchall()
    hits = [Hit(r[0], r[1], r[2], r[3], int(r[4]), r[5], r[6], json.loads(r[7])) for r in rows[: query.size]]
    more = len(rows) > query.size
    return hits, page_token(hits[-1].env_id) if more and hits else "", int(total)


def _filters(query: Query, schema: str) -> tuple[str, list[object]]:
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
        marks = ", ".join("?" for _ in query.labels)
        clauses.append(f"s.env_id IN (SELECT env_id FROM {schema}.env_labels WHERE label IN ({marks}))")
        args.extend(query.labels)
    for word in query.text.split():
        if len(word) >= 3:  # the trigram index finds it
            clauses.append(
                f"s.id IN (SELECT rowid FROM {schema}.env_search_text WHERE env_search_text MATCH ?)"
            )
            args.append('"' + word.replace('"', '""') + '"')
        else:  # shorter than a trigram: read the (bounded) columns of the rows the rest selects
            clauses.append("(instr(lower(s.env_id || ' ' || s.name || ' ' || s.description), ?) > 0)")
            args.append(word.lower())
    return " AND ".join(clauses), args

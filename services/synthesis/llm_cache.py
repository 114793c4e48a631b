"""Response cache of the LLM gateway (SQLite).

Keyed by everything that determines a completion: model, messages, sampling parameters and the
sample's index, so a rerun (or a run resumed after a crash) gets exactly the completions it got
before and pays for none of them.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    key            TEXT PRIMARY KEY,
    text           TEXT NOT NULL,
    finish_reason  TEXT NOT NULL,
    created_at     REAL NOT NULL
);
"""


@dataclass(frozen=True)
class CachedCompletion:
    text: str
    finish_reason: str
    # Native function calls of the reply (`{"id", "type", "function": {"name", "arguments"}}`);
    # agent turns only, which are never cached.
    tool_calls: tuple[dict[str, Any], ...] = ()


def cache_key(model: str, messages: list[dict[str, str]], params: Any, sample: int) -> str:
    material = {
        "model": model,
        "messages": messages,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "max_tokens": params.max_tokens,
        "sample": sample,
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


class ResponseCache:
    def __init__(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(path, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode = WAL")
        self.db.executescript(SCHEMA)
        self.lock = threading.Lock()

    def get(self, key: str) -> CachedCompletion | None:
        with self.lock:
            row = self.db.execute(
                "SELECT text, finish_reason FROM responses WHERE key = ?", (key,)
            ).fetchone()
        return CachedCompletion(row[0], row[1]) if row else None

    def put(self, key: str, completion: CachedCompletion) -> None:
        with self.lock, self.db:
            self.db.execute(
                "INSERT OR REPLACE INTO responses (key, text, finish_reason, created_at) VALUES (?, ?, ?, ?)",
                (key, completion.text, completion.finish_reason, time.time()),
            )

    def __len__(self) -> int:
        with self.lock:
            return int(self.db.execute("SELECT COUNT(*) FROM responses").fetchone()[0])

    def close(self) -> None:
        self.db.close()

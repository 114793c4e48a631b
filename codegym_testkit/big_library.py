"""A library of many environments, quickly: one sample environment imported as usual (its code
analysed and verified by the importer), then copied as rows under other ids, each with task
configs of its own. Analysing the same code thousands of times would say nothing new and take
minutes; the copies are served exactly as the original is (the runtime loads an environment's code
by its id's row). For the console's browser tests (a library of a few thousand to search) and its
page-load measurement (`make console-shots`: a library of the published size, 80,000+ tasks).
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from codegym.library import search as search_index
from codegym.library.store import Library
from codegym.samples import ENVS, TASKS

TEMPLATE = "Sample_0006_I__ArrayGcdEnv"  # its configs are {"nums": [...]}; any list of positive ints


def copy_id(number: int) -> str:
    return f"Many_{number:06d}_I__ArrayGcdEnv"


def build(path: Path, envs: int, tasks_per_env: int = 4, names: dict[int, str] | None = None) -> Path:
    """The samples plus `envs` copies of the GCD sample (`names` gives some copies an id of their own),
    each with `tasks_per_env` distinct configs."""
    with Library(path) as library:
        report = library.import_paths([ENVS, TASKS])
        assert report.skipped == [], report.skipped
    db = sqlite3.connect(path)
    try:
        with db:
            for number in range(envs):
                env_id = (names or {}).get(number, copy_id(number))
                code_id = env_id.split("__", 1)[0]
                db.execute(
                    "INSERT INTO envs (env_id, code_id, env_class, source, sha256, tools_json, tools_text, "
                    "task_text, metadata, updated_at) SELECT ?, ?, env_class, source, sha256, tools_json, "
                    "tools_text, task_text, metadata, updated_at FROM envs WHERE env_id = ?",
                    (env_id, code_id, TEMPLATE),
                )
                db.executemany(
                    "INSERT INTO tasks (env_id, config_json, difficulty) VALUES (?, ?, 'easy')",
                    [
                        (env_id, json.dumps({"nums": [6 * (number + 1) + k, 4 * (number + 1) + k]}))
                        for k in range(tasks_per_env)
                    ],
                )
            search_index.refresh(db)  # the rows written here, in SearchEnvs' index
    finally:
        db.close()
    return path

"""Reading `codegym library replay`'s input: the library's recorded trajectories, as the actions to
send and the observations to expect (library_replay.py's doc says what is read and how), and the
tasks they belong to, with the code each was recorded with."""

from __future__ import annotations

import ast
import hashlib
import json
import random
from dataclasses import dataclass
from typing import Any

from codegym.library.store import EnvRecord, Library
from codegym_client.actions import ActionParseError, action_from_object

# How much of an observation or a message a report line holds.
EXCERPT = 160
MESSAGE = 300


class Unreadable(ValueError):
    """A recording that cannot be read as a list of actions and the observations they got."""


@dataclass(frozen=True)
class Trajectory:
    actions: list[str]  # canonical action JSON text, as the environment is sent it
    observations: list[str]  # one per action
    first: str | None = None  # the reset's observation, when the recording holds it


def _literal(text: str, what: str, quoted: bool = False) -> list[Any]:
    """A recorded field as a list: a Python literal, else JSON text (once more when that is itself
    a string, as a field quoted twice on its way)."""
    value: Any = None
    try:
        value = ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):
            raise Unreadable(f"{what} is neither a Python literal nor JSON: {cut(text, 60)!r}") from None
    if isinstance(value, str) and not quoted:
        return _literal(value, what, quoted=True)
    if not isinstance(value, list | tuple):
        raise Unreadable(f"{what} holds {type(value).__name__}, not a list")
    return list(value)


def _action(item: Any, index: int) -> str:
    """The canonical text of one recorded action (see the module doc for what is read)."""
    if isinstance(item, list | tuple) and len(item) == 1:
        item = item[0]
    if isinstance(item, str):
        try:
            item = json.loads(item)
        except (ValueError, RecursionError):
            raise Unreadable(f"action {index} is not JSON: {cut(item, 60)!r}") from None
        if isinstance(item, list) and len(item) == 1:
            item = item[0]
    try:
        return action_from_object(item).to_json()
    except ActionParseError as exc:
        raise Unreadable(f"action {index}: {exc}") from None
    except (TypeError, ValueError) as exc:  # parameters JSON cannot carry (a set, bytes)
        raise Unreadable(f"action {index} cannot be sent as JSON: {exc}") from None


def _observation(item: Any) -> str:
    """A recorded observation as the sandbox renders `env.step()`'s return (inside/operations.py)."""
    if isinstance(item, tuple) and len(item) == 2:
        item = item[1]
    return item if isinstance(item, str) else str(item)


def parse_trajectory(std_traj: str, obs_traj: str) -> Trajectory:
    raw_actions = _literal(std_traj, "std_traj")
    raw_observations = _literal(obs_traj, "obs_traj")
    if not raw_actions:
        raise Unreadable("std_traj holds no action")
    actions = [_action(item, i) for i, item in enumerate(raw_actions, 1)]
    observations = [_observation(item) for item in raw_observations]
    if len(observations) == len(actions):
        return Trajectory(actions, observations)
    if len(observations) == len(actions) + 1:
        return Trajectory(actions, observations[1:], observations[0])
    raise Unreadable(f"{len(actions)} actions but {len(observations)} observations")


def cut(text: str, limit: int = MESSAGE) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def first_difference(a: str, b: str) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def excerpt(text: str, at: int, width: int = EXCERPT) -> str:
    """`width` characters of `text` around offset `at` (where two texts part), marked where cut."""
    start = max(0, min(at - width // 4, len(text) - width))
    end = start + width
    return ("..." if start else "") + text[start:end] + ("..." if end < len(text) else "")


# ---- the library ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TaskRow:
    task_id: int
    env_id: str
    config_json: str
    source_sha: str
    std_traj: str
    obs_traj: str


class Recordings:
    """The library's tasks with trajectories, read by id (one indexed read per task)."""

    def __init__(self, library: Library) -> None:
        self.library = library
        db = library.db
        tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        self.present = "trajectories" in tables
        columns = {row[1] for row in db.execute("PRAGMA table_info(tasks)")}
        self.source_sha = "t.source_sha" if "source_sha" in columns else "''"

    def task_ids(self, prefix: str = "") -> list[int]:
        """Ids of the tasks with a trajectory whose env id starts with `prefix`, in order."""
        if not self.present:
            return []
        rows = self.library.db.execute(
            "SELECT t.id FROM trajectories r JOIN tasks t ON t.id = r.task_id"
            " WHERE substr(t.env_id, 1, ?) = ? ORDER BY t.id",
            (len(prefix), prefix),
        )
        return [int(row[0]) for row in rows]

    def row(self, task_id: int) -> TaskRow | None:
        row = self.library.db.execute(
            f"SELECT t.env_id, t.config_json, {self.source_sha}, r.std_traj, r.obs_traj"
            " FROM tasks t JOIN trajectories r ON r.task_id = t.id WHERE t.id = ?",
            (task_id,),
        ).fetchone()
        return None if row is None else TaskRow(task_id, *row)

    def code(self, task: TaskRow) -> EnvRecord | str:
        """The code the task was recorded with (as the runtime picks it, catalog.py), or why not."""
        env = self.library.get(task.env_id, tasks=False)
        if env is None:
            return f"environment {task.env_id} is not in the library"
        if not task.source_sha or task.source_sha == env.sha256:
            return env
        variant = self.library.variant(task.source_sha)
        if variant is None or variant.env_id != task.env_id:
            return (
                f"the code the task was recorded with (sha256 {task.source_sha[:12]}) is not in the library"
            )
        return variant


def select(task_ids: list[int], sample: int | None, seed: int) -> list[int]:
    """All of `task_ids`, or `sample` of them drawn with `seed` (the same draw every time), in order."""
    if sample is None or sample >= len(task_ids):
        return task_ids
    return sorted(random.Random(seed).sample(task_ids, sample))


def fingerprint(task: TaskRow, code_sha: str) -> str:
    """What a verdict depends on: a state line applies to a task only while this is unchanged."""
    text = json.dumps([task.env_id, task.config_json, code_sha, task.std_traj, task.obs_traj])
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:32]

"""What one published object becomes in an import: an environment row, a task row, or a row saying
why it cannot be read (library_published.py finds the files and reads them; this reads what they
hold, an object at a time: a row of an environment table, a training instance, a task line, a
verified environment with its unit tests). Texts are kept as published; nothing here checks or
runs environment code."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from codegym.contract import EnvStringError, split_env_id
from codegym.library.records import DIFFICULTIES, canonical_config, task_text_from_prompt
from codegym_client.abilities import split_ability

# The columns that make a Parquet file an environment table.
ENV_COLUMNS = ("env_code", "env_name", "source")
# A pass rate published per task (CodeGym's `qwen32b_Bo4_score`, `codegym eval`'s own): its scores.
SCORE = re.compile(r"^.+_Bo\d+_score$")
# extra_info keys that have places of their own (variants, trajectories, solve_fc_round, scores).
HOUSED = ("gym_env", "std_traj", "obs_traj", "solve_fc_round")


@dataclass
class EnvRow:
    where: str
    env_id: str
    source: str
    task_text: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class TaskRow:
    where: str
    env_id: str
    config_text: str  # as published: what follows the ability's second `@`, byte for byte
    difficulty: str = ""
    solve_fc_round: int = 0
    scores: dict[str, float] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    gym_env: str | None = None  # the code the row was recorded with, when the row says
    trajectory: tuple[str, str] | None = None  # (std_traj, obs_traj) as published
    task_text: str = ""


@dataclass
class BadRow:
    where: str
    reason: str
    detail: str = ""
    rows: int = 1  # 0: a file that could not be read at all (how many rows it holds is unknown)


Row = EnvRow | TaskRow | BadRow
Batch = list[Row]


def item_rows(item: Any, where: str, shown: str) -> list[Row]:
    """One JSON object, by its keys: a verified env (its env and unit tests), a training instance
    or a task line."""
    if not isinstance(item, dict):
        return [BadRow(where, "not a JSON object", f"a {type(item).__name__}")]
    if "gym_env" in item and "unit_test_list" in item:
        return verified_rows(item, where, shown)
    if "ability" in item:
        return [training_row(item, where, shown)]
    if "env_id" in item and "config" in item:
        return [task_line(item, where)]
    detail = (
        "line has neither 'ability' (training instance), 'env_id' + 'config' (task) nor"
        " 'gym_env' + 'unit_test_list' (verified environment)"
    )
    return [BadRow(where, "unknown line", detail)]


def env_table_row(item: dict[str, Any], where: str, shown: str) -> Row:
    """A row of an environment table; its other columns are kept in the env's metadata."""
    code, name, source = (item.get(c) for c in ENV_COLUMNS)
    if not isinstance(code, str) or not code:
        return BadRow(where, "no env code", f"env_code is {type(code).__name__}")
    if not isinstance(name, str) or not isinstance(source, str):
        return BadRow(where, "invalid env key", f"env_name {name!r}, source {source!r}")
    name = name.removesuffix(".py")
    env_id = f"{source}__{name}"
    try:
        if split_env_id(env_id) != (source, name):
            raise EnvStringError(f"env name {name!r} is not a class name")
    except EnvStringError as exc:
        return BadRow(where, "invalid env key", str(exc))
    metadata: dict[str, Any] = {"file": shown}
    extra = {k: v for k, v in item.items() if k not in ENV_COLUMNS and v is not None}
    if extra:
        metadata["extra"] = extra
    return EnvRow(where, env_id, code, "", metadata)


def training_row(item: dict[str, Any], where: str, shown: str = "") -> Row:
    """A training instance (`ability`, `prompt`, `extra_info`, ...) as a task row.

    The config is the ability's text after its second `@`, as published. `extra_info.gym_env` is
    the code the row was recorded with, `std_traj`/`obs_traj` its reference trajectories (kept as
    published), `*_BoN_score` its pass rates (null: not measured). Every other field, columns and
    extra_info keys alike, known or not, is kept in the task's `extra`; `code_id` only when it is
    not the ability's.
    """
    ability = item.get("ability")
    if not isinstance(ability, str):
        return BadRow(where, "invalid ability", f"ability is a {type(ability).__name__}")
    try:
        env_id, config_text = split_ability(ability)
        code_id, _ = split_env_id(env_id)
    except (ValueError, EnvStringError) as exc:
        return BadRow(where, "invalid ability", str(exc))
    info = item.get("extra_info")
    info = dict(info) if isinstance(info, dict) else {}
    gym_env = info.get("gym_env")
    std, obs = info.get("std_traj"), info.get("obs_traj")
    trajectory = None if std is None and obs is None else (_text(std), _text(obs))
    scores = {k: float(v) for k, v in info.items() if SCORE.match(k) and _number(v)}
    kept = {k: v for k, v in info.items() if k not in HOUSED and not SCORE.match(k) and v is not None}
    extra = {k: v for k, v in item.items() if k not in ("ability", "extra_info") and v is not None}
    if extra.get("code_id") == code_id:
        del extra["code_id"]
    if kept:
        extra["extra_info"] = kept
    prompt = item.get("prompt")
    return TaskRow(
        where,
        env_id,
        config_text,
        solve_fc_round=_rounds(info.get("solve_fc_round")),
        scores=scores,
        extra=extra,
        gym_env=gym_env if isinstance(gym_env, str) and gym_env else None,
        trajectory=trajectory,
        task_text=task_text_from_prompt(prompt) if isinstance(prompt, list) else "",
    )


def task_line(item: dict[str, Any], where: str) -> Row:
    """`{"env_id", "config", "difficulty", "solve_fc_round"}`; the config an object or its text."""
    try:
        split_env_id(str(item["env_id"]))
    except EnvStringError as exc:
        return BadRow(where, "invalid task line", str(exc))
    row = _unit_test(item["config"], str(item["env_id"]), where, as_config=True)
    if isinstance(row, TaskRow):
        row.extra = {
            k: v
            for k, v in item.items()
            if k not in ("env_id", "config", "difficulty", "solve_fc_round") and v is not None
        }
        error = _describe(row, item)
        if error is not None:
            return error
    return row


def verified_rows(item: dict[str, Any], where: str, shown: str) -> list[Row]:
    """A verified environment (the pipeline's step 5): its env and one task per unit test.

    A unit test is `Env@{config}` as the pipeline writes it (the ability is then
    `codegym_v1@{code_id}__{unit test}`, so the config text after the `@` is kept as written), or
    `{"unit_test": ..., "solve_fc_round": ...}` around it, or a config (an object, or `{"config",
    "difficulty"}`). Each task carries the env's code: if the library keeps other code under the
    key, the task keeps the code it was verified with.
    """
    code = item.get("gym_env")
    if not isinstance(code, str) or not code:
        return [BadRow(where, "no env code", f"gym_env is {type(code).__name__}")]
    code_id, env_name = str(item.get("code_id") or ""), str(item.get("env_name") or "").removesuffix(".py")
    # Step 5 names the file `{code_id}__{env_name}.json` too, which serves when the keys are missing.
    env_id = f"{code_id}__{env_name}" if code_id and env_name else Path(shown).stem
    try:
        env_class = split_env_id(env_id)[1]
    except EnvStringError as exc:
        return [BadRow(where, "invalid env key", str(exc))]
    skip = ("gym_env", "gym_task", "unit_test_list", "code_id", "env_name")
    extra = {k: v for k, v in item.items() if k not in skip and v is not None}
    task_text = item.get("gym_task")
    metadata: dict[str, Any] = {"file": shown} | ({"extra": extra} if extra else {})
    rows: list[Row] = [EnvRow(where, env_id, code, str(task_text or "").strip(), metadata)]
    tests = item.get("unit_test_list")
    if not isinstance(tests, list):
        return [*rows, BadRow(where, "invalid unit tests", f"unit_test_list is a {type(tests).__name__}")]
    for n, test in enumerate(tests):
        test_where = f"{where}:unit_test_list[{n}]"
        if isinstance(test, dict) and "unit_test" in test:
            row = _unit_test(test["unit_test"], env_id, test_where, env_class=env_class)
        elif isinstance(test, dict) and "config" in test:
            row = _unit_test(test["config"], env_id, test_where, as_config=True)
        elif isinstance(test, dict):
            row, test = _unit_test(test, env_id, test_where, as_config=True), {}
        else:
            row, test = _unit_test(test, env_id, test_where, env_class=env_class), {}
        if isinstance(row, TaskRow):
            row.gym_env = code
            row.extra = {
                k: v
                for k, v in test.items()
                if k not in ("unit_test", "config", "difficulty", "solve_fc_round") and v is not None
            }
            row = _describe(row, test) or row
        rows.append(row)
    return rows


def _unit_test(value: Any, env_id: str, where: str, *, env_class: str = "", as_config: bool = False) -> Row:
    """A task row from a config (an object, or its JSON/Python-literal text) or an `Env@{config}`."""
    if isinstance(value, dict):
        try:
            return TaskRow(where, env_id, canonical_config(value))
        except (TypeError, ValueError) as exc:
            return BadRow(where, "invalid config", str(exc))
    if not isinstance(value, str):
        return BadRow(
            where, "invalid config", f"a config is an object or its text, not a {type(value).__name__}"
        )
    if as_config or value.lstrip().startswith("{"):
        return TaskRow(where, env_id, value)
    name, sep, config_text = value.partition("@")
    if not sep:
        return BadRow(where, "invalid unit test", f"expected '{env_class}@{{config}}', got {value[:80]!r}")
    if name.strip() != env_class:
        return BadRow(where, "invalid unit test", f"the unit test names {name.strip()!r}, not {env_class!r}")
    return TaskRow(where, env_id, config_text)


def _describe(row: TaskRow, item: dict[str, Any]) -> BadRow | None:
    """Difficulty and oracle rounds of a task row from the object it came from."""
    difficulty = str(item.get("difficulty") or "").lower()
    if difficulty not in DIFFICULTIES:
        return BadRow(
            row.where, "invalid task line", f"difficulty {difficulty!r} is not easy, medium or hard"
        )
    row.difficulty = difficulty
    row.solve_fc_round = _rounds(item.get("solve_fc_round"))
    return None


def _rounds(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _text(value: Any) -> str:
    """A published trajectory as its text (they are Python-literal strings; anything else as JSON)."""
    if value is None:
        return ""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)

"""What CodeGym publishes, in every form it publishes it, read as rows for the library import.

A file's form is told by its content (a Parquet file's columns, a JSON object's keys), never by a
flag:

  Parquet with env_code, env_name, source   an environment table: the Hugging Face dataset's
                                            `envs_en/`, `envs_cn/` and the card's older
                                            `data/envs_*.parquet`; the key is `{source}__{env_name}`
  Parquet with ability                      training-instance rows (`task_*/train-*.parquet`)
  `{code_id}__{Env}.py`                     an environment file (the pipeline's step 6, the samples)
  JSON with gym_env and unit_test_list      a verified environment with its unit tests (step 5's
                                            `{code_id}__{env_name}.json`, step 4's JSON lines)
  JSON with ability                         a training instance (step 6's JSONL, `codegym export`)
  JSON with env_id and config               a task line (`codegym synthesize`, the samples)

Readers stream: Parquet in record batches of a few hundred rows, JSON lines a line at a time,
folders a few files at a time; nothing holds a whole file. A source yields batches of rows (the
import commits a batch at a time), each row an `EnvRow`, a `TaskRow` or a `BadRow` saying why it
cannot be read. Texts are kept as published: code byte for byte, a config as the text it was
written in. Nothing here checks or runs environment code (library_import.py checks it).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from codegym.contract import EnvStringError, split_env_id
from codegym.contract.envstr import ABILITY_PREFIX
from codegym.library_records import DIFFICULTIES, canonical_config, task_text_from_prompt

ENV_COLUMNS = ("env_code", "env_name", "source")
# A Hugging Face shard: one of the files of a config folder, `train-00000-of-00003.parquet`.
SHARD = re.compile(r"-\d{5}-of-\d{5}\.parquet$")
# A pass rate published per task (CodeGym's `qwen32b_Bo4_score`, `codegym eval`'s own): its scores.
SCORE = re.compile(r"^.+_Bo\d+_score$")
# A JSON file parsed as one document when it is no larger than this; read as JSON lines otherwise.
JSON_DOCUMENT_BYTES = 64 << 20
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
Reader = Callable[[Path, str], Iterator[Batch]]


@dataclass
class Source:
    """One source of an import: a file, or a folder's Parquet shards, env files or verified envs."""

    name: str
    kind: str
    files: list[tuple[Path, str]]  # (path, the name rows are reported under)
    read: Reader
    batch_rows: int
    total: int | None = None  # rows, when the files say before they are read (Parquet)
    order: tuple[int, int] = (0, 0)  # (0 for shards, 1 for other copies; the argument's position)

    def batches(self) -> Iterator[Batch]:
        """Rows of every file, in batches of about `batch_rows` (small files are pooled)."""
        pending: Batch = []
        for path, shown in self.files:
            for batch in self.read(path, shown):
                pending += batch
                del batch  # a batch's rows are held once: not while the next one is read
                if len(pending) >= self.batch_rows:
                    yield pending
                    pending = []
        if pending:
            yield pending


# The order sources are imported in: environments before the tasks that name them.
KINDS = ("env table", "env files", "verified envs", "training rows", "json lines")


def find_sources(paths: Iterable[str | Path]) -> tuple[list[Source], list[BadRow]]:
    """The sources under `paths` (files and folders), in import order, and what cannot be read.

    Environment tables come first, Hugging Face shard folders before other copies (so the card's
    `data/envs_*.parquet` is the one reported as duplicate), then env files, verified envs, and the
    task rows last, so tasks find environments imported in the same call.
    """
    sources: list[Source] = []
    problems: list[BadRow] = []
    for index, raw in enumerate(paths):
        path = Path(raw)
        if path.is_dir():
            files = sorted(
                (p, str(Path(raw) / p.relative_to(path)))
                for p in path.rglob("*")
                if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
            )
            found, bad = _group(files, index, walked=True)
        elif path.is_file():
            found, bad = _group([(path, str(raw))], index, walked=False)
        else:
            found, bad = [], [BadRow(str(raw), "no such file or folder", rows=0)]
        sources += found
        problems += bad
    sources.sort(key=lambda s: (KINDS.index(s.kind), *s.order, s.name))
    return sources, problems


def _group(files: list[tuple[Path, str]], index: int, *, walked: bool) -> tuple[list[Source], list[BadRow]]:
    """The sources of one argument's files: shards, env files and verified envs pooled by folder."""
    sources: dict[tuple[str, str], Source] = {}
    problems: list[BadRow] = []
    for path, shown in files:
        folder = str(Path(shown).parent) if walked else shown
        rows: int | None = None
        if path.suffix == ".py" and path.name != "__init__.py":
            kind, name, read, size, rows, first = "env files", folder, _read_env_file, 64, 1, 0
        elif path.suffix == ".parquet":
            kind, rows, problem = _parquet_kind(path, shown)
            if problem is not None:
                problems.append(problem)
                continue
            sharded = SHARD.search(path.name) is not None
            name, read, first = (folder if sharded else shown), _read_parquet, (0 if sharded else 1)
            size = 256 if kind == "env table" else 128
        elif path.suffix == ".json" and "__" in path.stem:
            kind, name, read, size, first = "verified envs", folder, _read_json, 1024, 0
        elif path.suffix in (".json", ".jsonl"):
            kind, name, size, first = "json lines", shown, 256, 0
            read = _read_json if path.suffix == ".json" else _read_json_lines
        else:
            if not walked:
                detail = "not a .py env file, a folder, a Parquet, JSON or JSONL file"
                problems.append(BadRow(shown, "not a CodeGym file", detail, rows=0))
            continue
        source = sources.get((kind, name))
        if source is None:
            total = None if rows is None else 0
            source = sources[kind, name] = Source(name, kind, [], read, size, total, (first, index))
        source.files.append((path, shown))
        if source.total is not None and rows is not None:
            source.total += rows
    return list(sources.values()), problems


def _parquet_kind(path: Path, shown: str) -> tuple[str, int, BadRow | None]:
    """What a Parquet file holds, from its footer (columns, row count) alone."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        meta = pq.read_metadata(path)
    except (pa.ArrowException, OSError) as exc:
        return "", 0, BadRow(shown, "unreadable file", str(exc), rows=0)
    columns = set(meta.schema.to_arrow_schema().names)
    if set(ENV_COLUMNS) <= columns:
        return "env table", meta.num_rows, None
    if "ability" in columns:
        return "training rows", meta.num_rows, None
    detail = f"columns {sorted(columns)}: neither an environment table ({', '.join(ENV_COLUMNS)}) nor task rows (ability)"
    return "", 0, BadRow(shown, "not a CodeGym file", detail, rows=0)


# ---- readers ------------------------------------------------------------------------------------


def _read_parquet(path: Path, shown: str) -> Iterator[Batch]:
    """A Parquet file in record batches; a file that breaks off is reported where it broke."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    read = 0
    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        yield [BadRow(shown, "unreadable file", str(exc), rows=0)]
        return
    try:
        is_env_table = set(ENV_COLUMNS) <= set(parquet.schema_arrow.names)
        size = 256 if is_env_table else 128
        convert = env_table_row if is_env_table else training_row
        # One thread: reading is not what an import waits for, and each reading thread holds a
        # row group's columns of its own (twice the memory for nothing).
        for batch in parquet.iter_batches(batch_size=size, use_threads=False):
            rows = [
                convert(item, f"{shown}:{read + n}", shown) for n, item in enumerate(batch.to_pylist(), 1)
            ]
            read += len(rows)
            yield rows
            del rows
    except (pa.ArrowException, OSError) as exc:
        yield [BadRow(shown, "unreadable file", f"after {read} rows: {exc}", rows=0)]
    finally:
        parquet.close()


def _read_env_file(path: Path, shown: str) -> Iterator[Batch]:
    """One `{code_id}__{Env}.py`, byte for byte, with its task text from a `.task.md` beside it."""
    try:
        split_env_id(path.stem)
    except EnvStringError:
        yield [BadRow(shown, "file name is not {code_id}__{EnvClass}.py")]
        return
    try:
        source = path.read_bytes().decode("utf-8")
        task_file = path.with_suffix(".task.md")
        task_text = task_file.read_text(encoding="utf-8").strip() if task_file.exists() else ""
    except (OSError, UnicodeDecodeError) as exc:
        yield [BadRow(shown, "unreadable file", str(exc))]
        return
    yield [EnvRow(shown, path.stem, source, task_text, {"file": path.name})]


def _read_json(path: Path, shown: str) -> Iterator[Batch]:
    """A JSON document (a verified env, a row, or a list of rows); JSON lines when it is not one."""
    try:
        document = json.loads(path.read_bytes()) if path.stat().st_size <= JSON_DOCUMENT_BYTES else None
    except ValueError:
        document = None
    except OSError as exc:
        yield [BadRow(shown, "unreadable file", str(exc), rows=0)]
        return
    if document is None:
        yield from _read_json_lines(path, shown)
        return
    if not isinstance(document, list):
        yield item_rows(document, shown, shown)
        return
    yield [row for n, item in enumerate(document) for row in item_rows(item, f"{shown}[{n}]", shown)]


def _read_json_lines(path: Path, shown: str) -> Iterator[Batch]:
    """JSON lines, a line at a time."""
    batch: Batch = []
    try:
        with open(path, "rb") as lines:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                where = f"{shown}:{number}"
                try:
                    item = json.loads(line)
                except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
                    batch.append(BadRow(where, "not JSON", str(exc)))
                else:
                    batch += item_rows(item, where, shown)
                if len(batch) >= 256:
                    yield batch
                    batch = []
    except OSError as exc:
        batch.append(BadRow(shown, "unreadable file", str(exc), rows=0))
    if batch:
        yield batch


# ---- rows ---------------------------------------------------------------------------------------


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
    prefix, sep, rest = ability.partition("@")
    env_id, sep2, config_text = rest.partition("@")
    if not sep or not sep2:
        return BadRow(where, "invalid ability", "expected 'codegym_v1@{code_id}__{Env}@{json}'")
    if prefix != ABILITY_PREFIX:
        return BadRow(where, "invalid ability", f"ability prefix must be {ABILITY_PREFIX!r}, got {prefix!r}")
    try:
        code_id, _ = split_env_id(env_id)
    except EnvStringError as exc:
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

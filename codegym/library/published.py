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
written in. Nothing here checks or runs environment code (library_import.py checks it). What a
file's objects become, row by row, is library_rows.py's.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from codegym.contract import EnvStringError, split_env_id
from codegym.library.rows import (
    ENV_COLUMNS,
    BadRow,
    Batch,
    EnvRow,
    Row,
    TaskRow,
    env_table_row,
    item_rows,
    training_row,
)

# The rows are part of what this module gives an import (`from codegym.library.published import
# TaskRow`); library_rows.py makes them.
__all__ = ["BadRow", "Batch", "EnvRow", "Row", "Source", "TaskRow", "find_sources"]

# A Hugging Face shard: one of the files of a config folder, `train-00000-of-00003.parquet`.
SHARD = re.compile(r"-\d{5}-of-\d{5}\.parquet$")
# A JSON file parsed as one document when it is no larger than this; read as JSON lines otherwise.
JSON_DOCUMENT_BYTES = 64 << 20
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

"""Training instances written to a file, a row at a time: JSON lines or Parquet (row groups of a
few MB), with the held-out environments in a `.val` sibling, into partial files renamed only when
whole, so an export killed half way leaves no file a trainer could take for a whole one."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

from codegym.library.store import Library
from codegym_jobs.export.instances import Difficulty, ExportCounts, HeldOut, iter_instances

# Rows per Parquet row group: a few MB of rows held at a time, whatever the library's size.
ROW_GROUP_ROWS = 1024
# Row fields an environment's rows share (JsonlWriter encodes them once per run of equal values).
REPEATED = frozenset({"prompt", "tools"})


class RowWriter(Protocol):
    def write(self, item: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class JsonlWriter:
    """One JSON object per line (`json.dumps(item, ensure_ascii=False)`, byte for byte), written as
    it comes. The prompt and tools of an environment's rows are the same text for each of its task
    configs: encoded once per environment, not once per row (most of a row's bytes)."""

    def __init__(self, path: Path) -> None:
        self.file: IO[str] = open(path, "w", encoding="utf-8", buffering=1 << 20)  # noqa: SIM115 (closed by close())
        self.encode = json.JSONEncoder(ensure_ascii=False).encode
        self.last: dict[str, tuple[Any, str]] = {}  # key -> (value, its encoding), for REPEATED

    def write(self, item: dict[str, Any]) -> None:
        parts: list[str] = []
        run: dict[str, Any] = {}  # consecutive other fields, encoded together
        for key, value in item.items():
            if key not in REPEATED:
                run[key] = value
                continue
            if run:
                parts.append(self.encode(run)[1:-1])
                run = {}
            last = self.last.get(key)
            if last is None or last[0] != value:
                last = self.last[key] = (value, self.encode(value))
            parts.append(f"{self.encode(key)}: {last[1]}")
        if run:
            parts.append(self.encode(run)[1:-1])
        self.file.write("{" + ", ".join(parts) + "}\n")

    def close(self) -> None:
        self.file.close()


class ParquetWriter:
    """Rows in row groups of `rows_per_group` under a schema fixed before the first row
    (`parquet_schema`): one row group is all that is held."""

    def __init__(self, path: Path, schema: Any, rows_per_group: int = ROW_GROUP_ROWS) -> None:
        import pyarrow.parquet as pq

        self.schema = schema
        self.extra_keys = frozenset(schema.field("extra_info").type.names)
        self.rows_per_group = rows_per_group
        self.rows: list[dict[str, Any]] = []
        self.tools: tuple[Any, str] | None = None
        self.writer = pq.ParquetWriter(path, schema)

    def write(self, item: dict[str, Any]) -> None:
        if not self.extra_keys.issuperset(item["extra_info"]):  # pyarrow would drop them silently
            unknown = sorted(set(item["extra_info"]) - self.extra_keys)
            raise ValueError(f"extra_info keys {unknown} are not in the Parquet schema")
        if "tools" in item:  # an environment's rows have the same tools: encoded once for them
            if self.tools is None or self.tools[0] != item["tools"]:
                self.tools = (item["tools"], json.dumps(item["tools"], ensure_ascii=False))
            item = {**item, "tools": self.tools[1]}
        self.rows.append(item)
        if len(self.rows) >= self.rows_per_group:
            self.flush()

    def flush(self) -> None:
        import pyarrow as pa

        if self.rows:
            self.writer.write_table(pa.Table.from_pylist(self.rows, schema=self.schema))
            self.rows.clear()

    def close(self) -> None:
        self.flush()
        self.writer.close()


def json_type(kinds: set[str]) -> Any:
    """The Arrow type of an `extra_info` value from the JSON types SQLite saw (`json_each`)."""
    import pyarrow as pa

    kinds = kinds - {"null"}
    if kinds <= {"integer"}:
        return pa.int64()
    if kinds <= {"integer", "real"}:
        return pa.float64()
    if kinds <= {"true", "false"}:
        return pa.bool_()
    if kinds == {"text"}:
        return pa.string()
    raise ValueError(f"values of types {sorted(kinds)} cannot share a Parquet column: export JSONL")


def extra_info_fields(library: Library, prefix: str, difficulty: Difficulty | None) -> list[tuple[str, Any]]:
    """The `extra_info` keys the rows of `prefix` can have, with their types, in the rows' order:
    asked of the library up front (two aggregate queries), since a Parquet schema precedes rows."""
    import pyarrow as pa

    where = "substr(t.env_id, 1, ?) = ?"
    args = (len(prefix), prefix)
    has_difficulty, has_guess, has_label = library.db.execute(
        "SELECT MAX(t.difficulty != ''), MAX(t.guess_rate IS NOT NULL), MAX(t.learnability != '')"
        f" FROM tasks t WHERE {where}",
        args,
    ).fetchone()
    scores: dict[str, set[str]] = {}
    for key, kind in library.db.execute(
        f"SELECT DISTINCT j.key, j.type FROM tasks t, json_each(t.scores) j WHERE {where} AND t.scores != '{{}}'",
        args,
    ):
        scores.setdefault(str(key), set()).add(str(kind))
    fields: list[tuple[str, Any]] = [("index", pa.string()), ("solve_fc_round", pa.int64())]
    if has_difficulty:
        fields.append(("difficulty", pa.string()))
    fields.append(("env_id", pa.string()))
    if has_guess:
        fields.append(("guess_rate", pa.float64()))
    if has_label:
        fields.append(("learnability", pa.string()))
    fields += [(key, json_type(kinds)) for key, kinds in sorted(scores.items())]
    if difficulty is not None:
        fields = [f for f in fields if f[0] != difficulty.name] + [(difficulty.name, pa.float64())]
    return fields


def parquet_schema(tools: str, extra_fields: list[tuple[str, Any]]) -> Any:
    """The Arrow schema of exported rows: CodeGym's fields, and `tools` as a JSON string."""
    import pyarrow as pa

    message = [("role", pa.string()), ("content", pa.string())]
    if tools != "json":
        message.append(("name", pa.string()))
    columns = [
        ("ability", pa.string()),
        ("answer", pa.string()),
        ("code_id", pa.string()),
        ("data_source", pa.string()),
        ("extra_info", pa.struct(extra_fields)),
        ("plugin_call_max_round", pa.int64()),
        ("prompt", pa.list_(pa.struct(message))),
        ("reward_model", pa.struct([("ground_truth", pa.null()), ("style", pa.string())])),
    ]
    if tools != "text":
        columns.append(("tools", pa.string()))
    return pa.schema(columns)


def env_ids_with_tasks(library: Library, prefix: str) -> Iterator[str]:
    """Ids of the environments of `prefix` that have task configs (what `--split` chooses from)."""
    rows = library.db.execute(
        "SELECT e.env_id FROM envs e WHERE substr(e.env_id, 1, ?) = ?"
        " AND EXISTS (SELECT 1 FROM tasks t WHERE t.env_id = e.env_id)",
        (len(prefix), prefix),
    )
    return (str(row[0]) for row in rows)


def validation_path(out: Path) -> Path:
    return out.with_name(f"{out.stem}.val{out.suffix}")


def partial_path(path: Path) -> Path:
    """Where `path` is written until it is complete."""
    return path.with_name(f".{path.name}.partial")


def open_writer(path: Path, fmt: str, schema: Any) -> RowWriter:
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "parquet":
        return ParquetWriter(partial_path(path), schema)
    return JsonlWriter(partial_path(path))


@dataclass(frozen=True)
class Selection:
    """Which task configs an export writes, and how (`codegym export`'s options)."""

    prefix: str = ""
    split: float = 0.0  # share of environments held out into OUT's `.val` sibling
    tools: str = "text"
    min_rounds: int = 0
    max_rounds: int = 0
    include_unverified: bool = False
    max_guess_rate: float = 1.0
    learnability: frozenset[str] | None = None


def export(
    library: Library, out: Path, fmt: str, args: Selection, difficulty: Difficulty | None
) -> ExportCounts:
    """Write the instances of `library` to `out` (and the held-out ones to its `.val` sibling with
    `args.split`), one row at a time, into partial files renamed when whole; the counts when done."""
    schema = None
    if fmt == "parquet":
        schema = parquet_schema(args.tools, extra_info_fields(library, args.prefix, difficulty))
    held_out = HeldOut(env_ids_with_tasks(library, args.prefix), args.split)
    paths = [out, validation_path(out)] if args.split else [out]
    writers: list[RowWriter] = []
    counts = ExportCounts()
    try:
        for path in paths:
            writers.append(open_writer(path, fmt, schema))
        for validation, item in iter_instances(
            library.iter_envs(args.prefix),
            counts,
            tools=args.tools,
            held_out=held_out,
            min_rounds=args.min_rounds,
            max_rounds=args.max_rounds,
            include_unverified=args.include_unverified,
            difficulty=difficulty,
            max_guess_rate=args.max_guess_rate,
            learnability=args.learnability,
        ):
            writers[1 if validation else 0].write(item)
        while writers:
            writers.pop(0).close()
    except BaseException:
        for writer in writers:
            with contextlib.suppress(Exception):  # the first error is the one to report
                writer.close()
        for path in paths:
            partial_path(path).unlink(missing_ok=True)
        raise
    for path in paths:
        os.replace(partial_path(path), path)
    return counts

"""Training-instance rows as the spec reads them: a JSONL or Parquet file (`codegym export`'s) or
the rows themselves, read through and never held (at CodeGym's size, 80,130 rows): each row's
ability, and the tool schemas only from the first row of each environment."""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from codegym_client.abilities import ability_parts
from codegym_client.trl.tools import ToolSchema

PARQUET_BATCH_ROWS = 4096  # rows of an instances file read at a time


def optional_module(module: str) -> Any:
    """An optional module (`datasets`: TRL brings it, the client does not need it), or None."""
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


class Instance:
    """What the spec takes from a training-instance row: its ability, and its `tools` as the row
    has them (`codegym export --tools json|both`), read only for an environment's first row."""

    __slots__ = ("ability", "raw_tools")

    def __init__(self, ability: str, raw_tools: Any) -> None:
        self.ability = ability
        self.raw_tools = raw_tools

    def tools(self) -> list[ToolSchema] | None:
        """The row's tool schemas: a list of OpenAI tool definitions (JSONL, rows given as dicts),
        or that list as a JSON string (`codegym export`'s Parquet); None for anything else (a
        Parquet struct column, as older exports wrote, pads each schema with every other
        environment's parameters: not its tools)."""
        value = self.raw_tools
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                return None
        if isinstance(value, list) and value and all(isinstance(t, dict) for t in value):
            return value
        return None


def read_instances(instances: str | Path | Iterable[Mapping[str, Any]]) -> Iterator[Instance]:
    """The rows' abilities (and tools), one row at a time: a file of CodeGym's 80,130 published
    rows is read through, never held (JSONL line by line; Parquet a row group at a time, only the
    `ability` and `tools` columns)."""
    if isinstance(instances, str | Path):
        path = Path(instances)
        if path.suffix == ".parquet":  # `codegym export --out X.parquet`
            yield from _read_parquet(path)
            return
        yield from _read_jsonl(path)
        return
    for row in instances:
        yield Instance(str(row.get("ability", "")), row.get("tools"))


_ABILITY_FIRST = '{"ability": "'  # how `codegym export` starts a row (json.dumps, keys in order)


def _read_jsonl(path: Path) -> Iterator[Instance]:
    """A JSONL file's rows, line by line. A row `codegym export` wrote starts with its ability: that
    string is decoded alone (most of a row is its prompt, which the spec does not use), and the
    whole row only for the first row of each environment, for its `tools`; any other row is
    decoded whole."""
    decoder = json.JSONDecoder()
    seen: set[str] = set()
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            try:
                if line.startswith(_ABILITY_FIRST):
                    ability, _ = decoder.raw_decode(line, len(_ABILITY_FIRST) - 1)
                    env_id = ability_parts(ability)[1]
                    if env_id in seen or '"tools": ' not in line:
                        seen.add(env_id)
                        yield Instance(ability, None)
                        continue
                    seen.add(env_id)
                elif not line.strip():
                    continue
                row = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{path}:{number}: not a JSON row: {exc}") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{number}: not a JSON object")
            yield Instance(str(row.get("ability", "")), row.get("tools"))


def _read_parquet(path: Path) -> Iterator[Instance]:
    """A Parquet file's rows, `PARQUET_BATCH_ROWS` at a time: every ability, and `tools` only from
    the first row of each environment (the rest are never made Python objects)."""
    parquet = optional_module("pyarrow.parquet")
    if parquet is None:  # `datasets` (TRL's) brings pyarrow
        raise ValueError(f"{path}: reading Parquet needs `pyarrow` (or `datasets`); or export JSONL")
    file = parquet.ParquetFile(str(path))
    names = set(file.schema_arrow.names)
    if "ability" not in names:
        raise ValueError(f"{path}: no 'ability' column")
    columns = ["ability", "tools"] if "tools" in names else ["ability"]
    seen: set[str] = set()
    for batch in file.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=columns):
        abilities = [str(a or "") for a in batch.column(0).to_pylist()]
        firsts: dict[int, Any] = {}
        if len(columns) == 2:
            for i, ability in enumerate(abilities):
                env_id = ability_parts(ability)[1]
                if env_id not in seen:
                    seen.add(env_id)
                    firsts[i] = None
            if firsts:
                taken = batch.column(1).take(list(firsts)).to_pylist()
                firsts = dict(zip(firsts, taken, strict=True))
        for i, ability in enumerate(abilities):
            yield Instance(ability, firsts.get(i))

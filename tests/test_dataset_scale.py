"""A trainer's dataset built from a library of CodeGym's published size (80,130 rows over 22,366
environments): `codegym export` streams (its memory does not grow with the rows), its abilities
carry each config as published, byte for byte, its `--split` is the same on every run; TRL's
`CodeGymSpec` reads a large exported file without a GetEnv per environment when the rows carry
their tools, and asks GetEnv concurrently otherwise; verl's Parquet (docs/trainers/verl.md's command) is the
same rows, read a row group at a time.

The libraries are the samples copied with SQL (each copy a sample's source plus a unique comment
line under a new id, with some of its sample's task configs), so thousands take a second.
"""

from __future__ import annotations

import hashlib
import json
import math
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from codegym.contract import parse_ability
from codegym.library.store import Library
from codegym_client import RuntimeClient
from codegym_client.errors import EnvNotFound
from codegym_client.trl import CodeGymSpec
from codegym_jobs.export.instances import build_instances
from tests.conftest import ENV_DIR, ROOT, SAMPLES
from tests.helpers.servers import CodegymServer

COPIES = 3000  # environments copied from the 12 samples: 3,012 in all, 10,500 exported rows
TASKS_PER_COPY = (4, 3)  # alternately: 3.5 per environment, as CodeGym's 80,130 / 22,366


SAMPLE_IDS = {path.stem for path in ENV_DIR.glob("*__*Env.py")}


def held_out_by_rule(library: Path, fraction: float) -> set[str]:
    """`--split`'s environments, computed apart: the first ⌈fraction·n⌉ of the n environments with
    task configs, ordered by the sha256 hex digest of their id."""
    with sqlite3.connect(library) as db:
        with_tasks = [row[0] for row in db.execute("SELECT DISTINCT env_id FROM tasks")]
    by_hash = sorted(with_tasks, key=lambda e: hashlib.sha256(e.encode()).hexdigest())
    return set(by_hash[: math.ceil(fraction * len(by_hash))])


def sample_library(path: Path) -> Path:
    with Library(path) as library:
        report = library.import_paths([ENV_DIR, SAMPLES / "tasks.jsonl"])
    assert report.skipped == []
    return path


def copy_envs_with_tasks(path: Path, copies: int) -> int:
    """Add `copies` environments to the library at `path`: a sample's source plus a unique comment
    line under `{code_id}v{n:05d}__{Env}` (its tools and task text are the sample's), with 4 or 3
    of the sample's task configs each, verified (`solve_fc_round` 10..49) so that export keeps
    them. Returns the number of task configs added."""
    db = sqlite3.connect(path)
    samples = db.execute(
        "SELECT env_id, code_id, env_class, source, tools_json, tools_text, task_text FROM envs ORDER BY env_id"
    ).fetchall()
    configs = {
        env_id: db.execute(
            "SELECT config_json, difficulty FROM tasks WHERE env_id = ? ORDER BY id", (env_id,)
        ).fetchall()
        for env_id, *_ in samples
    }
    envs, tasks = [], []
    for n in range(copies):
        env_id, code_id, env_class, source, tools_json, tools_text, task_text = samples[n % len(samples)]
        source = f"{source}\n# copy {n}\n"
        new_code = f"{code_id}v{n:05d}"
        new_id = f"{new_code}__{env_class}"
        envs.append(
            (
                new_id,
                new_code,
                env_class,
                source,
                hashlib.sha256(source.encode()).hexdigest(),
                tools_json,
                tools_text,
                task_text,
            )
        )
        own = configs[env_id]
        for i in range(TASKS_PER_COPY[n % 2]):
            config_json, difficulty = own[(n + i) % len(own)]
            tasks.append((new_id, config_json, difficulty, 10 + (n + i) % 40))
    with db:
        db.executemany(
            "INSERT INTO envs (env_id, code_id, env_class, source, sha256, tools_json, tools_text, task_text,"
            " metadata, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, '{}', 0)",
            envs,
        )
        db.executemany(
            "INSERT INTO tasks (env_id, config_json, difficulty, solve_fc_round) VALUES (?, ?, ?, ?)", tasks
        )
    db.close()
    return len(tasks)


@pytest.fixture(scope="module")
def big_library(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """3,012 environments; 10,500 verified task configs (the samples' own are unverified)."""
    path = sample_library(tmp_path_factory.mktemp("big") / "library.db")
    return path, copy_envs_with_tasks(path, COPIES)


def export(library: Path, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "codegym_cli.cli",
            "export",
            "--library",
            str(library),
            "--out",
            str(out),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    return result


def jsonl(path: Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as lines:
        return [json.loads(line) for line in lines]


def parquet_rows(path: Path) -> list[dict[str, Any]]:
    return pq.read_table(path).to_pylist()


# A process exporting under tracemalloc: its peak of Python allocations, and pyarrow's (not traced).
# What is imported on first use (the export's modules, pyarrow's lazy imports on its first table)
# is imported before: a constant, not rows.
MEASURED_EXPORT = """
import io, json, sys, tracemalloc
import pyarrow as pa, pyarrow.parquet as pq
import codegym.library.store, codegym_jobs.export.writers, codegym_cli.export
from codegym_cli.cli import build_parser, main
build_parser()  # the command line's option modules, imported on first use
pq.write_table(pa.Table.from_pylist([{"a": [{"b": "c"}]}]), io.BytesIO())
tracemalloc.start()
code = main(sys.argv[1:])
print(json.dumps({"code": code, "peak": tracemalloc.get_traced_memory()[1],
                  "arrow_peak": pa.default_memory_pool().max_memory()}))
"""


def measured_export(library: Path, out: Path, *args: str) -> dict[str, int]:
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            MEASURED_EXPORT,
            "export",
            "--library",
            str(library),
            "--out",
            str(out),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    measured: dict[str, int] = json.loads(result.stdout.strip().splitlines()[-1])
    assert measured["code"] == 0, result.stderr
    return measured


@pytest.mark.slow
def test_export_streams_rows_whatever_the_library_size(big_library: tuple[Path, int], tmp_path: Path) -> None:
    """Exporting 10,500 rows holds a few of them at a time: the peak of Python allocations is a
    small fraction of the rows' own JSON text (holding them all, as `load_all` did, takes more
    than that text: every record with its source, and every row as Python objects); Parquet holds
    a row group at a time too (its Arrow memory well below the rows' size)."""
    library, tasks = big_library
    out = tmp_path / "train.jsonl"
    measured = measured_export(library, out)
    rows = jsonl(out)
    assert len(rows) == tasks
    size = out.stat().st_size
    assert size > 30 * 2**20  # about 3.3 KB a row
    assert measured["peak"] < size / 3, (measured, size)  # load_all: about 3 times the size
    # The rows are the library's, in id order, with their environment's prompt.
    assert [r["extra_info"]["index"] for r in rows] == [str(i) for i in range(tasks)]
    env_ids = [r["extra_info"]["env_id"] for r in rows]
    assert env_ids == sorted(env_ids) and len(set(env_ids)) == COPIES
    with Library(library) as lib:
        first = lib.get(env_ids[0])
        assert first is not None
        assert rows[0]["prompt"][0]["content"] == first.tools_text
        assert rows[0]["ability"] == f"codegym_v1@{first.env_id}@{first.tasks[0].published_config}"

    parquet = tmp_path / "train.parquet"
    measured = measured_export(library, parquet, "--tools", "json")
    file = pq.ParquetFile(parquet)
    assert file.metadata.num_rows == tasks and file.metadata.num_row_groups >= tasks // 1024
    assert measured["peak"] < size / 3 and measured["arrow_peak"] < size / 4, (measured, size)


def test_export_writes_the_config_as_published_byte_for_byte(tmp_path: Path) -> None:
    """A config stored with its published text (compact separators, raw non-ASCII, a Python
    literal as CodeGym's own files write them) is exported exactly so, in JSONL and Parquet; a
    config without one is its canonical spelling, non-ASCII unescaped."""
    library = sample_library(tmp_path / "library.db")
    palindrome = "Sample_0002_I__PalindromeCheckEnv"
    published = {  # canonical config_json: its published text
        '{"s": "été, 漢字"}': '{"s":"été, 漢字"}',
        '{"s": "naïve"}': "{'s': 'naïve'}",
        '{"s": "abba"}': '{"s":"abba"}',
    }
    stored = '{"s": "ça"}'  # no published text: served and exported as stored
    with sqlite3.connect(library) as db:
        db.execute("UPDATE tasks SET solve_fc_round = 12")
        first = db.execute("SELECT id FROM tasks WHERE env_id = ? ORDER BY id", (palindrome,)).fetchall()
        for (task_id,), (config_json, text) in zip(first, [*published.items(), (stored, "")], strict=False):
            db.execute(
                "UPDATE tasks SET config_json = ?, config_text = ? WHERE id = ?", (config_json, text, task_id)
            )
    out = tmp_path / "train.jsonl"
    export(library, out, "--tools", "both")
    raw = out.read_bytes()
    rows = jsonl(out)
    abilities = {r["ability"] for r in rows if r["extra_info"]["env_id"] == palindrome}
    expected = {f"codegym_v1@{palindrome}@{text}" for text in [*published.values(), stored]}
    assert expected <= abilities
    for ability in expected:  # in the file as the text itself: no escapes, no re-spacing
        assert json.dumps(ability, ensure_ascii=False).encode() in raw
    for row in rows:  # each still parses to its config
        parsed = parse_ability(row["ability"])
        assert parsed.env_id == row["extra_info"]["env_id"]
    assert {json.dumps(parse_ability(a).config, ensure_ascii=False) for a in expected} == {*published, stored}

    parquet = tmp_path / "train.parquet"
    export(library, parquet, "--tools", "both")
    same_rows(parquet_rows(parquet), rows)


def same_rows(from_parquet: list[dict[str, Any]], from_jsonl: list[dict[str, Any]]) -> None:
    """Parquet's rows are JSONL's: `tools` as a JSON string, and `extra_info` with every key some
    row has (None where this row has none)."""
    assert len(from_parquet) == len(from_jsonl)
    for a, b in zip(from_parquet, from_jsonl, strict=True):
        a, b = dict(a), dict(b)
        if "tools" in b:
            assert json.loads(a.pop("tools")) == b.pop("tools")
        extra, expected = a.pop("extra_info"), b.pop("extra_info")
        assert {k: v for k, v in extra.items() if k in expected} == expected
        assert all(v is None for k, v in extra.items() if k not in expected)
        assert a == b


def test_parquet_extra_info_holds_every_key_the_rows_have(tmp_path: Path) -> None:
    """A Parquet schema precedes its rows: the export asks the library which `extra_info` keys the
    rows can have (difficulty, guess_rate, each model's score) and their types first."""
    library = sample_library(tmp_path / "library.db")
    with sqlite3.connect(library) as db:
        db.execute("UPDATE tasks SET solve_fc_round = 12")
        db.execute("UPDATE tasks SET guess_rate = 0.125 WHERE id % 3 = 0")
        db.execute("""UPDATE tasks SET scores = '{"m_Bo4_score": 0.25}' WHERE id % 4 = 1""")
        db.execute("""UPDATE tasks SET scores = '{"m_Bo4_score": 1, "n_Bo8_score": 0}' WHERE id % 4 = 2""")
        db.execute("UPDATE tasks SET difficulty = '' WHERE id % 5 = 0")
    jsonl_out, parquet_out = tmp_path / "train.jsonl", tmp_path / "train.parquet"
    export(library, jsonl_out, "--tools", "json")
    export(library, parquet_out, "--tools", "json")
    rows = jsonl(jsonl_out)
    assert {"guess_rate", "m_Bo4_score", "n_Bo8_score", "difficulty"} <= {
        k for r in rows for k in r["extra_info"]
    }
    extra_type = pq.ParquetFile(parquet_out).schema_arrow.field("extra_info").type
    assert [extra_type.field(i).name for i in range(extra_type.num_fields)] == [
        "index",
        "solve_fc_round",
        "difficulty",
        "env_id",
        "guess_rate",
        "m_Bo4_score",
        "n_Bo8_score",
    ]
    same_rows(parquet_rows(parquet_out), rows)


@pytest.mark.slow
def test_split_is_deterministic_and_holds_out_whole_environments(
    big_library: tuple[Path, int], tmp_path: Path
) -> None:
    library, tasks = big_library
    runs = []
    for name in ("a", "b"):
        out = tmp_path / name / "train.jsonl"
        export(library, out, "--split", "0.1")
        runs.append((out.read_bytes(), (tmp_path / name / "train.val.jsonl").read_bytes()))
    assert runs[0] == runs[1]  # the same bytes on every run
    train = jsonl(tmp_path / "a" / "train.jsonl")
    validation = jsonl(tmp_path / "a" / "train.val.jsonl")
    assert len(train) + len(validation) == tasks
    held = {r["extra_info"]["env_id"] for r in validation}
    assert held.isdisjoint(r["extra_info"]["env_id"] for r in train)
    # The environments chosen are the first ⌈0.1·n⌉ of the n with task configs by the sha256 of
    # their id (the rule --split always had), whatever order the rows stream in; the samples'
    # own configs are unverified, so a sample chosen has no rows.
    assert held == held_out_by_rule(library, 0.1) - SAMPLE_IDS
    # The indexes count every exported row once, across both files, in library order.
    indexes = sorted(int(r["extra_info"]["index"]) for r in train + validation)
    assert indexes == list(range(tasks))
    # Parquet splits the same way, and so does the in-memory build (codegym eval's).
    parquet = tmp_path / "train.parquet"
    export(library, parquet, "--split", "0.1")
    assert [r["ability"] for r in parquet_rows(tmp_path / "train.val.parquet")] == [
        r["ability"] for r in validation
    ]
    with Library(library) as lib:
        built = build_instances(lib.iter_envs(), split=0.1)
    assert [r["ability"] for r in built.validation] == [r["ability"] for r in validation]
    assert built.train == train


@pytest.fixture(scope="module")
def runtime(big_library: tuple[Path, int]) -> Iterator[str]:
    """A runtime serving the big library: GetEnv and ListEnvs need no sandbox worker."""
    library, _ = big_library
    server = CodegymServer(
        ["serve", "runtime", "--port", "0", "--library", str(library), "--sandbox", "127.0.0.1:1"]
    )
    try:
        yield server.address
    finally:
        assert server.stop() == 0


def runtime_schemas(client: RuntimeClient, env_id: str) -> list[dict[str, Any]]:
    return [json.loads(t.json_schema) for t in client.get_env(env_id).tools]


@pytest.fixture(scope="module")
def exported(big_library: tuple[Path, int], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The big library exported as TRL users would: CodeGym's text rows (no tools), and rows with
    their tools (`--tools json`) in JSONL and Parquet."""
    library, _ = big_library
    out = tmp_path_factory.mktemp("exported")
    files = {"text": out / "text.jsonl", "jsonl": out / "tools.jsonl", "parquet": out / "tools.parquet"}
    export(library, files["text"])
    export(library, files["jsonl"], "--tools", "json")
    export(library, files["parquet"], "--tools", "json")
    return files


@pytest.mark.jail
@pytest.mark.slow
def test_trl_spec_from_a_large_exported_file_reads_the_rows_tools(
    big_library: tuple[Path, int], runtime: str, exported: dict[str, Path], get_env_calls: list[str]
) -> None:
    """Rows exported with their tools (`--tools json`, JSONL or Parquet): the spec takes each
    environment's schemas from its rows, checked against the runtime's tool names (ListEnvs, a
    page per 1,000 environments), with no GetEnv at all; rows in the file's order."""
    _, tasks = big_library
    abilities = [r["ability"] for r in jsonl(exported["jsonl"])]
    assert [r["ability"] for r in parquet_rows(exported["parquet"])] == abilities
    for path in (exported["jsonl"], exported["parquet"]):
        spec = CodeGymSpec(runtime, instances=path)
        assert get_env_calls == []
        assert [r["ability"] for r in spec.rows] == abilities and len(spec.rows) == tasks
        assert all(r["env_id"] == r["environment"] == r["ability"].split("@")[1] for r in spec.rows)
        assert len(spec.environment_classes) == COPIES
        with RuntimeClient(runtime) as client:
            for env_id in list(spec.environment_classes)[:: COPIES // 12]:
                cls = spec.environment_classes[env_id]
                assert list(cls.tool_schemas) == runtime_schemas(client, env_id)
        get_env_calls.clear()  # the checks' own


@pytest.mark.jail
@pytest.mark.slow
def test_trl_spec_asks_getenv_where_the_rows_have_no_tools_or_stale_ones(
    runtime: str, exported: dict[str, Path], get_env_calls: list[str]
) -> None:
    """Rows without tools (CodeGym's text export) cost one GetEnv per environment, sent
    concurrently, and give the same classes; a row whose tools are not the runtime's is served the
    runtime's; an environment the runtime does not have fails at once."""
    spec = CodeGymSpec(runtime, instances=exported["text"])
    assert sorted(get_env_calls) == sorted(spec.environment_classes) and len(get_env_calls) == COPIES
    assert [r["ability"] for r in spec.rows] == [r["ability"] for r in jsonl(exported["text"])]
    with RuntimeClient(runtime) as client:
        env_id = next(iter(spec.environment_classes))
        expected = runtime_schemas(client, env_id)
    assert list(spec.environment_classes[env_id].tool_schemas) == expected

    rows = jsonl(exported["jsonl"])[:200]
    stale = rows[0]["extra_info"]["env_id"]
    assert stale == env_id
    for row in rows:
        if row["extra_info"]["env_id"] == stale:
            row["tools"] = [
                {**row["tools"][0], "function": {**row["tools"][0]["function"], "name": "Renamed"}}
            ]
    get_env_calls.clear()
    spec = CodeGymSpec(runtime, instances=rows)
    assert get_env_calls == [stale]
    assert list(spec.environment_classes[stale].tool_schemas) == expected

    missing = [*rows[:5], {"ability": "codegym_v1@Nope_1_I__NoEnv@{}", "tools": rows[0]["tools"]}]
    with pytest.raises(EnvNotFound):
        CodeGymSpec(runtime, instances=missing)


@pytest.mark.jail
def test_trl_spec_from_the_runtimes_library_asks_each_environment_once(
    big_library: tuple[Path, int], runtime: str, get_env_calls: list[str]
) -> None:
    library, _ = big_library
    spec = CodeGymSpec(runtime, library=True)
    with sqlite3.connect(library) as db:
        expected = [
            f"codegym_v1@{env_id}@{config_text or config_json}"
            for env_id, config_json, config_text in db.execute(
                "SELECT env_id, config_json, config_text FROM tasks ORDER BY env_id, id"
            )
        ]
    assert [r["ability"] for r in spec.rows] == expected
    assert sorted(get_env_calls) == sorted(set(get_env_calls)) and len(get_env_calls) == COPIES + 12


def test_verl_dataset_is_the_export_read_a_row_group_at_a_time(
    big_library: tuple[Path, int], tmp_path: Path
) -> None:
    """verl's dataset is `codegym export --tools json --split 0.1 --out data/codegym.parquet`
    (docs/trainers/verl.md, examples/verl/train_grpo.sh), which verl reads with `datasets` (Arrow). Its rows: the
    columns verl's RLHFDataset and CodeGymAgentLoop read (prompt, data_source, reward_model,
    extra_info with index, ability), in row groups, whole environments held out."""
    library, tasks = big_library
    out = tmp_path / "data" / "codegym.parquet"
    export(library, out, "--tools", "json", "--split", "0.1")
    val = out.with_name("codegym.val.parquet")
    train_file, val_file = pq.ParquetFile(out), pq.ParquetFile(val)
    assert train_file.metadata.num_rows + val_file.metadata.num_rows == tasks
    assert train_file.metadata.num_row_groups > 1
    names = train_file.schema_arrow.names
    assert {"prompt", "data_source", "reward_model", "extra_info", "ability", "tools"} <= set(names)
    seen: dict[str, set[str]] = {"train": set(), "val": set()}
    indexes: set[str] = set()
    with Library(library) as lib:
        for name, file in (("train", train_file), ("val", val_file)):
            for batch in file.iter_batches(batch_size=1024):
                for row in batch.to_pylist():
                    env_id = row["extra_info"]["env_id"]
                    seen[name].add(env_id)
                    indexes.add(row["extra_info"]["index"])
                    assert parse_ability(row["ability"]).env_id == env_id
                    assert [m["role"] for m in row["prompt"]] == ["user"]  # native calling's prompt
                    assert row["reward_model"] == {"ground_truth": None, "style": "agent_env"}
                    if len(seen[name]) % 500 == 1:
                        record = lib.get(env_id, tasks=False)
                        assert record is not None
                        assert json.loads(row["tools"]) == [t.schema for t in record.tools]
    assert len(indexes) == tasks
    assert seen["train"].isdisjoint(seen["val"])
    assert seen["val"] == held_out_by_rule(library, 0.1) - SAMPLE_IDS

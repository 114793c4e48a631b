"""The library the library-scale bench serves (bench/library_scale.py): the 12 sample environments
with their recordings, N variants of them, and the published Hugging Face layout (Parquet shards of
envs and task rows) written streaming, a row group at a time, never the whole table in memory.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any, overload

from bench.common import Figures, Line, progress
from codegym.contract import analyze_source, split_env_id, tools_text
from codegym.library.store import EnvRecord
from codegym_jobs.export.instances import instance
from codegym_jobs.oracle import read_trajectories

ROOT = Path(__file__).resolve().parent.parent

SAMPLES = ROOT / "codegym" / "samples"
SAMPLE_ENVS = SAMPLES / "envs"
SAMPLE_TASKS = SAMPLES / "tasks.jsonl"
TRAJECTORIES = SAMPLES / "trajectories.jsonl"
ENVS_DIR = "envs_en"
TASKS_DIR = "task_en_instruction_en_env"
PUBLISHED_TASKS_PER_ENV = 80_130 / 22_366
ENVS_PER_SHARD = 6_000
TASKS_PER_SHARD = 12_000
ROWS_PER_GROUP = 512  # rows written (and held) at a time


# ---------------------------------------------------------------------------------------------
# What the library is made of: the 12 samples, and N variants of them.


@dataclass(frozen=True)
class Sample:
    """A sample environment: its source byte for byte, its library record (for the prompts), and
    its recorded trajectories (lines of trajectories.jsonl with steps)."""

    record: EnvRecord
    source: str
    lines: list[Line]


def sample_record(path: Path) -> tuple[EnvRecord, str]:
    """A sample env file read as the importer reads it (statically: the tool list as the prompt
    shows it, the task statement from its `.task.md`), and its source byte for byte."""
    source = path.read_bytes().decode("utf-8")
    code_id, env_class = split_env_id(path.stem)
    spec = analyze_source(source)
    task_file = path.with_suffix(".task.md")
    task_text = task_file.read_text(encoding="utf-8").strip() if task_file.exists() else ""
    record = EnvRecord(path.stem, code_id, env_class, source, spec.sha256, [], tools_text(spec), task_text)
    return record, source


def load_samples(trajectories: Path) -> list[Sample]:
    """The sample environments with their recordings (those with a recording only)."""
    by_env: dict[str, list[Line]] = {}
    for line in read_trajectories(trajectories):
        if line.get("steps"):
            by_env.setdefault(line["env_id"], []).append(line)
    samples = []
    for path in sorted(SAMPLE_ENVS.glob("*__*.py")):
        if path.stem in by_env:
            record, source = sample_record(path)
            samples.append(Sample(record, source, by_env[path.stem]))
    if not samples:
        raise SystemExit(f"no sample environment has a recorded trajectory in {trajectories}")
    return samples


@dataclass(frozen=True)
class Variants:
    """N variant environments of the samples: variant n is sample n % len(samples)."""

    samples: list[Sample]
    n: int
    tasks_per_env: float = PUBLISHED_TASKS_PER_ENV
    seed: int = 1

    def sample(self, n: int) -> Sample:
        return self.samples[n % len(self.samples)]

    def code_id(self, n: int) -> str:
        return f"{self.sample(n).record.code_id}_v{n:05d}"

    def env_id(self, n: int) -> str:
        return f"{self.code_id(n)}__{self.sample(n).record.env_class}"

    def source(self, n: int) -> str:
        text = self.sample(n).source
        newline = "" if text.endswith("\n") else "\n"
        return f"{text}{newline}# library_scale variant {n:05d} of {self.sample(n).record.env_id}\n"

    def tasks(self, n: int) -> list[int]:
        """Which of its sample's recordings variant n has as task configs (indices, 3 or 4 of them
        for the published mean)."""
        rng = random.Random(f"{self.seed}:{n}")
        low = int(self.tasks_per_env)
        count = low + (rng.random() < self.tasks_per_env - low)
        lines = self.sample(n).lines
        return sorted(rng.sample(range(len(lines)), max(1, min(count, len(lines)))))

    def task_count(self) -> int:
        return sum(len(self.tasks(n)) for n in range(self.n))


class VariantLines(Sequence[Line]):
    """Every (variant, one of its task configs) as a trajectory line on that variant's env id, made
    on demand: `random.choice` over it draws a variant uniformly, then one of its recordings."""

    def __init__(self, variants: Variants) -> None:
        self.variants = variants
        self.tasks = [variants.tasks(n) for n in range(variants.n)]
        self.per_env = math.lcm(*{len(t) for t in self.tasks})

    def __len__(self) -> int:
        return self.variants.n * self.per_env

    @overload
    def __getitem__(self, index: int) -> Line: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[Line]: ...
    def __getitem__(self, index: int | slice) -> Line | Sequence[Line]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        n, which = divmod(index % len(self), self.per_env)
        tasks = self.tasks[n]
        line = self.variants.sample(n).lines[tasks[which % len(tasks)]]
        return {**line, "env_id": self.variants.env_id(n)}


# ---------------------------------------------------------------------------------------------
# The published layout, written streaming.


def env_schema() -> Any:
    import pyarrow as pa

    return pa.schema([("env_code", pa.string()), ("env_name", pa.string()), ("source", pa.string())])


def task_schema() -> Any:
    import pyarrow as pa

    text = pa.string()
    return pa.schema(
        [
            ("ability", text),
            ("answer", text),
            ("code_id", text),
            ("data_source", text),
            ("prompt", pa.list_(pa.struct([("role", text), ("content", text), ("name", text)]))),
            ("reward_model", pa.struct([("ground_truth", text), ("style", text)])),
            ("plugin_call_max_round", pa.int64()),
            (
                "extra_info",
                pa.struct(
                    [
                        ("gym_env", text),
                        ("std_traj", text),
                        ("obs_traj", text),
                        ("solve_fc_round", pa.int64()),
                        ("qwen32b_Bo4_score", pa.float64()),
                        ("qwen32b_Bo8_score", pa.float64()),
                        ("index", pa.int64()),
                    ]
                ),
            ),
        ]
    )


def env_rows(variants: Variants) -> Iterator[dict[str, Any]]:
    for n in range(variants.n):
        yield {
            "env_code": variants.source(n),
            "env_name": variants.sample(n).record.env_class,
            "source": variants.code_id(n),
        }


def task_rows(variants: Variants) -> Iterator[dict[str, Any]]:
    """Training-instance rows (codegym_jobs.export.instances's form) with the published extra_info."""
    index = 0
    for n in range(variants.n):
        sample = variants.sample(n)
        record = dataclasses.replace(sample.record, env_id=variants.env_id(n), code_id=variants.code_id(n))
        source = variants.source(n)
        for which in variants.tasks(n):
            line = sample.lines[which]
            rng = random.Random(f"{variants.seed}:{n}:{which}")
            row = instance(record, json.dumps(line["config"]), index=index, extra={})
            row["extra_info"] = {
                "gym_env": source,
                "std_traj": repr([json.loads(action) for action, _ in line["steps"]]),
                "obs_traj": repr([observation for _, observation in line["steps"]]),
                "solve_fc_round": len(line["steps"]),
                "qwen32b_Bo4_score": rng.randint(0, 4) / 4,
                "qwen32b_Bo8_score": rng.randint(0, 8) / 8,
                "index": index,
            }
            yield row
            index += 1


def write_shards(rows: Iterator[dict[str, Any]], folder: Path, schema: Any, total: int, shards: int) -> int:
    """`total` rows into `shards` files train-0000i-of-0000N.parquet, a row group at a time; bytes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    per_shard = math.ceil(total / shards)
    written = 0
    for shard in range(shards):
        path = folder / f"train-{shard:05d}-of-{shards:05d}.parquet"
        with pq.ParquetWriter(path, schema, compression="zstd") as writer:
            shard_rows = islice(rows, per_shard)
            while batch := list(islice(shard_rows, ROWS_PER_GROUP)):
                writer.write_table(pa.Table.from_pylist(batch, schema=schema))
        written += path.stat().st_size
    return written


def generate(variants: Variants, folder: Path) -> tuple[Path, Figures]:
    """The dataset in the published layout, `folder`/dataset, unless it is there already (same N,
    seed); what it holds is in `folder`/library_scale.json, outside the folder that is imported."""
    out = folder / "dataset"
    marker = folder / "library_scale.json"
    wanted = {"envs": variants.n, "seed": variants.seed, "tasks_per_env": variants.tasks_per_env}
    if marker.exists() and json.loads(marker.read_text()).get("wanted") == wanted:
        figures: Figures = json.loads(marker.read_text())["figures"]
        progress(f"dataset {out}: reused ({variants.n:,} envs, {figures['tasks']:,} task rows)")
        return out, {**figures, "reused": True}
    marker.unlink(missing_ok=True)
    shutil.rmtree(out, ignore_errors=True)
    started = time.monotonic()
    tasks = variants.task_count()
    env_shards = max(2, math.ceil(variants.n / ENVS_PER_SHARD))
    task_shards = max(2, math.ceil(tasks / TASKS_PER_SHARD))
    progress(f"writing {variants.n:,} envs ({env_shards} shards), {tasks:,} task rows ({task_shards} shards)")
    env_bytes = write_shards(env_rows(variants), out / ENVS_DIR, env_schema(), variants.n, env_shards)
    task_bytes = write_shards(task_rows(variants), out / TASKS_DIR, task_schema(), tasks, task_shards)
    figures = {
        "envs": variants.n,
        "tasks": tasks,
        "env_shards": env_shards,
        "task_shards": task_shards,
        "parquet_mib": (env_bytes + task_bytes) / 2**20,
        "generate_s": time.monotonic() - started,
    }
    marker.write_text(json.dumps({"wanted": wanted, "figures": figures}))
    progress(f"dataset {out}: {figures['parquet_mib']:.0f} MiB in {figures['generate_s']:.0f} s")
    return out, figures


def write_py_folder(dataset: Path, out: Path) -> None:
    """The same variants as today's importer reads them: `{code_id}__{Env}.py` files and the task
    rows as training-instance JSONL, read back from the Parquet shards a row group at a time."""
    import pyarrow.parquet as pq

    out.mkdir(parents=True, exist_ok=True)
    for path in sorted((dataset / ENVS_DIR).glob("*.parquet")):
        for batch in pq.ParquetFile(path).iter_batches(batch_size=ROWS_PER_GROUP):
            for row in batch.to_pylist():
                name = f"{row['source']}__{row['env_name']}.py"
                (out / name).write_bytes(row["env_code"].encode("utf-8"))
    with open(out / "tasks.jsonl", "w", encoding="utf-8") as jsonl:
        for path in sorted((dataset / TASKS_DIR).glob("*.parquet")):
            for batch in pq.ParquetFile(path).iter_batches(batch_size=ROWS_PER_GROUP):
                for row in batch.to_pylist():
                    jsonl.write(json.dumps(row, ensure_ascii=False) + "\n")

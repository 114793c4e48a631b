"""Library scale benchmark: CodeGym at its published size, a base commit beside the working tree.

CodeGym trained on 13,116 environments; its Hugging Face dataset (VanishD/CodeGym) holds 22,366
environments and 80,130 task rows as Parquet. Nothing can be downloaded here, so the bench writes a
library of that shape from the 12 sample environments (codegym/samples):

  envs_en/train-0000i-of-0000N.parquet              env_code, env_name, source
  task_en_instruction_en_env/train-0000i-of-0000N.parquet
      ability (codegym_v1@{source}__{env_name}@{config json}), answer, code_id, data_source,
      prompt [{role, content, name}], reward_model {ground_truth, style}, plugin_call_max_round,
      extra_info {gym_env, std_traj, obs_traj, solve_fc_round, qwen32b_Bo4_score,
                  qwen32b_Bo8_score, index}

Variant n (of --envs N, 13,200 by default) is sample n % 12: its source byte for byte plus one
trailing comment line naming the variant (so every variant is its own code, its own sha256, its own
compile), under the id `{code_id}_v{n:05d}__{EnvClass}`. Each variant gets 3 or 4 of its sample's
recorded task configs (3.58 a variant on average, the published 80,130 / 22,366), with the
recording as the published columns carry it: `gym_env` the variant's source, `std_traj` and
`obs_traj` the oracle's actions (as dicts) and observations as Python-literal strings,
`solve_fc_round` its step count, made-up Qwen Bo4/Bo8 scores. The shards are written streaming
(pyarrow, a row group at a time), never the whole table in memory.

Then, for the 12-sample library and the N-env one:

  import      `codegym library import DATASET --library FILE` by the working tree, timed (its
              interpreter's start included), with the child's peak RSS (its VmHWM, written by the
              child at exit). The library is built once and the same file
              (copied per stack) is given to both stacks: the base cannot read Parquet. Until the
              working tree reads the published layout, the N-env library is imported from the same
              variants as a folder of `{code_id}__{Env}.py` files plus the task rows as JSONL, and
              the tables say so.
  start       `codegym up --library FILE` (2 sandbox workers, 1 runtime, loopback): seconds until its
              banner (`runtime listening on`), and until the runtime answers a GetEnv.
  memory      PSS (MiB) of the runtime process, of the sandbox worker processes, and of their jails
              (nsjail, zygotes, resident sessions), idle after start and halfway through the steady
              window.
  steady      N rollouts (1,024), think T (4 s, uniform 0.5 T..1.5 T), each episode on a random
              variant env of the whole library replaying one of its recorded trajectories, every
              observation compared with the recording: served/offered steps, step p50/p99, create
              p50/p99 (creates in the window), mismatches, errors (bench/rollout_bench.py's steady).
  burst       a GRPO batch: 64 configurations drawn across the library, 8 episodes of each, all
              created in one burst, then 20 steps each at think 2 s: makespan against its ideal
              (the longest episode's summed think time), create p50/p99.

Targets, printed with PASS/FAIL beside the figures: served >= 97 %, step p50 <= 10 ms, p99 <= 100
ms, create p50 <= 50 ms, p99 <= 500 ms, burst makespan <= 1.10 x ideal, no mismatch, and the
runtime's PSS with N envs within 2x of its PSS with the 12 samples. Every stack runs the
working tree ("new") or a base commit ("base", a `git worktree` of --base), one after the other,
each measurement on a fresh `codegym up` stopped by pid (bench/rollout_bench.py's machinery).
Progress goes to stderr, tables to stdout, every figure to --json FILE. "other CPU %" is the CPU
(100 = one CPU) the machine spent outside the stack and the load generator during the window (the
burst: its whole run), i.e. other work competing with the measurement; past 25 % the measurement is
named after the tables. The
servers' and the imports' logs stay in a codegym-library-scale-logs-* temp dir (printed).

    .venv/bin/python bench/library_scale.py [--quick] [--envs 13200] [--base REV | --no-base]
        [--shapes steady,burst] [--steady 1024:4] [--window-s 30] [--max-seconds 120]
        [--data DIR] [--json FILE]

--quick: 2,000 envs, N/4 rollouts thinking T/4, a quarter of the burst's configurations at T/4,
10 s windows (a few minutes). --data DIR keeps the generated dataset in DIR/dataset (and reuses it
when it was written for the same --envs and --seed).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any, overload

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.rollout_bench import (  # noqa: E402
    CLIENT_TIMEOUT_S,
    BurstPlan,
    Col,
    Figures,
    Line,
    Load,
    Plan,
    Stack,
    StackSpec,
    burst,
    measure,
    on_each_stack,
    points,
    print_table,
    progress,
    report_problems,
    stack_specs,
    up,
)
from codegym import proctree  # noqa: E402
from codegym.contract import analyze_source, split_env_id, tools_text  # noqa: E402
from codegym.library import EnvRecord  # noqa: E402
from codegym_cli.export import instance  # noqa: E402
from codegym_cli.oracle import read_trajectories  # noqa: E402
from codegym_client.async_client import AsyncRuntimeClient  # noqa: E402

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
SHAPES = ("steady", "burst")


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
    """Training-instance rows (codegym_cli.export's form) with the published extra_info."""
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


# ---------------------------------------------------------------------------------------------
# Importing, measured: the working tree's `codegym library import`, wall time and peak RSS.


@dataclass
class Built:
    """A library built once, given (copied) to every stack."""

    label: str  # the tables' point: "12 envs", "13,200 envs"
    path: Path
    form: str  # what was imported
    figures: Figures
    lines: Sequence[Line]  # what the rollouts replay on it
    probe_env: str  # an env id the start-up probe asks for


def library_counts(path: Path) -> tuple[int, int]:
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        envs = db.execute("SELECT COUNT(*) FROM envs").fetchone()[0]
        tasks = db.execute("SELECT COUNT(*) FROM tasks").fetchone()[0]
    return int(envs), int(tasks)


# `python -c HWM_MAIN HWM_FILE ARGS...` runs `codegym ARGS...` and writes its VmHWM (peak RSS, KiB) to
# HWM_FILE at exit. Not wait4's ru_maxrss: Linux folds the memory of the image before exec (the
# forked or vforked copy of this bench, hundreds of MiB once pyarrow is in) into the child's
# ru_maxrss, while VmHWM is the new image's own.
HWM_MAIN = """
import atexit, runpy, sys
out = sys.argv.pop(1)
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            open(out, "w").write(line.split()[1])
atexit.register(hwm)
sys.argv[0] = "codegym"
runpy.run_module("codegym_cli.cli", run_name="__main__", alter_sys=True)
"""


def vm_hwm_kb(pid: int) -> int:
    """A live process's VmHWM in KiB (0 when gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def tree_pss_kb(root: int) -> int:
    """PSS in KiB summed over a process and its descendants now (the importer's worker processes)."""
    total = 0
    for pid in proctree.descendants([root]):
        memory = proctree.memory_kb(pid)
        total += memory.get("Pss", 0) if memory else 0
    return total


def run_import(paths: list[Path], db: Path, log: Path, timeout_s: float) -> Figures:
    """`codegym library import PATHS --library DB` (the working tree's) as a child: wall seconds
    (its interpreter's start included), CPU seconds (its worker processes included), the importing
    process's peak RSS (VmHWM: as it wrote it at exit, else as last polled), the peak PSS of its
    whole tree (polled every 50 ms), and what the library holds."""
    db.unlink(missing_ok=True)
    hwm_file = log.with_name("import.hwm")
    hwm_file.unlink(missing_ok=True)
    argv = [sys.executable, "-c", HWM_MAIN, str(hwm_file), "library", "import", *map(str, paths)]
    argv += ["--library", str(db)]
    hwm = tree_peak = 0
    with open(log, "ab") as out:
        started = time.monotonic()
        proc = subprocess.Popen(
            argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        try:
            while not (reaped := os.wait4(proc.pid, os.WNOHANG))[0]:
                hwm = max(hwm, vm_hwm_kb(proc.pid))
                tree_peak = max(tree_peak, tree_pss_kb(proc.pid))
                if time.monotonic() - started > timeout_s:
                    progress(f"!!! import still running after {timeout_s:.0f} s: SIGKILL its processes")
                    break
                time.sleep(0.05)
        finally:
            if not reaped[0]:  # timed out, or the bench is being stopped: the whole tree, by pid
                for pid in proctree.descendants([proc.pid]):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                reaped = os.wait4(proc.pid, 0)
        wall = time.monotonic() - started
    _, status, usage = reaped
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped by wait4: Popen must not wait again
    written = hwm_file.read_text().strip() if hwm_file.exists() else ""
    envs, tasks = library_counts(db) if db.exists() else (0, 0)
    return {
        "exit_code": proc.returncode,
        "import_s": wall,
        "import_cpu_s": usage.ru_utime + usage.ru_stime,
        "peak_rss_mib": max(int(written or 0), hwm) / 1024,
        "peak_tree_pss_mib": tree_peak / 1024,
        "envs": envs,
        "tasks": tasks,
        "db_mib": db.stat().st_size / 2**20 if db.exists() else None,
        "envs_per_s": envs / wall if wall else None,
    }


def build_sample_library(workdir: Path, logs: Path, samples: list[Sample], timeout_s: float) -> Built:
    """What `codegym up` builds on first run: the sample envs and their task configs."""
    db = workdir / "library-samples.db"
    figures = run_import([SAMPLE_ENVS, SAMPLE_TASKS], db, logs / "import.log", timeout_s)
    if figures["exit_code"] or not figures["envs"]:
        raise SystemExit(f"importing the samples failed: {figures} (log {logs / 'import.log'})")
    lines = [line for sample in samples for line in sample.lines]
    label = f"{figures['envs']} envs"
    progress(f"library {label}: imported in {figures['import_s']:.1f} s")
    return Built(label, db, "sample .py files + tasks.jsonl", figures, lines, samples[0].record.env_id)


def build_scaled_library(
    workdir: Path, logs: Path, dataset: Path, variants: Variants, timeout_s: float
) -> Built:
    """The N-env library from the Parquet dataset; from the same variants as .py files + JSONL when
    the working tree cannot read Parquet yet."""
    db = workdir / "library-scaled.db"
    log = logs / "import.log"
    progress(f"importing {dataset} (Parquet, published layout)")
    figures = run_import([dataset], db, log, timeout_s)
    form = "Parquet (published layout)"
    if figures["exit_code"] or figures["envs"] < variants.n:
        progress(
            f"the working tree did not import the Parquet dataset (exit {figures['exit_code']}, "
            f"{figures['envs']} envs): importing the same variants as .py files + JSONL instead"
        )
        folder = workdir / "py-folder"
        write_py_folder(dataset, folder)
        figures = {**run_import([folder], db, log, timeout_s), "parquet_attempt": figures}
        form = "py folder + JSONL (Parquet import not available)"
        shutil.rmtree(folder, ignore_errors=True)
    if figures["exit_code"] or figures["envs"] < variants.n:
        raise SystemExit(f"importing {variants.n} envs failed: {figures} (log {log})")
    label = f"{figures['envs']:,} envs"
    progress(
        f"library {label}: imported in {figures['import_s']:.1f} s, peak RSS {figures['peak_rss_mib']:.0f} MiB"
    )
    return Built(label, db, form, figures, VariantLines(variants), variants.env_id(variants.n - 1))


def stack_library(spec: StackSpec, built: Built, workdir: Path) -> StackSpec:
    """The stack with its own copy of the library (a stack may write to the file it is given)."""
    copy = workdir / f"{spec.name}-{built.path.name}"
    if not copy.exists():
        shutil.copyfile(built.path, copy)
        wal = built.path.with_name(built.path.name + "-wal")
        if wal.exists():
            shutil.copyfile(wal, copy.with_name(copy.name + "-wal"))
    return dataclasses.replace(spec, library=copy)


# ---------------------------------------------------------------------------------------------
# Memory by role.


def pss_by_role(up_pid: int) -> dict[str, float]:
    """PSS MiB of `codegym up`'s runtime process, its sandbox worker processes, and everything below
    the workers (jails: nsjail, zygotes, resident sessions); `jail_procs` counts those processes."""
    links = proctree.children_by_parent()
    kib = {"runtime": 0, "workers": 0, "jails": 0}
    jail_procs = 0

    def pss(pid: int) -> int:
        memory = proctree.memory_kb(pid)
        return memory.get("Pss", 0) if memory else 0

    for pid in links.get(up_pid, []):
        cmd = proctree.cmdline(pid) or ""
        if "runtime" in cmd:
            kib["runtime"] += pss(pid)
        elif "sandbox" in cmd:
            kib["workers"] += pss(pid)
            jailed = proctree.descendants(links.get(pid, []), links)
            kib["jails"] += sum(pss(child) for child in jailed)
            jail_procs += len(jailed)
    return {**{role: value / 1024 for role, value in kib.items()}, "jail_procs": jail_procs}


# ---------------------------------------------------------------------------------------------
# Measurements on one stack (each on a fresh `codegym up`).


def log_tail(path: Path, count: int = 4) -> str:
    """The last lines of a server log that are not INFO lines, joined."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return " | ".join([line for line in lines if " INFO " not in line][-count:])


@contextlib.contextmanager
def stack_up(spec: StackSpec) -> Iterator[Stack]:
    """rollout_bench's `up`, whose failure to start says why (its log's last lines first)."""
    with contextlib.ExitStack() as running:
        try:
            stack = running.enter_context(up(spec))
        except RuntimeError as exc:
            raise RuntimeError(f"{log_tail(spec.log)} [{str(exc).splitlines()[0]}; log {spec.log}]") from None
        yield stack


async def first_answer(address: str, env_id: str) -> None:
    """The runtime answers: health, then a GetEnv of one library env."""
    async with AsyncRuntimeClient(address, timeout_s=CLIENT_TIMEOUT_S) as client:
        await client.wait_ready(120)
        await client.get_env(env_id)


def flatten_roles(figures: Figures) -> Figures:
    """The role figures as the tables' keys: runtime_idle_mib, jails_load_mib, ..."""
    out: Figures = {}
    for phase, key in (("idle", "idle_by_role"), ("load", "by_role")):
        for role, value in (figures.get(key) or {}).items():
            out[f"{role}_{phase}" if role == "jail_procs" else f"{role}_{phase}_mib"] = value
    return out


def steady_on(spec: StackSpec, built: Built, args: argparse.Namespace) -> Figures:
    """Start the stack (timed), then the steady shape with memory by role idle and under load."""
    n, think = args.steady
    load_1m = os.getloadavg()[0]
    started = time.monotonic()
    with stack_up(spec) as stack:
        banner_s = time.monotonic() - started
        asyncio.run(first_answer(stack.address, built.probe_env))
        answered_s = time.monotonic() - started
        progress(f"{spec.name} up with {built.label}: banner {banner_s:.1f} s, answers {answered_s:.1f} s")
        plan = Plan(
            n, think, args.window_s, args.max_seconds, args.max_episodes, args.seed,
            read_memory=True, read_roles=pss_by_role,
        )  # fmt: skip
        figures = asyncio.run(measure(stack, built.lines, plan))
    return {
        **figures,
        **flatten_roles(figures),
        "start_banner_s": banner_s,
        "start_answered_s": answered_s,
        "loadavg_1m": load_1m,
    }


def grpo_plans(
    lines: Sequence[Line], args: argparse.Namespace, rng: random.Random, load: Load
) -> tuple[list[BurstPlan], str]:
    """`burst_configs` configurations drawn across the library (each a line with at least
    `burst_steps` recorded steps, distinct while the library has enough), `burst_group` episodes
    of each, every episode with its own think times."""
    chosen: list[Line] = []
    seen: set[tuple[str, str]] = set()
    for tries in range(1000 * args.burst_configs):
        if len(chosen) == args.burst_configs:
            break
        line = rng.choice(lines)
        if len(line["steps"]) < args.burst_steps:
            continue
        key = (line["env_id"], json.dumps(line["config"], sort_keys=True))
        if key in seen and tries < 100 * args.burst_configs:
            continue  # distinct first; repeats only once distinct ones are scarce (12 samples)
        seen.add(key)
        chosen.append(line)
    if not chosen:
        raise RuntimeError(f"no trajectory has {args.burst_steps} steps")
    plans = []
    for line in chosen:
        steps = line["steps"][: args.burst_steps]
        plans += [(line, steps, load.thinks(len(steps))) for _ in range(args.burst_group)]
    envs = len({line["env_id"] for line in chosen})
    note = (
        f"{len(chosen)} configurations ({len(seen)} distinct, {envs} envs) x {args.burst_group} episodes"
        f" of {args.burst_steps} steps"
    )
    return plans, note


def burst_on(spec: StackSpec, built: Built, args: argparse.Namespace) -> Figures:
    load_1m = os.getloadavg()[0]
    started = time.monotonic()
    with stack_up(spec) as stack:
        banner_s = time.monotonic() - started
        figures = asyncio.run(burst(stack, built.lines, args, grpo_plans))
    return {**figures, "start_banner_s": banner_s, "loadavg_1m": load_1m}


# ---------------------------------------------------------------------------------------------
# Tables: the libraries, start and memory, the shapes (rollout_bench's printer), the targets.


def print_libraries(libraries: list[Built], generated: Figures | None) -> None:
    header = ["library", "imported from", "envs", "tasks", "import s", "CPU s", "envs/s", "peak RSS MiB",
              "peak tree PSS MiB", "db MiB"]  # fmt: skip
    body = []
    for built in libraries:
        f = built.figures
        body.append([
            built.label, built.form, f"{f['envs']:,}", f"{f['tasks']:,}", f"{f['import_s']:.1f}",
            f"{f['import_cpu_s']:.1f}", f"{f['envs_per_s']:.0f}", f"{f['peak_rss_mib']:.0f}",
            f"{f['peak_tree_pss_mib']:.0f}", f"{f['db_mib']:.1f}",
        ])  # fmt: skip
    print(
        "\nlibraries: `codegym library import` of the working tree, built once and copied to every stack"
        " (import s: wall, interpreter start included; CPU s: its worker processes included; peak RSS: the"
        " importing process; peak tree PSS: with its workers, polled)"
    )
    print_rows(header, body)
    if generated:
        print(
            f"  dataset: {generated['envs']:,} envs in {generated['env_shards']} shards, {generated['tasks']:,} "
            f"task rows in {generated['task_shards']} shards, {generated['parquet_mib']:.0f} MiB Parquet, "
            f"written in {generated['generate_s']:.0f} s" + (" (reused)" if generated.get("reused") else "")
        )
        parquet = next(
            (b.figures.get("parquet_attempt") for b in libraries if "parquet_attempt" in b.figures), None
        )
        if parquet:
            print(f"  the Parquet import itself: exit {parquet['exit_code']}, {parquet['envs']} envs")
    sys.stdout.flush()


def print_rows(header: list[str], body: list[list[str]]) -> None:
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    for line in [header, *body]:
        print(
            "  ".join(
                t.ljust(w) if i < 2 else t.rjust(w) for i, (t, w) in enumerate(zip(line, widths, strict=True))
            )
        )


MEMORY_COLUMNS = (
    "start and memory: `codegym up` to its banner and to a GetEnv answer; PSS MiB idle and under steady load",
    [
        Col("banner s", "start_banner_s", ".1f", ratio=True),
        Col("answers s", "start_answered_s", ".1f", ratio=True),
        Col("runtime idle", "runtime_idle_mib", ".0f", ratio=True),
        Col("workers idle", "workers_idle_mib", ".0f", ratio=True),
        Col("jails idle", "jails_idle_mib", ".0f", ratio=True),
        Col("runtime load", "runtime_load_mib", ".0f", ratio=True),
        Col("workers load", "workers_load_mib", ".0f", ratio=True),
        Col("jails load", "jails_load_mib", ".0f", ratio=True),
        Col("jail procs", "jail_procs_load", ".0f"),
        Col("stack load", "pss_mib", ".0f", ratio=True),
    ],
)
STEADY_COLUMNS = (
    "steady: N rollouts thinking T (N:T), each episode on a random env of the library; figures over the window",
    [
        Col("offered/s", "offered"),
        Col("served/s", "served", ratio=True),
        Col("served %", "served_pct", ".1f"),
        Col("step p50 ms", "p50_ms", ".1f", ratio=True),
        Col("step p99 ms", "p99_ms", ".1f", ratio=True),
        Col("creates", "creates_in_window", "d"),
        Col("create p50 ms", "create_p50_ms", ".1f", ratio=True),
        Col("create p99 ms", "create_p99_ms", ".1f", ratio=True),
        Col("CPU ms/step", "cpu_ms_per_step", ".2f", ratio=True),
        Col("stack CPU %", "stack_cpu_pct"),
        Col("refused", "refusals", "d"),
        Col("errors", "errors", "d"),
        Col("mismatch", "mismatches", "d"),
        Col("gen CPU %", "gen_cpu_pct"),
        Col("other CPU %", "other_cpu_pct"),
    ],
)
BURST_COLUMNS = (
    "GRPO burst: C configurations x G episodes created at once, then S steps each thinking T",
    [
        Col("episodes", "n", "d"),
        Col("all created s", "all_created_s", ".2f", ratio=True),
        Col("create p50 ms", "create_p50_ms", ".1f", ratio=True),
        Col("create p99 ms", "create_p99_ms", ".1f", ratio=True),
        Col("makespan s", "makespan_s", ".1f", ratio=True),
        Col("ideal s", "ideal_s", ".1f"),
        Col("makespan/ideal", "makespan_ratio", ".2f"),
        Col("step p50 ms", "p50_ms", ".1f", ratio=True),
        Col("step p99 ms", "p99_ms", ".1f", ratio=True),
        Col("refused", "refusals", "d"),
        Col("errors", "errors", "d"),
        Col("mismatch", "mismatches", "d"),
        Col("other CPU %", "other_cpu_pct"),
    ],
)


@dataclass(frozen=True)
class Target:
    name: str
    shape: str
    key: str
    op: str  # "<=", ">=" or "=="
    bound: float
    unit: str = ""
    spec: str = ".1f"

    def met(self, value: float) -> bool:
        if self.op == "<=":
            return value <= self.bound
        if self.op == ">=":
            return value >= self.bound
        return value == self.bound

    @property
    def text(self) -> str:
        return f"{self.op} {self.bound:g}{self.unit}"


TARGETS = [
    Target("steady served/offered", "steady", "served_pct", ">=", 97, " %"),
    Target("steady step p50", "steady", "p50_ms", "<=", 10, " ms", ".2f"),
    Target("steady step p99", "steady", "p99_ms", "<=", 100, " ms"),
    Target("steady create p50", "steady", "create_p50_ms", "<=", 50, " ms"),
    Target("steady create p99", "steady", "create_p99_ms", "<=", 500, " ms"),
    Target("steady mismatches", "steady", "mismatches", "==", 0, "", "d"),
    Target("burst makespan/ideal", "burst", "makespan_ratio", "<=", 1.10, "x", ".3f"),
    Target("burst create p50", "burst", "create_p50_ms", "<=", 50, " ms"),
    Target("burst create p99", "burst", "create_p99_ms", "<=", 500, " ms"),
    Target("burst mismatches", "burst", "mismatches", "==", 0, "", "d"),
]
PSS_TARGETS = [  # the runtime's PSS with N envs over its PSS with the samples
    Target("runtime PSS idle, N / 12", "steady", "runtime_idle_mib", "<=", 2.0, "x", ".2f"),
    Target("runtime PSS load, N / 12", "steady", "runtime_load_mib", "<=", 2.0, "x", ".2f"),
]


def judge(results: dict[str, list[Figures]], libraries: list[Built], specs: list[StackSpec]) -> list[Figures]:
    """Every target against every (stack, library) it applies to: value and verdict (None = no figure)."""
    verdicts = []
    for spec in specs:
        for built in libraries:
            for target in TARGETS:
                row = find(results, target.shape, spec.name, built.label)
                value = row.get(target.key) if row else None
                verdicts.append(verdict(target, spec.name, built.label, value))
        small, large = libraries[0], libraries[-1]
        for target in PSS_TARGETS:
            a = find(results, target.shape, spec.name, small.label)
            b = find(results, target.shape, spec.name, large.label)
            va, vb = (a or {}).get(target.key), (b or {}).get(target.key)
            verdicts.append(
                verdict(target, spec.name, large.label, vb / va if va and vb is not None else None)
            )
    return verdicts


def find(results: dict[str, list[Figures]], shape: str, stack: str, point: str) -> Figures | None:
    for row in results.get(shape, []):
        if row["stack"] == stack and row["point"] == point and "failed" not in row:
            return row
    return None


def verdict(target: Target, stack: str, library: str, value: float | None) -> Figures:
    met = None if value is None else target.met(value)
    return {
        "target": target.name,
        "bound": target.text,
        "stack": stack,
        "library": library,
        "value": value,
        "met": met,
    }


def print_targets(verdicts: list[Figures]) -> None:
    """A row per target, a column per (stack, library): the figure and PASS/FAIL."""
    columns = list(dict.fromkeys((v["stack"], v["library"]) for v in verdicts))
    specs = {t.name: t for t in [*TARGETS, *PSS_TARGETS]}
    header = ["target", "bound", *(f"{stack} {library}" for stack, library in columns)]
    body = []
    for name in dict.fromkeys(v["target"] for v in verdicts):
        cells = []
        for stack, library in columns:
            found = [v for v in verdicts if (v["target"], v["stack"], v["library"]) == (name, stack, library)]
            if not found:
                cells.append("")
                continue
            v = found[0]
            if v["value"] is None:
                cells.append("n/a")
            else:
                spec = specs[name].spec
                shown = format(int(v["value"]) if spec == "d" else v["value"], spec)
                cells.append(f"{shown} {'PASS' if v['met'] else 'FAIL'}")
        body.append([name, specs[name].text, *cells])
    print("\ntargets (PASS/FAIL per stack and library; PSS ratios in the N-env columns)")
    print_rows(header, body)
    sys.stdout.flush()


# ---------------------------------------------------------------------------------------------
# Command line.


BUSY_CPU_PCT = 25.0  # other work's CPU (100 = one CPU) past which a measurement is called contended


def report_busy(results: dict[str, list[Figures]]) -> None:
    """Measurements during which other work on the machine took more than BUSY_CPU_PCT of its CPU:
    their latencies include that contention."""
    busy = [
        f"{shape} {row['point']} on {row['stack']} ({row['other_cpu_pct']:.0f} %)"
        for shape, rows in results.items()
        for row in rows
        if (row.get("other_cpu_pct") or 0) > BUSY_CPU_PCT
    ]
    if busy:
        cpus = os.cpu_count()
        print(
            f"!!! other work on the machine ({cpus} CPUs = {100 * (cpus or 1)} %) took CPU during: {', '.join(busy)}"
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--envs", type=int, help="environments in the generated library (13,200; --quick 2,000)"
    )
    parser.add_argument(
        "--tasks-per-env", type=float, default=PUBLISHED_TASKS_PER_ENV, help="mean task rows per env"
    )
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)}")
    parser.add_argument("--base", default="9623ec1", help="base commit measured beside the working tree")
    parser.add_argument("--no-base", action="store_true", help="measure the working tree only")
    parser.add_argument(
        "--up-args", default="", help="more `codegym up` options for the working tree's stack"
    )
    parser.add_argument(
        "--steady", type=lambda s: points(s)[0], default=(1024, 4.0), help="N:T of the steady shape"
    )
    parser.add_argument("--window-s", type=float, default=30.0, help="steady window after the warm-up, s")
    parser.add_argument("--burst-configs", type=int, default=64, help="configurations of the GRPO burst")
    parser.add_argument("--burst-group", type=int, default=8, help="episodes of each configuration")
    parser.add_argument("--burst-steps", type=int, default=20, help="steps each burst episode plays")
    parser.add_argument("--burst-think", type=float, default=2.0, help="think time T of the burst, s")
    parser.add_argument("--max-seconds", type=float, default=120.0, help="time cap of each measurement")
    parser.add_argument("--max-episodes", type=int, default=50_000, help="episode cap of each measurement")
    parser.add_argument("--import-timeout", type=float, default=1800.0, help="time cap of each import, s")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--trajectories", type=Path, default=TRAJECTORIES)
    parser.add_argument("--data", type=Path, help="keep the generated dataset here (reused when it matches)")
    parser.add_argument("--json", type=Path, help="also write every figure to this file")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 2,000 envs, N/4 at T/4, burst C/4 at T/4, 10 s windows",
    )
    args = parser.parse_args(argv)
    args.shapes = [s for s in args.shapes.split(",") if s]
    if unknown := set(args.shapes) - set(SHAPES):
        parser.error(f"unknown shapes: {', '.join(sorted(unknown))}")
    if args.envs is None:
        args.envs = 2_000 if args.quick else 13_200
    if args.envs < 1:
        parser.error("--envs must be at least 1")
    if args.quick:
        n, think = args.steady
        args.steady = (max(1, n // 4), max(0.25, think / 4))
        args.window_s = min(args.window_s, 10.0)
        args.burst_configs = max(1, args.burst_configs // 4)
        args.burst_think /= 4
        args.max_seconds = min(args.max_seconds, 60.0)
    args.burst_n = args.burst_configs * args.burst_group  # rollout_bench's burst reads these names
    return args


def run_shapes(
    specs: list[StackSpec], libraries: list[Built], args: argparse.Namespace, workdir: Path
) -> dict[str, list[Figures]]:
    """Per library, per shape, each stack in turn on its own copy of the library."""
    runs: dict[str, Callable[[StackSpec, Built, argparse.Namespace], Figures]] = {
        "steady": steady_on,
        "burst": burst_on,
    }
    results: dict[str, list[Figures]] = {shape: [] for shape in args.shapes}
    for built in libraries:
        copies = [stack_library(spec, built, workdir) for spec in specs]
        for shape in args.shapes:

            def one(spec: StackSpec, shape: str = shape, built: Built = built) -> Figures:
                return runs[shape](spec, built, args)

            results[shape] += on_each_stack(copies, built.label, one)
    return results


def main() -> None:
    args = parse_args()
    # SIGTERM ends the bench like Ctrl-C: the blocks below stop the servers and remove the worktree.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    results: dict[str, list[Figures]] = {}
    with contextlib.ExitStack() as cleanup:
        workdir = Path(tempfile.mkdtemp(prefix="codegym-library-scale-"))
        workdir.chmod(0o755)
        cleanup.callback(shutil.rmtree, workdir, True)
        # Logs outlive the run (the servers' stderr, the imports' output): for a post-mortem.
        logs = Path(tempfile.mkdtemp(prefix="codegym-library-scale-logs-"))
        progress(f"logs in {logs}")
        specs = [
            dataclasses.replace(spec, log=logs / f"{spec.name}.log")
            for spec in stack_specs(args, cleanup, workdir)
        ]
        samples = load_samples(args.trajectories)
        variants = Variants(samples, args.envs, args.tasks_per_env, args.seed)
        dataset, generated = generate(variants, args.data or workdir)
        libraries = [
            build_sample_library(workdir, logs, samples, args.import_timeout),
            build_scaled_library(workdir, logs, dataset, variants, args.import_timeout),
        ]
        print_libraries(libraries, generated)
        results = run_shapes(specs, libraries, args, workdir)
        if "steady" in results:
            print_table("memory", results["steady"], specs, MEMORY_COLUMNS)
            print_table("steady", results["steady"], specs, STEADY_COLUMNS)
        if "burst" in results:
            print_table("burst", results["burst"], specs, BURST_COLUMNS)
        verdicts = judge(results, libraries, specs)
        print_targets(verdicts)
        report_problems(results)
        report_busy(results)
        progress(f"servers' and imports' logs in {logs}")
    if args.json:
        meta = {
            "stacks": {s.name: s.revision for s in specs},
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "cpus": os.cpu_count(),
            "loadavg": os.getloadavg(),
        }
        libs = {b.label: {"form": b.form, **b.figures} for b in libraries}
        document = {
            "meta": meta,
            "dataset": generated,
            "libraries": libs,
            "shapes": results,
            "targets": verdicts,
        }
        args.json.write_text(json.dumps(document, indent=2, default=str))
        progress(f"figures written to {args.json}")


if __name__ == "__main__":
    main()

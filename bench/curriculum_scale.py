"""The curriculum bench's "scale" part (bench/curriculum_bench.py): what reading the episode record
costs at the published library's size, in both record stores, beside the base commit.

A library of --scale-envs variants (22,366: 80,000+ tasks, as CodeGym published it) is made by
bench/library_data.py and imported once. A record of --record-episodes episodes in 8 runs (groups
of 8 episodes per task, the policy version rising every 4 groups, each episode's steps served, a
few environments failing their steps until quarantined) is written by the runtime's own `Recorder`
into the store: the record file beside a copy of the library (SQLite), or a bench-owned
redis-server given to `codegym up --sessions` (Redis). Each stack (base, new) serves its own copy.
Per stack and store:

  sample      `SampleTasks` of 512 for a run, over loopback (the server's time plus ~1 ms):
              the first call (summaries and, on an older record, its indexing), then the median
              and max of --scale-calls calls over the runs and seeds
  stats rpc   `Stats(run, played_only)` read to its end by a client: median of --scale-calls
  stats cli   `codegym library stats --run R --played-only` end to end, the command's own start
              included: median of 3; beside it that start (`codegym library stats --help`)
  idle CPU    the runtime's CPU over --idle-s seconds of no traffic (the gauges refresh every
              30 s): with the big library and record, and with the sample library (12 envs) and
              no record. Flat in the number of tasks: big <= 1.5 x small + 50 ms/min
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.common import Figures, median, progress
from bench.library_build import run_import
from bench.library_data import (
    ENVS_DIR,
    TASKS_DIR,
    TRAJECTORIES,
    Variants,
    env_rows,
    env_schema,
    load_samples,
    task_rows,
    task_schema,
    write_shards,
)
from bench.stacks import StackSpec, up
from bench.tables import Col
from bench.targets import verdict
from codegym import proctree
from codegym.library.store import Library
from codegym.procs import RedisServer
from codegym_client.async_client import AsyncRuntimeClient
from services.runtime.episode_record import EpisodeOutcome, Recorder, RecordStore
from services.runtime.record_store import RedisRecordStore, SqliteRecordStore, record_path_for

STORES = ("sqlite", "redis")
RUNS = 8
GROUP = 8
SAMPLE_N = 512
QUARANTINED_ENVS = 3


def build_big_library(envs: int, seed: int, workdir: Path, logs: Path) -> Path:
    """`envs` variants of the samples in the published layout, imported by `codegym library import`."""
    variants = Variants(load_samples(TRAJECTORIES), envs, seed=seed)
    dataset, library = workdir / "scale-dataset", workdir / "scale.db"
    write_shards(env_rows(variants), dataset / ENVS_DIR, env_schema(), variants.n, 2)
    rng = random.Random(f"prior:{seed}")

    def rows() -> Iterator[dict[str, Any]]:
        for row in task_rows(variants):  # a published Bo4 pass rate for every task, as CodeGym's
            row["extra_info"]["qwen32b_Bo4_score"] = rng.choice((0.0, 0.0, 0.25, 0.5, 0.75, 1.0))
            yield row

    write_shards(rows(), dataset / TASKS_DIR, task_schema(), variants.task_count(), 2)
    imported = run_import([dataset], library, logs / "scale-import.log", 3600.0)
    if imported["exit_code"] or imported["envs"] < variants.n:
        raise SystemExit(f"importing {variants.n} envs failed: {imported} (log {logs / 'scale-import.log'})")
    shutil.rmtree(dataset, ignore_errors=True)
    progress(
        f"scale library: {imported['envs']:,} envs, {imported['tasks']:,} tasks in {imported['import_s']:.0f} s"
    )
    return library


def task_keys(library: Path) -> list[tuple[str, str]]:
    with Library(library, read_only=True) as lib:
        return [(task.env_id, task.config_json) for task in lib.iter_tasks()]


async def write_record(
    store: RecordStore, tasks: list[tuple[str, str]], episodes: int, seed: int
) -> list[str]:
    """The record a runtime would have written after `episodes` episodes in `RUNS` runs; the runs."""
    rng = random.Random(f"record:{seed}")
    recorder = Recorder(store, lambda env_id, config: 0)
    runs = [f"scale-run-{n}" for n in range(RUNS)]
    skill: dict[tuple[str, str], float] = {}
    played = 0
    n = 0
    while played < episodes:
        run = runs[n % RUNS]
        env_id, config = tasks[rng.randrange(len(tasks))]
        p = skill.setdefault((env_id, config), rng.choice((0.0, 0.3, 0.6, 1.0)))
        version = n // (4 * RUNS)
        for _ in range(GROUP):
            passed = rng.random() < p
            for _ in range(4):
                recorder.step(env_id, config, run, None)
            recorder.episode(
                EpisodeOutcome(f"s{played}", env_id, config, run, version, float(passed), 4, "done")
            )
            played += 1
        n += 1
        if n % 16 == 0:
            await recorder.flush()
    for env_id, config in rng.sample(tasks, QUARANTINED_ENVS):
        for _ in range(30):
            recorder.step(env_id, config, runs[0], "env_error", "boom")
    await recorder.flush()
    return runs


async def record_into(
    store: str, target: Path | str, tasks: list[tuple[str, str]], args: argparse.Namespace
) -> list[str]:
    held: RecordStore = SqliteRecordStore(target) if store == "sqlite" else RedisRecordStore(str(target))
    try:
        return await write_record(held, tasks, args.record_episodes, args.seed)
    finally:
        await held.close()


async def measure_calls(address: str, runs: list[str], calls: int) -> Figures:
    async with AsyncRuntimeClient(address, timeout_s=600) as client:
        await client.wait_ready(60)
        started = time.perf_counter()
        first = await client.sample_tasks(runs[0], SAMPLE_N, seed=0)
        first_s = time.perf_counter() - started
        samples, stats = [], []
        for i in range(calls):
            started = time.perf_counter()
            answer = await client.sample_tasks(runs[i % len(runs)], SAMPLE_N, seed=i + 1)
            samples.append(time.perf_counter() - started)
            if len(answer.tasks) != SAMPLE_N:
                raise RuntimeError(f"SampleTasks gave {len(answer.tasks)} of {SAMPLE_N}")
        for i in range(calls):
            started = time.perf_counter()
            entries = await client.stats(runs[i % len(runs)], played_only=True)
            stats.append(time.perf_counter() - started)
        played = sum(1 for e in entries if e.WhichOneof("entry") == "task")
    return {
        "sample_first_ms": 1000 * first_s,
        "sample_p50_ms": 1000 * median(samples),
        "sample_max_ms": 1000 * max(samples),
        "stats_rpc_ms": 1000 * median(stats),
        "played": played,
        "pools": dict(first.pools),
    }


def stats_cli(spec: StackSpec, address: str, run: str) -> float:
    """`codegym library stats --run R --played-only` end to end, median of 3 (seconds)."""
    times = []
    for _ in range(3):
        started = time.perf_counter()
        subprocess.run(
            [
                sys.executable,
                "-m",
                "codegym_cli.cli",
                "library",
                "stats",
                "--run",
                run,
                "--played-only",
                "--target",
                address,
            ],
            cwd=spec.tree,
            env=spec.env,
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        times.append(time.perf_counter() - started)
    return median(times)


def cli_start(spec: StackSpec) -> float:
    """`codegym library stats --help`: the command's own start, median of 3 (seconds)."""
    times = []
    for _ in range(3):
        started = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "codegym_cli.cli", "library", "stats", "--help"],
            cwd=spec.tree,
            env=spec.env,
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        times.append(time.perf_counter() - started)
    return median(times)


def idle_cpu_ms_per_min(stack_pid: int, idle_s: float) -> float:
    """The runtime's CPU over `idle_s` seconds of no traffic, in ms per minute."""
    runtime = runtime_pid(stack_pid)
    before = proctree.cpu_ticks(runtime, reaped=False)
    time.sleep(idle_s)  # the measurement window itself: nothing is ordered by it
    ticks = proctree.cpu_ticks(runtime, reaped=False) - before
    return 1000 * ticks / proctree.CLK_TCK * 60 / idle_s


def runtime_pid(up_pid: int) -> int:
    for pid in proctree.children_by_parent().get(up_pid, []):
        if "runtime" in (proctree.cmdline(pid) or ""):
            return pid
    raise RuntimeError("no runtime under codegym up")


@contextlib.contextmanager
def store_args(store: str, logs: Path) -> Iterator[tuple[RedisServer | None, tuple[str, ...]]]:
    if store == "sqlite":
        yield None, ()
        return
    redis = RedisServer(name="bench redis")
    try:
        yield redis, ("--sessions", redis.url)
    finally:
        redis.stop()


def run_scale(args: argparse.Namespace, specs: list[StackSpec], workdir: Path, logs: Path) -> list[Figures]:
    """Each store, each stack: the figures of the module doc."""
    library = build_big_library(args.scale_envs, args.seed, workdir, logs)
    tasks = task_keys(library)
    rows: list[Figures] = []
    for store in STORES:
        for spec in specs:
            folder = workdir / f"scale-{spec.name}-{store}"
            folder.mkdir()
            copy = folder / "library.db"
            shutil.copyfile(library, copy)
            with store_args(store, logs) as (redis, extra):
                target: Path | str = record_path_for(copy) if redis is None else redis.url
                runs = asyncio.run(record_into(store, target, tasks, args))
                progress(
                    f"scale {store} {spec.name}: record of {args.record_episodes} episodes in {RUNS} runs written"
                )
                stack_spec = StackSpec(
                    spec.name, spec.tree, spec.revision, copy, logs / f"scale-{spec.name}.log", extra
                )
                with up(stack_spec) as stack:
                    figures = asyncio.run(measure_calls(stack.address, runs, args.scale_calls))
                    figures["stats_cli_s"] = stats_cli(spec, stack.address, runs[0])
                    figures["cli_start_s"] = cli_start(spec)
                    figures["idle_cpu_ms_min"] = idle_cpu_ms_per_min(stack.pid, args.idle_s)
                small = folder / "samples.db"  # built by `codegym up` from the sample environments
                with store_args(store, logs) as (_, small_extra):
                    small_spec = StackSpec(
                        spec.name,
                        spec.tree,
                        spec.revision,
                        small,
                        logs / f"scale-{spec.name}.log",
                        small_extra,
                    )
                    with up(small_spec) as stack:
                        figures["idle_cpu_small_ms_min"] = idle_cpu_ms_per_min(stack.pid, args.idle_s)
            progress(
                f"scale {store} {spec.name}: SampleTasks p50 {figures['sample_p50_ms']:.0f} ms (first "
                f"{figures['sample_first_ms']:.0f}), Stats {figures['stats_rpc_ms']:.0f} ms, CLI "
                f"{figures['stats_cli_s']:.2f} s, idle {figures['idle_cpu_ms_min']:.0f} vs "
                f"{figures['idle_cpu_small_ms_min']:.0f} ms/min"
            )
            rows.append({"stack": spec.name, "point": store, "tasks": len(tasks), **figures})
    return rows


def scale_targets(rows: list[Figures]) -> list[Figures]:
    out = []
    for row in rows:
        if row["stack"] != "new":
            continue
        store = row["point"]
        sample, cli, rpc = row["sample_p50_ms"], row["stats_cli_s"], row["stats_rpc_ms"]
        big, small = row["idle_cpu_ms_min"], row["idle_cpu_small_ms_min"]
        out += [
            verdict(
                f"{store}: SampleTasks 512, p50", "<= 100 ms", f"{sample:.0f} ms", sample <= 100, ms=sample
            ),
            verdict(f"{store}: stats --played-only, end to end", "<= 1 s", f"{cli:.2f} s", cli <= 1.0, s=cli),
            verdict(f"{store}: Stats played_only at the server", "beside", f"{rpc:.0f} ms", None, ms=rpc),
            verdict(
                f"{store}: the command's start (--help)",
                "beside",
                f"{row['cli_start_s']:.2f} s",
                None,
                s=row["cli_start_s"],
            ),
            verdict(
                f"{store}: idle CPU, {row['tasks']:,} tasks vs 12 envs",
                "<= 1.5 x + 50 ms/min",
                f"{big:.0f} vs {small:.0f} ms/min",
                big <= 1.5 * small + 50,
                big=big,
                small=small,
            ),
        ]
    return out


SCALE_COLUMNS = (
    "scale: reading the record at the library's size (8 runs), per store; new/base ratios below each",
    [
        Col("tasks", "tasks", "d"),
        Col("played", "played", "d"),
        Col("sample first ms", "sample_first_ms", ".0f"),
        Col("sample p50 ms", "sample_p50_ms", ".1f", ratio=True),
        Col("sample max ms", "sample_max_ms", ".1f"),
        Col("stats rpc ms", "stats_rpc_ms", ".1f", ratio=True),
        Col("stats cli s", "stats_cli_s", ".2f", ratio=True),
        Col("cli start s", "cli_start_s", ".2f"),
        Col("idle ms/min", "idle_cpu_ms_min", ".0f"),
        Col("idle small ms/min", "idle_cpu_small_ms_min", ".0f"),
    ],
)

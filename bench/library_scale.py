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
ms, create p50 <= 50 ms, p99 <= 500 ms (steady: a burst's creates at once queue for CPU, which
its makespan prices), burst makespan <= 1.10 x ideal, no mismatch, and the runtime's PSS with N
envs within 2x of its PSS with the 12 samples. Every stack runs the
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
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import Figures, Line, progress  # noqa: E402
from bench.library_build import Built, build_sample_library, build_scaled_library, stack_library  # noqa: E402
from bench.library_data import PUBLISHED_TASKS_PER_ENV, TRAJECTORIES, Variants, generate, load_samples  # noqa: E402
from bench.library_targets import (  # noqa: E402
    BURST_COLUMNS,
    MEMORY_COLUMNS,
    STEADY_COLUMNS,
    print_libraries,
    print_targets,
    target_verdicts,
)
from bench.load import CLIENT_TIMEOUT_S, BurstPlan, Load, Plan, burst, measure  # noqa: E402
from bench.rollout_bench import on_each_stack, points  # noqa: E402
from bench.stacks import Stack, StackSpec, stack_specs, up  # noqa: E402
from bench.tables import print_table, report_busy, report_problems  # noqa: E402
from codegym import proctree  # noqa: E402
from codegym_client.async_client import AsyncRuntimeClient  # noqa: E402

SHAPES = ("steady", "burst")


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
            n,
            think,
            args.window_s,
            args.max_seconds,
            args.max_episodes,
            args.seed,
            read_memory=True,
            read_roles=pss_by_role,
            staggered=args.staggered,
        )
        lines = built.lines
        if args.episode_steps:
            # Episodes cut to their first K steps: creates recur K times less far apart.
            lines = [{**line, "steps": line["steps"][: args.episode_steps]} for line in lines]
        figures = asyncio.run(measure(stack, lines, plan))
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
# Command line.


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
    parser.add_argument(
        "--episode-steps",
        type=int,
        default=0,
        help="steady episodes play at most this many of their recorded steps (0: all; at 1,024:4 on "
        "13,200 envs, 10 gave 17-19 creates/s, 6 gave 36 on average, 44 with --staggered)",
    )
    parser.add_argument(
        "--staggered",
        action="store_true",
        help="each rollout's first steady episode plays a random prefix of its recording, so episodes "
        "end at every phase instead of in one wave an episode after the ramp (the window then sees "
        "creates at their steady rate, not the wave's)",
    )
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
            if args.staggered:
                print("  (--staggered: each rollout's first episode a random prefix of its recording)")
        if "burst" in results:
            print_table("burst", results["burst"], specs, BURST_COLUMNS)
        verdicts = target_verdicts(results, libraries, specs)
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

"""Rollout benchmark: the service under a trainer's shape of load, a base commit beside the working tree.

A trainer does not step back to back: each rollout waits for its model between steps (the think
time), so thousands of episodes are in flight while few steps are. Here a rollout replays recorded
oracle trajectories (codegym/samples/trajectories.jsonl, lines with steps): create a session, then for
each recorded step think a time drawn uniformly in [0.5 T, 1.5 T], send the action and compare the
observation with the recording, then close the session and start the next episode. Step latency is
the step call alone (capacity refusals resent after their `retry_after_s` included), never the
think time. Shapes (--shapes, all by default):

  steady      N rollouts, think T, started at random offsets within the first T s; after a warm-up
              (1.5 T and every rollout's first step), a window: offered (N/T) against served
              steps/s, step p50/p99, stack CPU per step, whole-stack PSS per episode in flight
              (KiB/episode; +KiB/episode: the PSS added over the idle stack's, per episode).
  burst       N episodes created at once, then each plays 20 steps with think T; makespan against
              the ideal (the longest episode's summed think time, drawn up front).
  overload    the back-to-back peak (32 sessions, no think), then 256 rollouts thinking so that
              they offer twice that peak: served against the peak, refusals, p50/p99.
  backtoback  32 sessions and 1 session with no think: steps/s and p50, a regression check.
  openenv     the steady shape through the OpenEnv gateway, one WebSocket per episode as OpenEnv's
              EnvClient opens them.

Every measurement starts its own `codegym up` (2 sandbox workers, 1 runtime, 127.0.0.1 only) and
stops it by pid when done, for the working tree ("new") and for a base commit ("base", checked out
with `git worktree add --detach` into a temp dir and run from there, its modules first on
PYTHONPATH), one stack after the other on the same load. Figures of a 2-core machine: the load
generator shares it with the stack (its own CPU is in the tables).

Alternating runs (--alternate=OPTIONS): only the steady shape (1,024:4 unless --steady says
otherwise), on the working tree alone, arm A with --up-args and arm B with OPTIONS added, in turn
A B A B ... (--runs pairs), each on a fresh stack: per run CPU per step and step p99, per arm the
mean and the run-to-run spread, and the verdicts (CPU per step within 5 %, p99 within the spread).
E.g. captures on against off: `--alternate=--no-capture` (bench/alternate.py).

The parts, each its own module: the stacks (bench/stacks.py), the episodes over either transport
(bench/episodes.py), the load generator and what it measures (bench/load.py), each episode judged
against its recording (bench/judge.py), and the tables (bench/tables.py).

    .venv/bin/python bench/rollout_bench.py [--quick] [--shapes steady,burst] [--base REV | --no-base]
        [--steady 256:1,1024:4,4096:16] [--window-s 30] [--client-steps unary,stream] [--json FILE]
    .venv/bin/python bench/rollout_bench.py --alternate=--no-capture [--runs 3] [--quick]

`--client-steps unary,stream` measures each steady point twice on the same stack, the client's
steps as one unary call each and then over its shared StepStream calls, with a stream/unary row.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.alternate import print_alternate, run_alternate  # noqa: E402
from bench.common import Figures, Line, median, progress  # noqa: E402
from bench.load import burst, measure, plan  # noqa: E402
from bench.stacks import StackSpec, stack_specs, up  # noqa: E402
from bench.tables import print_table, report_problems  # noqa: E402
from codegym_client.async_client import STEP_TRANSPORTS  # noqa: E402
from codegym_jobs.oracle import read_trajectories  # noqa: E402

SHAPES = ("steady", "burst", "overload", "backtoback", "openenv")


# ---------------------------------------------------------------------------------------------
# The shapes: each measurement on a fresh stack, base then new, never both at once.


def on_each_stack(specs: list[StackSpec], label: str, run: Callable[[StackSpec], Figures]) -> list[Figures]:
    """`run` for each stack in turn; a stack that fails gets a row saying why, the others go on."""
    rows = []
    for spec in specs:
        progress(f"{label} on {spec.name} ({spec.revision})")
        try:
            figures = run(spec)
        except Exception as exc:
            progress(f"!!! {label} on {spec.name} failed: {exc}")
            figures = {"failed": f"{type(exc).__name__}: {str(exc)[:300]}"}
        rows.append({"stack": spec.name, "point": label, **figures})
        summary = ", ".join(
            f"{k} {figures[k]:.1f}" for k in ("served", "p50_ms", "p99_ms") if figures.get(k) is not None
        )
        progress(f"{label} on {spec.name}: {summary or figures.get('failed', '')}")
    return rows


def run_steady(specs: list[StackSpec], lines: list[Line], args: argparse.Namespace) -> list[Figures]:
    rows = []
    for n, think in args.steady:
        if len(args.client_steps) > 1:
            rows += client_steps_ab(specs, lines, args, n, think)
            continue

        def one(spec: StackSpec, n: int = n, think: float = think) -> Figures:
            with up(spec) as stack:
                return asyncio.run(
                    measure(stack, lines, plan(args, n, think, args.window_s, read_memory=True))
                )

        rows += on_each_stack(specs, f"{n}:{think:g}", one)
    return rows


def client_steps_ab(
    specs: list[StackSpec], lines: list[Line], args: argparse.Namespace, n: int, think: float
) -> list[Figures]:
    """One steady point on each stack, once per `--client-steps` value, one after the other on the
    same running stack (its processes and their warm state shared by both), rows "<stack> <mode>".
    The load generator imports the working tree's client for every stack: the comparison is the
    client's unary steps against its stream steps, on one stack."""
    rows = []
    for spec in specs:
        with up(spec) as stack:
            for turn, mode in itertools.product(range(1, args.ab_rounds + 1), args.client_steps):
                label = f"{n}:{think:g}" + (f" #{turn}" if args.ab_rounds > 1 else "")
                progress(f"{label} on {spec.name} ({spec.revision}), client steps {mode}")
                try:
                    figures = asyncio.run(
                        measure(
                            stack,
                            lines,
                            plan(args, n, think, args.window_s, read_memory=True, client_steps=mode),
                        )
                    )
                except Exception as exc:
                    progress(f"!!! {label} on {spec.name} ({mode}) failed: {exc}")
                    figures = {"failed": f"{type(exc).__name__}: {str(exc)[:300]}"}
                rows.append({"stack": f"{spec.name} {mode}", "point": label, "client_steps": mode, **figures})
    return rows


def run_burst(specs: list[StackSpec], lines: list[Line], args: argparse.Namespace) -> list[Figures]:
    def one(spec: StackSpec) -> Figures:
        with up(spec) as stack:
            return asyncio.run(burst(stack, lines, args))

    return on_each_stack(specs, f"{args.burst_n} x {args.burst_steps}", one)


def run_overload(specs: list[StackSpec], lines: list[Line], args: argparse.Namespace) -> list[Figures]:
    def one(spec: StackSpec) -> Figures:
        with up(spec) as stack:
            peak = asyncio.run(measure(stack, lines, plan(args, args.peak_sessions, 0.0, args.peak_s)))
            if not peak["served"]:
                raise RuntimeError("no step served back to back: no peak to overload")
            think = args.overload_n / (2 * peak["served"])
            progress(f"peak {peak['served']:.0f} steps/s: {args.overload_n} rollouts thinking {think:.3f} s")
            over = asyncio.run(measure(stack, lines, plan(args, args.overload_n, think, args.window_s)))
        return {
            **over,
            "peak": peak["served"],
            "think_ms": think * 1000,
            "served_of_peak": over["served"] / peak["served"],
            "peak_figures": peak,
        }

    return on_each_stack(specs, f"N={args.overload_n}", one)


def run_backtoback(specs: list[StackSpec], lines: list[Line], args: argparse.Namespace) -> list[Figures]:
    rows = []
    for sessions in (32, 1):

        def one(spec: StackSpec, sessions: int = sessions) -> Figures:
            with up(spec) as stack:
                return asyncio.run(measure(stack, lines, plan(args, sessions, 0.0, args.peak_s)))

        rows += on_each_stack(specs, f"C={sessions}", one)
    return rows


def run_openenv(specs: list[StackSpec], lines: list[Line], args: argparse.Namespace) -> list[Figures]:
    n, think = args.openenv

    def one(spec: StackSpec) -> Figures:
        with up(spec, openenv=True) as stack:
            figures = asyncio.run(
                measure(
                    stack, lines, plan(args, n, think, args.window_s, transport="openenv", read_memory=True)
                )
            )
        if not figures["steps_in_window"]:
            raise RuntimeError(f"no step served through the gateway: {figures['counts']}")
        return figures

    return on_each_stack(specs, f"{n}:{think:g}", one)


RUNNERS: dict[str, Callable[[list[StackSpec], list[Line], argparse.Namespace], list[Figures]]] = {
    "steady": run_steady,
    "burst": run_burst,
    "overload": run_overload,
    "backtoback": run_backtoback,
    "openenv": run_openenv,
}


# ---------------------------------------------------------------------------------------------
# Command line.


def points(text: str) -> list[tuple[int, float]]:
    """ "N:T,N:T" → [(N, T), ...]."""
    out = []
    for item in text.split(","):
        n, think = item.split(":")
        out.append((int(n), float(think)))
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)}")
    parser.add_argument("--base", default="c33c920", help="base commit measured beside the working tree")
    parser.add_argument("--no-base", action="store_true", help="measure the working tree only")
    parser.add_argument(
        "--up-args",
        default="",
        help="more `codegym up` options for the working tree's stack, e.g. '--resident-memory-mb 1800'",
    )
    parser.add_argument(
        "--steady",
        type=points,
        default=None,
        help="N:T,... points (default 256:1,1024:4,4096:16; with --alternate 1024:4)",
    )
    parser.add_argument(
        "--alternate",
        default=None,
        metavar="OPTIONS",
        help="alternating runs of the steady shape on the working tree: arm A with --up-args, arm B with "
        "these `codegym up` options too (give them with '=': --alternate=--no-capture)",
    )
    parser.add_argument("--runs", type=int, default=3, help="pairs of alternating runs (A B) per point")
    parser.add_argument("--window-s", type=float, default=30.0, help="measurement window after the warm-up")
    parser.add_argument("--burst-n", type=int, default=512, help="episodes created at once")
    parser.add_argument("--burst-steps", type=int, default=20, help="steps each burst episode plays")
    parser.add_argument("--burst-think", type=float, default=2.0, help="think time T of the burst, s")
    parser.add_argument("--peak-sessions", type=int, default=32, help="sessions of the back-to-back peak")
    parser.add_argument("--peak-s", type=float, default=15.0, help="window of the back-to-back runs, s")
    parser.add_argument("--overload-n", type=int, default=256, help="rollouts offering twice the peak")
    parser.add_argument("--openenv", type=lambda s: points(s)[0], default=(1024, 4.0), help="N:T via OpenEnv")
    parser.add_argument("--max-seconds", type=float, default=120.0, help="time cap of each measurement")
    parser.add_argument("--max-episodes", type=int, default=50_000, help="episode cap of each measurement")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--runtimes",
        type=int,
        default=1,
        help="runtime replicas of both stacks (past 1 their sessions are shared in a Redis `up` starts)",
    )
    parser.add_argument(
        "--trajectories", type=Path, default=ROOT / "codegym" / "samples" / "trajectories.jsonl"
    )
    parser.add_argument(
        "--client-steps",
        type=lambda text: [m for m in text.split(",") if m],
        default=["stream"],
        help="how the load generator's client sends steps: stream (its default: shared StepStream "
        "calls) or unary (one Step call each); 'unary,stream' runs each steady point with both, one "
        "after the other on the same stack, and adds a stream/unary ratio row",
    )
    parser.add_argument(
        "--ab-rounds",
        type=int,
        default=1,
        help="with several --client-steps: how many times the modes take turns on the stack",
    )
    parser.add_argument("--json", type=Path, help="also write every figure to this file")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: N/4 and T/4 (same offered steps/s), windows 10 s and 5 s, burst N/4 and T/4",
    )
    args = parser.parse_args(argv)
    if args.steady is None:
        args.steady = points("1024:4" if args.alternate is not None else "256:1,1024:4,4096:16")
    if args.alternate is not None and (not args.alternate.split() or args.runs < 1):
        parser.error("--alternate needs the options arm B adds, and --runs at least 1")
    args.shapes = [s for s in args.shapes.split(",") if s]
    unknown = set(args.shapes) - set(SHAPES)
    if unknown:
        parser.error(f"unknown shapes: {', '.join(sorted(unknown))}")
    if not args.client_steps or set(args.client_steps) - set(STEP_TRANSPORTS):
        parser.error(f"--client-steps takes a comma list of {', '.join(STEP_TRANSPORTS)}")
    if args.quick:
        args.steady = [(max(1, n // 4), max(0.25, t / 4)) for n, t in args.steady]
        args.openenv = (max(1, args.openenv[0] // 4), max(0.25, args.openenv[1] / 4))
        args.window_s = min(args.window_s, 10.0)
        args.peak_s = min(args.peak_s, 5.0)
        args.burst_n = max(1, args.burst_n // 4)
        args.burst_think /= 4
        args.overload_n = max(1, args.overload_n // 4)
        args.max_seconds = min(args.max_seconds, 60.0)
    return args


def main() -> None:
    args = parse_args()
    # SIGTERM ends the bench like Ctrl-C: the blocks below stop the servers and remove the worktree.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    lines = [line for line in read_trajectories(args.trajectories) if line.get("steps")]
    if args.alternate is not None:
        alternate(args, lines)
        return
    results: dict[str, list[Figures]] = {}
    with contextlib.ExitStack() as cleanup:
        workdir = Path(tempfile.mkdtemp(prefix="codegym-rollout-bench-"))
        cleanup.callback(shutil.rmtree, workdir, True)
        specs = stack_specs(args, cleanup, workdir)
        for shape in args.shapes:
            results[shape] = RUNNERS[shape](specs, lines, args)
            print_table(shape, results[shape], specs)
    report_problems(results)
    if args.json:
        meta = {
            "stacks": {s.name: s.revision for s in specs},
            "args": {k: v for k, v in vars(args).items() if k not in ("json", "trajectories")},
            "cpus": os.cpu_count(),
            "loadavg": os.getloadavg(),
            "median_episode_steps": median([len(line["steps"]) for line in lines]),
        }
        args.json.write_text(json.dumps({"meta": meta, "shapes": results}, indent=2, default=str))
        progress(f"figures written to {args.json}")


def alternate(args: argparse.Namespace, lines: list[Line]) -> None:
    """--alternate: the working tree's stack without and with the options, in turn (bench/alternate.py)."""
    with contextlib.ExitStack() as cleanup:
        workdir = Path(tempfile.mkdtemp(prefix="codegym-rollout-bench-"))
        workdir.chmod(0o755)  # the jails (other uids) read the library's folder
        cleanup.callback(shutil.rmtree, workdir, True)
        rows = run_alternate(lines, args, workdir)
        found = print_alternate(rows, args)
    report_problems(
        {
            "alternate": [
                {**row, "stack": row["arm"], "point": f"{row['point']} run {row['run']}"} for row in rows
            ]
        }
    )
    if args.json:
        meta = {
            "args": {k: v for k, v in vars(args).items() if k not in ("json", "trajectories")},
            "cpus": os.cpu_count(),
            "loadavg": os.getloadavg(),
        }
        args.json.write_text(
            json.dumps({"meta": meta, "runs": rows, "verdicts": found}, indent=2, default=str)
        )
        progress(f"figures written to {args.json}")


if __name__ == "__main__":
    main()

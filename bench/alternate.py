"""Alternating runs (bench/rollout_bench.py --alternate): the working tree's stack with and without
some `codegym up` options, in turn, on the steady shape, to tell a feature's cost from the noise
between runs.

Arm A is the working tree with --up-args, arm B the same plus --alternate's options; runs go
A B A B ... (--runs pairs), each on a fresh `codegym up` with a fresh library, record and capture
store (a library file of its own, built by `up` from the samples), so no run inherits another's
state. A and B alternate so that a machine whose load drifts over the bench drifts both arms alike.

Per run: served steps/s, step p50 and p99, the stack's CPU per step (and the runtime's share of it),
and the other work on the machine. Per arm: the mean of the runs and the run-to-run spread
(max - min). The verdicts (issue #40's for captures: `--alternate=--no-capture` makes A "capture
on", B "off"):

  CPU per step    the means within 5 % of each other (A / B within 0.95..1.05)
  step p99        the difference of the means within the run-to-run spread (the larger arm's)
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from pathlib import Path

from bench.common import Figures, Line, progress
from bench.load import measure, plan
from bench.stacks import ROOT, StackSpec, git, up
from bench.tables import BUSY_CPU_PCT, print_rows

CPU_TOLERANCE = 0.05  # CPU per step: the arms' means within 5 %
ARMS = ("A", "B")


def arm_args(args: argparse.Namespace) -> dict[str, tuple[str, ...]]:
    base = tuple(args.up_args.split())
    return {"A": base, "B": (*base, *args.alternate.split())}


def run_alternate(lines: list[Line], args: argparse.Namespace, workdir: Path) -> list[Figures]:
    """Each --steady point, --runs pairs of runs A B, each on its own fresh stack."""
    head = git("rev-parse", "--short", "HEAD")
    dirty = " + uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else ""
    rows: list[Figures] = []
    for n, think in args.steady:
        point = f"{n}:{think:g}"
        for run in range(1, args.runs + 1):
            for arm, up_args in arm_args(args).items():
                spec = StackSpec(
                    arm,
                    ROOT,
                    f"{head}{dirty} {' '.join(up_args)}".strip(),
                    workdir / f"{arm}-{point.replace(':', '_')}-{run}.db",
                    workdir / f"{arm}.log",
                    up_args,
                )
                progress(f"{point} run {run} arm {arm} (codegym up {' '.join(up_args) or '(defaults)'})")
                try:
                    with up(spec) as stack:
                        figures = asyncio.run(measure(stack, lines, plan(args, n, think, args.window_s)))
                except Exception as exc:
                    progress(f"!!! {point} run {run} arm {arm} failed: {exc}")
                    figures = {"failed": f"{type(exc).__name__}: {str(exc)[:300]}"}
                row = {"point": point, "run": run, "arm": arm, "up_args": list(up_args), **figures}
                steps = figures.get("steps_in_window")
                if steps:
                    row["runtime_cpu_ms_per_step"] = figures["cpu_s_by_role"]["runtime"] * 1000 / steps
                rows.append(row)
                if "failed" not in figures:
                    progress(
                        f"{point} run {run} arm {arm}: CPU {figures['cpu_ms_per_step'] or 0:.2f} ms/step, "
                        f"p99 {figures['p99_ms'] or 0:.1f} ms"
                    )
    return rows


def fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def arm_summary(rows: list[Figures], key: str) -> Figures:
    values = [row[key] for row in rows if row.get(key) is not None]
    if not values:
        return {"mean": None, "min": None, "max": None, "spread": None, "runs": 0}
    return {
        "mean": statistics.fmean(values),
        "min": min(values),
        "max": max(values),
        "spread": max(values) - min(values),
        "runs": len(values),
    }


def verdicts(rows: list[Figures]) -> dict[str, Figures]:
    """Per point: each arm's summary of CPU per step and step p99, the A/B ratios and the verdicts."""
    out: dict[str, Figures] = {}
    for point in dict.fromkeys(row["point"] for row in rows):
        arms = {arm: [r for r in rows if r["point"] == point and r["arm"] == arm] for arm in ARMS}
        cpu = {arm: arm_summary(arms[arm], "cpu_ms_per_step") for arm in ARMS}
        p99 = {arm: arm_summary(arms[arm], "p99_ms") for arm in ARMS}
        runtime = {arm: arm_summary(arms[arm], "runtime_cpu_ms_per_step") for arm in ARMS}
        figures: Figures = {"cpu": cpu, "p99": p99, "runtime_cpu": runtime}
        if all(cpu[a]["mean"] for a in ARMS) and all(p99[a]["mean"] for a in ARMS):
            ratio = cpu["A"]["mean"] / cpu["B"]["mean"]
            spread = max(p99["A"]["spread"], p99["B"]["spread"])
            difference = p99["A"]["mean"] - p99["B"]["mean"]
            figures.update(
                cpu_ratio=ratio,
                cpu_pass=abs(ratio - 1) <= CPU_TOLERANCE,
                p99_ratio=p99["A"]["mean"] / p99["B"]["mean"],
                p99_difference_ms=difference,
                p99_spread_ms=spread,
                p99_pass=abs(difference) <= spread,
                enough_runs=min(p99[a]["runs"] for a in ARMS) >= 2,
            )
        out[point] = figures
    return out


def print_alternate(rows: list[Figures], args: argparse.Namespace) -> dict[str, Figures]:
    arms = arm_args(args)
    print(
        "\nalternating runs: steady shape (N rollouts thinking T s before each step, N:T), figures over the window"
    )
    for arm in ARMS:
        print(f"  arm {arm}: codegym up {' '.join(arms[arm]) or '(defaults)'}")
    header = ["point", "run", "arm", "served/s", "p50 ms", "p99 ms", "CPU ms/step", "runtime ms/step"]
    header += ["stack CPU %", "other CPU %", "errors", "mismatch"]
    body = []
    for row in rows:
        if "failed" in row:
            body.append([row["point"], str(row["run"]), row["arm"], *["n/a"] * (len(header) - 3)])
            continue
        body.append(
            [
                row["point"],
                str(row["run"]),
                row["arm"],
                fmt(row["served"], ".0f"),
                fmt(row["p50_ms"], ".1f"),
                fmt(row["p99_ms"], ".1f"),
                fmt(row["cpu_ms_per_step"], ".2f"),
                fmt(row.get("runtime_cpu_ms_per_step"), ".2f"),
                fmt(row["stack_cpu_pct"], ".0f"),
                fmt(row["other_cpu_pct"], ".0f"),
                str(row["errors"]),
                str(row["mismatches"]),
            ]
        )
    print_rows(header, body)
    for row in rows:
        if "failed" in row:
            print(f"  {row['point']} run {row['run']} arm {row['arm']}: n/a, {row['failed']}")
    busy = [r for r in rows if (r.get("other_cpu_pct") or 0) > BUSY_CPU_PCT]
    if busy:
        print(
            f"!!! other work on the machine took over {BUSY_CPU_PCT:.0f} % CPU (100 = one CPU) during "
            + ", ".join(
                f"run {r['run']} {r['arm']} ({r['other_cpu_pct']:.0f} %: {r.get('other_top') or '?'})"
                for r in busy
            )
            + ": those runs' figures include that contention"
        )
    found = verdicts(rows)
    print("\nper arm: mean over the runs [min .. max] (spread = max - min)")
    for point, f in found.items():
        for label, key, spec in (
            ("CPU ms/step", "cpu", ".2f"),
            ("runtime CPU ms/step", "runtime_cpu", ".2f"),
            ("step p99 ms", "p99", ".1f"),
        ):
            cells = []
            for arm in ARMS:
                s = f[key][arm]
                cells.append(
                    f"{arm} {fmt(s['mean'], spec)} [{fmt(s['min'], spec)} .. {fmt(s['max'], spec)}] "
                    f"spread {fmt(s['spread'], spec)}"
                )
            print(f"  {point} {label:<20} " + "   ".join(cells))
        if "cpu_ratio" not in f:
            print(f"  {point}: no verdict (an arm has no figures)")
            continue
        print(
            f"  {point} CPU per step A/B {f['cpu_ratio']:.3f}: "
            f"{'PASS' if f['cpu_pass'] else 'FAIL'} (target within {CPU_TOLERANCE:.0%})"
        )
        print(
            f"  {point} step p99 A/B {f['p99_ratio']:.3f}, A - B {f['p99_difference_ms']:+.1f} ms against a "
            f"run-to-run spread of {f['p99_spread_ms']:.1f} ms: {'PASS' if f['p99_pass'] else 'FAIL'}"
            + ("" if f["enough_runs"] else " (one run per arm: no spread to judge by; give --runs 2 or more)")
        )
    return found

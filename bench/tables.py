"""The benches' tables on stdout: a table per shape, a row per stack and point, and a new/base row
of ratios under the figures where a ratio means something; then the problems (mismatches, errors,
measurements other work on the machine contended) said loudly after them.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from bench.common import Figures
from bench.stacks import StackSpec


def print_rows(header: list[str], body: list[list[str]]) -> None:
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    for line in [header, *body]:
        print(
            "  ".join(
                t.ljust(w) if i < 2 else t.rjust(w) for i, (t, w) in enumerate(zip(line, widths, strict=True))
            )
        )


@dataclass(frozen=True)
class Col:
    header: str
    key: str
    spec: str = ".0f"
    ratio: bool = False  # a new/base row shows this column's ratio


STEADY_COLS = [
    Col("offered/s", "offered"),
    Col("served/s", "served", ratio=True),
    Col("served %", "served_pct"),
    Col("p50 ms", "p50_ms", ".1f", ratio=True),
    Col("p99 ms", "p99_ms", ".1f", ratio=True),
    Col("CPU ms/step", "cpu_ms_per_step", ".2f", ratio=True),
    # ... of which each process (the jails: every process below the workers; redis with --runtimes)
    Col("runtime", "runtime_ms_per_step", ".2f", ratio=True),
    Col("worker", "worker_ms_per_step", ".2f", ratio=True),
    Col("jail", "jail_ms_per_step", ".2f", ratio=True),
    Col("redis", "redis_ms_per_step", ".2f"),
    Col("stack CPU %", "stack_cpu_pct"),
    Col("PSS MiB", "pss_mib", ratio=True),
    Col("KiB/episode", "kib_per_episode", ".0f", ratio=True),
    Col("+KiB/episode", "added_kib_per_episode", ".0f", ratio=True),
    Col("refused", "refusals", "d"),
    Col("errors", "errors", "d"),
    Col("mismatch", "mismatches", "d"),
    Col("gen CPU %", "gen_cpu_pct"),
    Col("gen ms/step", "gen_ms_per_step", ".2f", ratio=True),
]
COLUMNS: dict[str, tuple[str, list[Col]]] = {
    "steady": (
        "steady: N rollouts thinking T s before each step (N:T); figures over the window",
        STEADY_COLS,
    ),
    "burst": (
        "burst: N episodes created at once, then S steps each thinking T (N x S)",
        [
            Col("all created s", "all_created_s", ".2f", ratio=True),
            Col("create p50 ms", "create_p50_ms", ".1f", ratio=True),
            Col("create p99 ms", "create_p99_ms", ".1f", ratio=True),
            Col("makespan s", "makespan_s", ".1f", ratio=True),
            Col("ideal s", "ideal_s", ".1f"),
            Col("makespan/ideal", "makespan_ratio", ".2f"),
            Col("step p50 ms", "p50_ms", ".1f", ratio=True),
            Col("step p99 ms", "p99_ms", ".1f", ratio=True),
            Col("CPU ms/step", "cpu_ms_per_step", ".2f", ratio=True),
            Col("refused", "refusals", "d"),
            Col("errors", "errors", "d"),
            Col("mismatch", "mismatches", "d"),
        ],
    ),
    "overload": (
        "overload: back-to-back peak (32 sessions), then N rollouts offering twice that peak",
        [
            Col("peak/s", "peak", ratio=True),
            Col("think ms", "think_ms", ".0f"),
            Col("offered/s", "offered"),
            Col("served/s", "served", ratio=True),
            Col("served/peak", "served_of_peak", ".2f"),
            Col("p50 ms", "p50_ms", ".1f", ratio=True),
            Col("p99 ms", "p99_ms", ".1f", ratio=True),
            Col("CPU ms/step", "cpu_ms_per_step", ".2f", ratio=True),
            Col("refused", "refusals", "d"),
            Col("errors", "errors", "d"),
            Col("mismatch", "mismatches", "d"),
            Col("gen CPU %", "gen_cpu_pct"),
        ],
    ),
    "backtoback": (
        "back to back: C sessions, no think time (regression check)",
        [
            Col("steps/s", "served", ratio=True),
            Col("p50 ms", "p50_ms", ".2f", ratio=True),
            Col("p99 ms", "p99_ms", ".2f", ratio=True),
            Col("CPU ms/step", "cpu_ms_per_step", ".2f", ratio=True),
            Col("stack CPU %", "stack_cpu_pct"),
            Col("refused", "refusals", "d"),
            Col("errors", "errors", "d"),
            Col("mismatch", "mismatches", "d"),
            Col("gen CPU %", "gen_cpu_pct"),
        ],
    ),
    "openenv": (
        "openenv: steady shape through the OpenEnv gateway, a WebSocket per episode (N:T)",
        STEADY_COLS,
    ),
}


def cell(row: Figures, col: Col) -> str:
    value = row.get(col.key)
    if value is None:
        return "n/a"
    return format(value, col.spec)


def ratio_cell(base: Figures, new: Figures, col: Col) -> str:
    b, n = base.get(col.key), new.get(col.key)
    if not col.ratio or not b or n is None:
        return ""
    return f"{n / b:.2f}x"


def comparisons(by_stack: dict[str, Figures]) -> list[tuple[str, str]]:
    """The rows a ratio row compares: new against base, and on one stack the client's stream steps
    against its unary ones (`--client-steps unary,stream`: rows named "<stack> unary|stream")."""
    pairs = [("base", "new")] if "base" in by_stack and "new" in by_stack else []
    for name in by_stack:
        if name.endswith(" unary") and (stream := name.removesuffix(" unary") + " stream") in by_stack:
            pairs.append((name, stream))
    return pairs


def print_table(
    shape: str, rows: list[Figures], specs: list[StackSpec], columns: tuple[str, list[Col]] | None = None
) -> None:
    """A shape's table on stdout: per point, a row per stack, then new/base; failures below it.
    `columns` (title, columns) instead of the shape's own (`COLUMNS`)."""
    title, cols = columns or COLUMNS[shape]
    header = ["point", "stack", *(c.header for c in cols)]
    body: list[list[str]] = []
    points = list(dict.fromkeys(row["point"] for row in rows))
    for point in points:
        by_stack = {row["stack"]: row for row in rows if row["point"] == point}
        for name, row in by_stack.items():
            cells = ["n/a" for _ in cols] if "failed" in row else [cell(row, c) for c in cols]
            body.append([point, name, *cells])
        for before, after in comparisons(by_stack):
            base, new = by_stack[before], by_stack[after]
            if "failed" not in base and "failed" not in new:
                body.append(["", f"{after}/{before}", *(ratio_cell(base, new, c) for c in cols)])
    print(f"\n{title}")
    print_rows(header, body)
    revisions = ", ".join(f"{s.name} = {s.revision}" for s in specs)
    print(f"  ({revisions})")
    for row in rows:
        if "failed" in row:
            print(f"  {row['point']} on {row['stack']}: n/a, {row['failed']}")
        if row.get("note"):
            print(f"  {row['stack']}: {row['note']}")
        if row.get("all_stepped") is False:
            print(
                f"  {row['point']} on {row['stack']}: warm-up cut at its cap before every rollout had stepped"
            )
    sys.stdout.flush()


def report_problems(results: dict[str, list[Figures]]) -> None:
    """Mismatches and errors, loudly, after the tables."""
    for shape, rows in results.items():
        for row in rows:
            if row.get("mismatches"):
                print(
                    f"!!! {shape} {row['point']} on {row['stack']}: {row['mismatches']} observations "
                    "differed from the recording"
                )
            if row.get("errors"):
                kinds = {k[6:]: v for k, v in row["counts"].items() if k.startswith("error:")}
                print(f"!!! {shape} {row['point']} on {row['stack']}: errors {kinds}")


BUSY_CPU_PCT = 25.0  # other work's CPU (100 = one CPU) past which a measurement is called contended


def report_busy(results: dict[str, list[Figures]]) -> None:
    """Measurements during which other work on the machine took more than BUSY_CPU_PCT of its CPU:
    their latencies include that contention."""
    busy = [
        f"{shape} {row['point']} on {row['stack']} ({row['other_cpu_pct']:.0f} %"
        + (f": {row['other_top']}" if row.get("other_top") else "")
        + ")"
        for shape, rows in results.items()
        for row in rows
        if (row.get("other_cpu_pct") or 0) > BUSY_CPU_PCT
    ]
    if busy:
        cpus = os.cpu_count()
        print(
            f"!!! other work on the machine ({cpus} CPUs = {100 * (cpus or 1)} %) took CPU during: {', '.join(busy)}"
        )

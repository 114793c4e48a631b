"""Where a step's CPU goes: py-spy attached to every process of a loaded `codegym up`.

One steady shape (N rollouts thinking T, as `bench/rollout_bench.py` runs it) on a fresh stack of
the working tree; during the measurement window py-spy samples the runtime, each sandbox worker
and each jail's zygote with its children (the resident sessions and one-shot children), and
/proc gives each process's threads' CPU over the same window. Printed: per process, CPU ms per
step served and its share by stage (bench/profile_stages.py sorts the stacks), the stages' top
frames, and the threads' CPU (gRPC's own threads do not show in py-spy's Python stacks).

Profile in runs of its own: the sampler perturbs a 2-core machine, so the figures to compare
between commits are `make bench-rollouts`', and these say where they go.

    .venv/bin/python bench/profile_bench.py [--point 1024:4] [--window-s 30] [--rate 200]
        [--native] [--out DIR] [--up-args '...']
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import Figures, progress  # noqa: E402
from bench.load import Plan, measure  # noqa: E402
from bench.profile_stages import STAGES, leaves, read_stages  # noqa: E402
from bench.stacks import Stack, stack_specs, up  # noqa: E402
from codegym import proctree  # noqa: E402
from codegym_jobs.oracle import read_trajectories  # noqa: E402

PY_SPY = Path(sys.executable).with_name("py-spy")


def thread_ticks(pid: int) -> dict[str, int]:
    """CPU ticks so far of each thread of a process, summed by thread name."""
    ticks: Counter[str] = Counter()
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                text = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
                name = text[text.index("(") + 1 : text.rindex(")")]
                fields = text[text.rindex(")") + 2 :].split()
                ticks[name] += int(fields[11]) + int(fields[12])
    return dict(ticks)


def targets(stack: Stack, residents: int) -> dict[str, int]:
    """The processes to sample: the runtime(s), the workers, each worker's zygotes, and up to
    `residents` of each zygote's children (resident sessions; the spare)."""
    links = proctree.children_by_parent()
    found: dict[str, int] = {}
    counts: Counter[str] = Counter()
    for pid in links.get(stack.pid, []):
        cmd = proctree.cmdline(pid) or ""
        role = "runtime" if "runtime" in cmd else "worker" if "sandbox" in cmd else ""
        if not role:
            continue
        counts[role] += 1
        name = f"{role} {counts[role]}"
        found[name] = pid
        if role != "worker":
            continue
        zygotes = [z for nsjail in links.get(pid, []) for z in links.get(nsjail, [])]
        for number, zygote in enumerate(zygotes, 1):
            found[f"{name} zygote {number}"] = zygote
            for child_number, child in enumerate(links.get(zygote, [])[:residents], 1):
                found[f"{name} zygote {number} child {child_number}"] = child
    return found


def profiler(out: Path, rate: int, native: bool, residents: int) -> object:
    """The `during` hook: py-spy on every target for the window, and their threads' CPU."""

    async def during(stack: Stack, window_s: float) -> Figures:
        found = targets(stack, residents)
        before = {name: thread_ticks(pid) for name, pid in found.items()}
        tree_before = {name: proctree.cpu_ticks(pid, reaped=True) for name, pid in found.items()}
        procs = []
        for name, pid in found.items():
            argv = [str(PY_SPY), "record", "--pid", str(pid), "--format", "raw", "--rate", str(rate)]
            argv += ["--duration", str(max(1, int(window_s) - 2))]
            argv += ["--output", str(out / f"{name.replace(' ', '_')}.txt")]
            if "zygote" in name:
                # Only while holding the GIL: a jailed process waiting in a pipe read is idle, but
                # py-spy cannot tell from outside the jail's pid namespace.
                argv.append("--gil")
            elif native:
                argv.append("--native")  # the process is paused for each sample: it costs more
            if "--native" not in argv:
                argv.append("--nonblocking")
            procs.append(
                await asyncio.create_subprocess_exec(
                    *argv, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
                )
            )
        started = time.monotonic()
        await asyncio.gather(*(p.wait() for p in procs))
        seconds = time.monotonic() - started
        after = {name: thread_ticks(pid) for name, pid in found.items()}
        tree_after = {name: proctree.cpu_ticks(pid, reaped=True) for name, pid in found.items()}
        threads = {
            name: {
                thread: (after[name].get(thread, 0) - ticks) / proctree.CLK_TCK
                for thread, ticks in before[name].items()
            }
            for name in found
        }
        return {
            "profiled_s": seconds,
            "profiled": list(found),
            "threads_cpu_s": threads,
            "tree_cpu_s": {n: (tree_after[n] - tree_before[n]) / proctree.CLK_TCK for n in found},
        }

    return during


def rows(figures: Figures, out: Path) -> list[tuple[str, float, Counter[str], Path | None]]:
    """(process, CPU seconds in the window, samples by stage, raw stacks) for each row: the
    runtime(s), the workers, the zygotes (their own process), and every zygote's children together
    (their CPU is the jails' less the zygotes' own, their stages pooled from the sampled ones)."""
    threads = figures["threads_cpu_s"]
    found: list[tuple[str, float, Counter[str], Path | None]] = []
    children: Counter[str] = Counter()
    zygotes_s = 0.0
    for name in figures["profiled"]:
        path = out / f"{name.replace(' ', '_')}.txt"
        counts = read_stages(path)
        if " child " in name:
            children.update(counts)
            continue
        cpu_s = sum(threads[name].values())
        if "zygote" in name:
            zygotes_s += cpu_s
        found.append((name, cpu_s, counts, path))
    jail_s = figures["cpu_s_by_role"]["jail"] * figures["profiled_s"] / figures["window_s"]
    found.append(("jails' children (sampled)", max(0.0, jail_s - zygotes_s), children, None))
    return found


def report(figures: Figures, out: Path, rate: int) -> None:
    steps = figures["served"] * figures["profiled_s"]
    by_role = ", ".join(
        f"{role} {s * 1000 / figures['steps_in_window']:.2f}" for role, s in figures["cpu_s_by_role"].items()
    )
    print(
        f"\n# {figures['n']} rollouts, think {figures['think_s']:g} s: {figures['served']:.1f} steps/s served, "
        f"p50 {figures['p50_ms']:.1f} ms, p99 {figures['p99_ms']:.1f} ms, "
        f"stack {figures['cpu_ms_per_step']:.2f} CPU ms/step (by role: {by_role})"
    )
    print(
        f"profiled {figures['profiled_s']:.1f} s at {rate} Hz. CPU ms/step from /proc; each stage its "
        "share of py-spy's samples of that CPU\n"
    )
    header = "| process | CPU ms/step | " + " | ".join(STAGES) + " |"
    print(header)
    print("|" + "---|" * (len(STAGES) + 2))
    table = rows(figures, out)
    for name, cpu_s, counts, _ in table:
        total = sum(counts.values()) or 1
        ms = 1000 * cpu_s / steps
        cells = [f"{ms * counts[s] / total:.3f}" if counts.get(s) else "" for s in STAGES]
        print(f"| {name} | {ms:.3f} | " + " | ".join(cells) + " |")
    print("\nthreads' CPU (ms/step; py-spy sees Python threads only):")
    for name, threads in figures["threads_cpu_s"].items():
        if " child " in name:
            continue
        shown = ", ".join(
            f"{t} {1000 * s / steps:.3f}" for t, s in sorted(threads.items(), key=lambda x: -x[1]) if s
        )
        print(f"  {name}: {shown}")
    print("\ntop frames of each process's three largest stages (share of its samples):")
    for name, _, counts, path in table:
        if path is None:
            continue
        total = sum(counts.values()) or 1
        for stage, n in counts.most_common(3):
            print(f"  {name} / {stage} ({100 * n / total:.0f} %):")
            for frame, m in leaves(path, stage, 4):
                print(f"      {100 * m / total:5.1f} %  {frame[:150]}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--point", default="1024:4", help="N:T, rollouts and think seconds")
    parser.add_argument("--window-s", type=float, default=30.0)
    parser.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    parser.add_argument("--native", action="store_true", help="native frames of the runtime and workers")
    parser.add_argument("--out", type=Path, default=None, help="keep py-spy's raw stacks here")
    parser.add_argument("--residents", type=int, default=6, help="children sampled per zygote")
    parser.add_argument("--up-args", default="")
    parser.add_argument("--max-seconds", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    if not PY_SPY.exists():
        sys.exit(f"{PY_SPY} is missing: `make install` installs the dev tools (py-spy among them)")
    n, think = args.point.split(":")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    lines = [
        line
        for line in read_trajectories(ROOT / "codegym" / "samples" / "trajectories.jsonl")
        if line.get("steps")
    ]
    with contextlib.ExitStack() as cleanup:
        workdir = Path(tempfile.mkdtemp(prefix="codegym-profile-"))
        cleanup.callback(shutil.rmtree, workdir, True)
        out = args.out or workdir
        out.mkdir(parents=True, exist_ok=True)
        spec_args = argparse.Namespace(no_base=True, base=None, up_args=args.up_args)
        (spec,) = stack_specs(spec_args, cleanup, workdir)
        plan = Plan(int(n), float(think), args.window_s, args.max_seconds, 10**9, args.seed)
        plan.during = profiler(out, args.rate, args.native, args.residents)  # type: ignore[assignment]
        with up(spec) as stack:
            figures = asyncio.run(measure(stack, lines, plan))
        report(figures, out, args.rate)
        (out / "figures.json").write_text(json.dumps(figures, indent=2, default=str))
        progress(f"raw stacks and figures in {out}")


if __name__ == "__main__":
    main()

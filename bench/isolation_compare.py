"""Before/after comparison of bench/runtime_bench.py: a base commit against this checkout (or another commit).

The base commit is checked out as a git worktree in a temporary folder (this checkout's work tree is
not touched); the two are then benchmarked interleaved, before, after, before, after, ... so that
machine noise hits both alike. Every run uses this interpreter (the venv's) with the working
directory and PYTHONPATH set to the checkout measured: `python -m codegym_cli.cli` then imports that
checkout's code ahead of the venv's editable install. While a run goes, its process tree is sampled
to prove it: the cwd of its servers, the code each jail's nsjail config mounts at /sandbox, and how
many uids the zygotes' children have (one per jail without per-process isolation, one per process
with it).

Reported: steps/s at 32 sessions and step p50 at 1 session, per round, medians, after/before ratios,
the median and spread of the per-round ratios, CPU ms per step, and whether the cost stays within
the budget (default 10 %). The bare gRPC echo measured in the same run is shown beside them: a
figure that moved with the echo moved with the machine. On a shared machine, a budget smaller than
the spread of the per-round ratios cannot be judged from these wall-clock figures: add rounds.

    .venv/bin/python bench/isolation_compare.py --base e2eb67b [--after COMMIT] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from codegym import proctree

ROOT = Path(__file__).resolve().parent.parent


def git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(
        ["git", "-C", str(cwd), *args], check=True, capture_output=True, text=True
    ).stdout.strip()


def add_worktree(commit: str, label: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix=f"codegym-{label}-"))
    path.rmdir()
    git("worktree", "add", "--detach", str(path), commit)
    return path


class Evidence:
    """What the processes of one benchmark run really ran, sampled while it runs."""

    def __init__(self, root_pid: int) -> None:
        self.root_pid = root_pid
        self.cwds: set[str] = set()
        self.jail_code: set[str] = set()
        self.child_uids: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> Evidence:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(1.0):
            self.sample()

    def sample(self) -> None:
        links = proctree.children_by_parent()
        parents = {child: parent for parent, children in links.items() for child in children}
        for pid in set(proctree.descendants([self.root_pid], links)):
            cmd = proctree.cmdline(pid) or ""
            try:
                if "codegym_cli.cli" in cmd:
                    self.cwds.add(os.readlink(f"/proc/{pid}/cwd"))
                if "--config" in cmd and "/sandbox/zygote.py" not in cmd:
                    cfg = cmd.split("--config", 1)[1].split()[0]
                    for block in re.findall(r"mount\s*\{([^}]*)\}", Path(cfg).read_text()):
                        src = re.search(r'\bsrc:\s*"([^"]+)"', block)
                        dst = re.search(r'\bdst:\s*"([^"]+)"', block)
                        if src and dst and dst.group(1).startswith("/sandbox"):
                            self.jail_code.add(src.group(1))
                if "/sandbox/zygote.py" in (proctree.cmdline(parents.get(pid, 0)) or ""):
                    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                        if line.startswith("Uid:"):
                            self.child_uids.add(int(line.split()[1]))
            except (OSError, IndexError):
                continue

    def summary(self) -> dict[str, Any]:
        return {
            "cwd": sorted(self.cwds),
            "jail code": sorted(self.jail_code),
            "distinct uids of zygote children": len(self.child_uids),
        }


def figure(rows: list[list[str]], name: str) -> list[str]:
    for row in rows:
        if row[0] == name:
            return row
    raise KeyError(name)


def first_number(text: str) -> float:
    return float(re.findall(r"[\d.]+", text)[0])


def run_bench(checkout: Path, bench_args: list[str], timeout_s: float) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    cmd = [sys.executable, str(checkout / "bench" / "runtime_bench.py"), *bench_args, "--json"]
    load = os.getloadavg()[0]
    started = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        cwd=checkout,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    with Evidence(proc.pid) as evidence:
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise RuntimeError(f"benchmark in {checkout} did not finish in {timeout_s:.0f} s") from None
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark in {checkout} failed ({proc.returncode}):\n{err[-3000:]}")
    rows = json.loads([line for line in out.splitlines() if line.startswith("[[")][-1])
    rate = figure(rows, "32 sessions: steps/s")
    p50 = figure(rows, "1 sessions: step p50 / p99 ms")
    return {
        "steps_s_32": first_number(rate[1]),
        "echo_calls_s_32": first_number(rate[2]),
        "p50_ms_1": first_number(p50[1]),
        "echo_p50_ms_1": first_number(p50[2]),
        "cpu_1": figure(rows, "1 sessions: CPU ms per step runtime/worker/jail")[1],
        "cpu_32": figure(rows, "32 sessions: CPU ms per step runtime/worker/jail")[1],
        "load": load,
        "wall_s": time.monotonic() - started,
        "evidence": evidence.summary(),
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base", required=True, help="commit measured as 'before'")
    parser.add_argument(
        "--after", help="commit measured as 'after' (default: this checkout, uncommitted changes included)"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget", type=float, default=0.10, help="allowed cost, as a fraction")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--open-sessions", type=int, default=200, help="passed to runtime_bench.py")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds allowed per run")
    parser.add_argument("--keep", action="store_true", help="keep the worktrees")
    parser.add_argument("--out", type=Path, help="write every run's figures here as JSON")
    args = parser.parse_args()

    base = git("rev-parse", args.base)
    worktrees = [add_worktree(base, "before")]
    arms = {"before": (worktrees[0], base)}
    if args.after:
        after = git("rev-parse", args.after)
        worktrees.append(add_worktree(after, "after"))
        arms["after"] = (worktrees[1], after)
    else:
        dirty = " + uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else ""
        arms["after"] = (ROOT, git("rev-parse", "HEAD") + dirty)
    for name, (path, commit) in arms.items():
        print(f"{name}: {commit} in {path}", flush=True)
    bench_args = [
        "--sessions", "1", "32",
        "--steps", str(args.steps),
        "--open-sessions", str(args.open_sessions),
    ]  # fmt: skip
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in arms}
    try:
        for round_no in range(1, args.rounds + 1):
            for name, (path, _) in arms.items():
                r = run_bench(path, bench_args, args.timeout)
                results[name].append(r)
                print(
                    f"round {round_no} {name:<6} steps/s@32 {r['steps_s_32']:7.1f} (echo {r['echo_calls_s_32']:.0f})"
                    f"  p50@1 {r['p50_ms_1']:6.2f} ms (echo {r['echo_p50_ms_1']:.2f})"
                    f"  CPU ms/step r/w/j @1 {r['cpu_1']} @32 {r['cpu_32']}"
                    f"  load {r['load']:.1f}  {r['wall_s']:.0f} s  {r['evidence']}",
                    flush=True,
                )
    finally:
        if args.out:
            args.out.write_text(json.dumps(results, indent=1))
        if not args.keep:
            for path in worktrees:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)])

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in results[name])

    rate_b, rate_a = med("before", "steps_s_32"), med("after", "steps_s_32")
    p50_b, p50_a = med("before", "p50_ms_1"), med("after", "p50_ms_1")
    rate_ratio, p50_ratio = rate_a / rate_b, p50_a / p50_b
    print()
    print(
        f"{'median over ' + str(args.rounds) + ' rounds':<28}{'before':>10}{'after':>10}{'after/before':>14}"
    )
    print(f"{'steps/s @ 32 sessions':<28}{rate_b:>10.1f}{rate_a:>10.1f}{rate_ratio:>14.3f}")
    print(f"{'step p50 ms @ 1 session':<28}{p50_b:>10.2f}{p50_a:>10.2f}{p50_ratio:>14.3f}")
    print(
        f"{'echo calls/s @ 32 (machine)':<28}{med('before', 'echo_calls_s_32'):>10.0f}"
        f"{med('after', 'echo_calls_s_32'):>10.0f}"
    )
    print(
        f"{'echo p50 ms @ 1 (machine)':<28}{med('before', 'echo_p50_ms_1'):>10.2f}"
        f"{med('after', 'echo_p50_ms_1'):>10.2f}"
    )
    # Paired by round: each after run against the before run just ahead of it, under the same load.
    # The spread of those ratios says how far the machine's noise reaches: a budget smaller than it
    # cannot be judged from wall-clock figures on this machine.
    pairs = list(zip(results["after"], results["before"], strict=True))
    for key, label in (("steps_s_32", "steps/s @ 32"), ("p50_ms_1", "p50 @ 1")):
        ratios = sorted(a[key] / b[key] for a, b in pairs)
        print(
            f"{'median of per-round ratios':<28}{'':>20}{statistics.median(ratios):>14.3f}"
            f"  ({label}; rounds from {ratios[0]:.2f} to {ratios[-1]:.2f})"
        )
    # CPU time per step moves far less with the machine's load than wall-clock figures do.
    for key, label in (("cpu_32", "CPU ms/step @ 32, all roles"), ("cpu_1", "CPU ms/step @ 1, all roles")):
        cpu_b = statistics.median(sum(map(float, r[key].split(" / "))) for r in results["before"])
        cpu_a = statistics.median(sum(map(float, r[key].split(" / "))) for r in results["after"])
        print(f"{label:<28}{cpu_b:>10.2f}{cpu_a:>10.2f}{cpu_a / cpu_b:>14.3f}")
    holds = rate_ratio >= 1 - args.budget and p50_ratio <= 1 + args.budget
    print(
        f"cost: steps/s {100 * (1 - rate_ratio):+.1f} %, p50 {100 * (p50_ratio - 1):+.1f} %"
        f" -> budget {100 * args.budget:.0f} % {'holds' if holds else 'EXCEEDED'}"
    )


if __name__ == "__main__":
    main()

"""The worker <-> jail pipe alone: CPU per resident step on each side, a base commit beside the tree.

No gRPC, no runtime: one process holds a one-jail pool and the worker's servicer (what a
`SandboxService.Execute` runs after decoding its request), creates SESSIONS resident sessions, and
steps them round after round, each step from the state the previous one answered (committed, as
the runtime would), one step at a time. Measured over the stepping only: the worker's CPU per step
(this process: request building, framing, the pipe's reads, `to_result`), the jail's (nsjail, the
zygote and every process below it, reaped ones included), and the step's wall time (p50, p99).

Two state sizes: the sample environment with a 5-number task (a state of a few hundred bytes,
as most sessions have) and with a 20,000-number one (about 140 KB), where what the pipe does per
byte shows. Each tree runs in a process of its own (started from the tree, which comes first on
its PYTHONPATH), base first; a 2-core machine shared with other work makes the figures noisy:
compare base and new of the same run only. CPU is read in clock ticks (10 ms): thousands of steps
make it a figure.

    .venv/bin/python bench/pipe_bench.py [--base main | --no-base] [--steps 3000] [--sessions 8]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

# Not put on the path here: the measuring process imports from the tree it was started for.
ROOT = Path(__file__).resolve().parent.parent

ENV = ROOT / "codegym" / "samples" / "envs" / "Sample_0001_I__MaxSubarraySumEnv.py"
ACTION = '{"name": "GetElement", "parameters": {"index": 2}}'
SIZES = {"small": 5, "large": 20_000}


def jail_cpu_s() -> tuple[float, float]:
    """CPU seconds of every process below this one (the jail: nsjail, its zygote, the zygote's
    children, reaped ones included), and of the zygote's own work alone."""
    from codegym import proctree

    below = [pid for pid in proctree.descendants([os.getpid()]) if pid != os.getpid()]
    total = sum(proctree.cpu_ticks(pid, reaped=True) for pid in below)
    # This process -> nsjail -> the zygote (nsjail's one child).
    zygotes = [
        z for nsjail in proctree.children_of(os.getpid()) or [] for z in proctree.children_of(nsjail) or []
    ]
    own = sum(proctree.cpu_ticks(pid, reaped=False) for pid in zygotes)
    return total / proctree.CLK_TCK, own / proctree.CLK_TCK


def own_cpu_s() -> float:
    times = os.times()
    return times.user + times.system


async def measure(size: str, steps: int, sessions: int) -> dict[str, object]:
    """In the tree this process imports: the figures of one state size."""
    from codegym.sandbox.v1 import sandbox_service_pb2 as pb
    from sandbox_worker.pool import JailPool
    from sandbox_worker.service import SandboxServicer

    source = ENV.read_text()
    rng = random.Random(size)
    pool = JailPool(1)
    await pool.start()
    try:
        servicer = SandboxServicer(pool)
        states: list[bytes] = []
        for i in range(sessions):
            nums = [rng.randint(-50, 50) for _ in range(SIZES[size])]
            create = pb.CreateOp(config_json=json.dumps({"nums": nums}), session_key=f"s{i}")
            created = await servicer.run(
                servicer._request(pb.Operation(source=pb.SourceRef(code=source), create=create))
            )
            assert created.status == pb.STATUS_OK, created.message
            states.append(created.state)
        sha = created.source_sha256

        async def step(i: int) -> bool:
            op = pb.Operation(
                source=pb.SourceRef(sha256=sha),
                step=pb.StepOp(state=states[i], action=ACTION, session_key=f"s{i}"),
            )
            result = await servicer.run(servicer._request(op))
            if result.status != pb.STATUS_OK:
                raise RuntimeError(result.message)
            states[i] = result.state
            return result.resident

        for n in range(sessions * 4):  # warm up: every session resident
            await step(n % sessions)
        walls: list[float] = []
        resident = 0
        cpu0, (jail0, zygote0) = own_cpu_s(), jail_cpu_s()
        for n in range(steps):
            started = time.perf_counter()
            resident += await step(n % sessions)
            walls.append(time.perf_counter() - started)
        jail1, zygote1 = jail_cpu_s()
        worker_s, jail_s, zygote_s = own_cpu_s() - cpu0, jail1 - jail0, zygote1 - zygote0
    finally:
        await pool.close()
    walls.sort()
    return {
        "state_bytes": len(states[0]),
        "resident_share": round(resident / steps, 3),
        "worker_cpu_ms_per_step": round(worker_s * 1000 / steps, 4),
        "jail_cpu_ms_per_step": round(jail_s * 1000 / steps, 4),
        "zygote_cpu_ms_per_step": round(zygote_s * 1000 / steps, 4),
        "step_p50_ms": round(walls[len(walls) // 2] * 1000, 3),
        "step_p99_ms": round(walls[int(len(walls) * 0.99)] * 1000, 3),
    }


def run_tree(tree: Path, args: argparse.Namespace) -> dict[str, object]:
    """This script in a process of its own, importing from `tree` (its modules first on the path)."""
    env = dict(os.environ, PYTHONPATH=f"{tree}:{tree / 'clients'}")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--inside", "--steps", str(args.steps)]
    cmd += ["--sessions", str(args.sessions), "--sizes", args.sizes]
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"the bench under {tree} failed:\n{done.stderr[-3000:]}")
    figures: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base", default="main", help="the commit to compare with (default main)")
    parser.add_argument("--no-base", action="store_true", help="measure the working tree only")
    parser.add_argument("--steps", type=int, default=3000, help="resident steps measured per state size")
    parser.add_argument("--sessions", type=int, default=8, help="resident sessions stepped in turn")
    parser.add_argument("--sizes", default="small,large", help=f"state sizes, of {', '.join(SIZES)}")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inside:
        import codegym

        tree = Path(codegym.__file__).resolve().parent.parent
        if tree != Path.cwd().resolve():
            raise RuntimeError(f"measuring {tree}'s code instead of {Path.cwd()}'s")
        sizes = args.sizes.split(",")
        figures = {size: asyncio.run(measure(size, args.steps, args.sessions)) for size in sizes}
        print(json.dumps(figures))
        return
    sys.path.insert(0, str(ROOT))
    from bench.stacks import compared_trees

    with contextlib.ExitStack() as cleanup:
        trees = compared_trees(args, cleanup)
        rows = {name: run_tree(tree, args) for name, tree in trees.items()}
    keys = [
        "state_bytes",
        "resident_share",
        "worker_cpu_ms_per_step",
        "jail_cpu_ms_per_step",
        "zygote_cpu_ms_per_step",
        "step_p50_ms",
        "step_p99_ms",
    ]
    for size in args.sizes.split(","):
        print(f"\n{size} state, {args.steps} resident steps over {args.sessions} sessions, one at a time")
        width = max(len(k) for k in keys)
        print(f"{'':<{width}}  " + "  ".join(f"{name:>22}" for name in rows))
        for key in keys:
            print(f"{key:<{width}}  " + "  ".join(f"{row[size][key]!s:>22}" for row in rows.values()))  # type: ignore[index]


if __name__ == "__main__":
    main()

"""Scale-out benchmark: steps/s with 1, 2, 3 sandbox workers and 1, 2 runtime replicas, and the
per-step cost of the Redis session store against the in-memory one, all in one run.

Each topology is a `codegym up` (its own processes on loopback); 32 sessions replay recorded
oracle trajectories through a client that balances round_robin over the runtimes. On a 2-core
machine adding processes cannot add CPU: the figures say how much each topology costs, not how
far it would scale on more cores.

    .venv/bin/python bench/scale_bench.py [--sessions 32] [--steps 1500] [--max-seconds 30]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import median, start_process  # noqa: E402
from bench.runtime_bench import replay  # noqa: E402
from codegym.procs import RedisServer as PrivateRedis  # noqa: E402
from codegym_client.async_client import AsyncRuntimeClient  # noqa: E402
from codegym_jobs.oracle import read_trajectories  # noqa: E402

TOPOLOGIES = [
    # (label, workers, runtimes, sessions in Redis)
    ("1 worker, 1 runtime, in-memory sessions", 1, 1, False),
    ("2 workers, 1 runtime, in-memory sessions", 2, 1, False),
    ("3 workers, 1 runtime, in-memory sessions", 3, 1, False),
    ("2 workers, 1 runtime, Redis sessions", 2, 1, True),
    ("2 workers, 2 runtimes, Redis sessions", 2, 2, True),
]


async def measure(
    address: str, trajectories: list, sessions: int, steps: int, max_s: float
) -> tuple[float, float]:
    async with AsyncRuntimeClient(address, timeout_s=120) as client:
        await client.wait_ready(60)
        await replay(client, trajectories, 4, 200, 20)  # warm up: sources cached, jails forked
        rate, step_lat, _ = await replay(client, trajectories, sessions, steps, max_s)
    return rate, median(step_lat)


def run(args: argparse.Namespace) -> None:
    trajectories = [
        t for t in read_trajectories(ROOT / "codegym" / "samples" / "trajectories.jsonl") if t.get("steps")
    ]
    workdir = Path(tempfile.mkdtemp(prefix="codegym-scale-bench-"))
    rows = []
    for label, workers, runtimes, use_redis in TOPOLOGIES:
        redis = PrivateRedis("127.0.0.1") if use_redis else None
        argv = [
            "-m",
            "codegym_cli.cli",
            "up",
            "--library",
            str(workdir / "library.db"),
            "--port",
            "0",
            "--workers",
            str(workers),
            "--jails",
            "1",
            "--runtimes",
            str(runtimes),
        ]
        if redis is not None:
            argv += ["--sessions", redis.url]
        up = start_process(argv)
        try:
            rate, p50 = asyncio.run(
                measure(up.address, trajectories, args.sessions, args.steps, args.max_seconds)
            )
            rows.append((label, rate, p50))
            print(f"... {label}: {rate:.0f} steps/s", file=sys.stderr, flush=True)
        finally:
            up.stop(timeout_s=60)
            if redis is not None:
                redis.stop()
            time.sleep(0.5)
    shutil.rmtree(workdir, ignore_errors=True)
    base = rows[0][1]
    memory = next(r for r in rows if r[0].startswith("2 workers, 1 runtime, in-memory"))
    width = max(len(r[0]) for r in rows)
    print(
        f"{args.sessions} sessions, jails: 1 per worker; steps/s (ratio to 1 worker, 1 runtime), step p50 ms"
    )
    for label, rate, p50 in rows:
        print(f"{label:<{width}}  {rate:>7.0f}  ({rate / base:.2f}x)  p50 {p50 * 1000:.2f}")
    redis_row = next(r for r in rows if r[0].startswith("2 workers, 1 runtime, Redis"))
    per_step_ms = 1000 / redis_row[1] - 1000 / memory[1]
    print(
        f"Redis store against in-memory (2 workers, 1 runtime): {per_step_ms:+.3f} ms of wall per step"
        f" at {args.sessions} sessions"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sessions", type=int, default=32, help="concurrent sessions")
    parser.add_argument("--steps", type=int, default=1500, help="steps measured per topology")
    parser.add_argument("--max-seconds", type=float, default=30.0, help="time cap per topology")
    run(parser.parse_args())


if __name__ == "__main__":
    main()

"""Step cost benchmark: the CPU of a warm step (the session's resident process) beside a cold one
(a fork of the jail's zygote, the committed state unpickled), on one sandbox worker.

These two figures price a resident session: what it saves is a cold step's CPU minus a warm
one's, each time its session steps; what it costs is its memory for as long as it is held.
`sandbox_worker/residency.py` derives the resident idle time from them (`WARM_STEP_CPU_S`,
`COLD_STEP_CPU_S` are this bench's figures), so rerun it when the step path changes.

Starts `codegym serve sandbox --jails 1` and, for each mode, opens `--sessions` sessions on the
recorded oracle trajectories (codegym/samples/trajectories.jsonl; the creates are not counted),
then plays their steps, `--concurrency` at once, every observation compared with its recording,
and reads the CPU over the steps alone:

  warm   each session created with its key: every step runs in its resident process
  cold   no session key: every step is a one-shot fork from the committed state, the step a
         session gets once it steps further apart than the resident idle time
  keep   a cold step that stays on as the session's resident (a session evicted, or new to its
         worker): each step is sent with a state the jail does not hold

Figures: CPU ms per step of the worker process and of its jail (nsjail, zygote, every child,
reaped ones included), and the step's p50 latency. A 2-core machine shared with other work gives
noisy figures: compare the modes of one run.

    .venv/bin/python bench/step_cost_bench.py [--sessions 64] [--steps 2000] [--concurrency 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import Line, pct, progress, start_process  # noqa: E402
from codegym import proctree  # noqa: E402
from codegym.sandbox.v1 import sandbox_service_pb2 as pb  # noqa: E402
from codegym.sandbox.v1 import sandbox_service_pb2_grpc as pb_grpc  # noqa: E402
from codegym_jobs.oracle import read_trajectories  # noqa: E402

MODES = ("warm", "cold", "keep")
SOURCES = {p.stem: p.read_text() for p in (ROOT / "codegym" / "samples" / "envs").glob("*__*Env.py")}
LIMITS = pb.Limits(wall_ms=5000, cpu_ms=5000)


@dataclass
class Episode:
    """One session the bench commits like the runtime does: the state of its last good step."""

    key: str
    line: Line
    state: bytes = b""
    at: int = 0
    stale: bytes = field(default=b"", repr=False)


def worker_cpu_s(worker_pid: int) -> tuple[float, float]:
    """CPU seconds so far of the worker process itself, and of everything below it (its jails)."""
    links = proctree.children_by_parent()
    jailed = proctree.descendants(links.get(worker_pid, []), links)
    jail_ticks = sum(proctree.cpu_ticks(pid, reaped=True) for pid in jailed)
    return proctree.cpu_ticks(worker_pid, reaped=False) / proctree.CLK_TCK, jail_ticks / proctree.CLK_TCK


async def execute(stub: pb_grpc.SandboxServiceStub, op: pb.Operation) -> pb.OperationResult:
    answer = await stub.Execute(pb.ExecuteRequest(operation=op), timeout=60)
    return answer.result


async def open_episode(stub: pb_grpc.SandboxServiceStub, mode: str, index: int, line: Line) -> Episode:
    episode = Episode(key=f"{mode}-{index}", line=line)
    created = await execute(
        stub,
        pb.Operation(
            source=pb.SourceRef(code=SOURCES[line["env_id"]]),
            limits=LIMITS,
            seed=index,
            create=pb.CreateOp(
                config_json=json.dumps(line["config"]), session_key=episode.key if mode == "warm" else ""
            ),
        ),
    )
    if created.status != pb.STATUS_OK:
        raise RuntimeError(f"create of {line['env_id']} failed: {created.message}")
    episode.state = created.state
    return episode


async def step(stub: pb_grpc.SandboxServiceStub, mode: str, episode: Episode) -> bool:
    """The episode's next recorded step; False when the observation differs from the recording."""
    action, expected = episode.line["steps"][episode.at]
    op = pb.Operation(
        source=pb.SourceRef(code=SOURCES[episode.line["env_id"]]),
        limits=LIMITS,
        seed=episode.at + 1,
        step=pb.StepOp(state=episode.state, action=action, session_key="" if mode == "cold" else episode.key),
    )
    if mode == "keep":
        # Two keys in turn: the one named holds the state of two steps ago (stale), so the step
        # runs cold, that process is ended and the new one stays on.
        op.step.session_key = f"{episode.key}-{episode.at % 2}"
    result = await execute(stub, op)
    if result.status != pb.STATUS_OK:
        raise RuntimeError(f"step of {episode.line['env_id']} failed: {result.message}")
    if mode == "warm" and not result.resident:
        raise RuntimeError("a warm step did not run in its resident process")
    episode.state = result.state
    episode.at += 1
    return result.observation == expected


async def release(stub: pb_grpc.SandboxServiceStub, key: str) -> None:
    await stub.Execute(pb.ExecuteRequest(operation=pb.Operation(release=pb.ReleaseOp(session_key=key))))


async def measure(
    stub: pb_grpc.SandboxServiceStub, worker_pid: int, mode: str, lines: list[Line], args: argparse.Namespace
) -> dict[str, Any]:
    rng = random.Random(args.seed)
    chosen = [rng.choice(lines) for _ in range(args.sessions)]
    episodes = [await open_episode(stub, mode, i, line) for i, line in enumerate(chosen)]
    ready: asyncio.Queue[Episode] = asyncio.Queue()
    for episode in episodes:
        ready.put_nowait(episode)
    latencies: list[float] = []
    mismatches = 0
    stop_at = time.monotonic() + args.max_seconds

    async def player() -> None:
        nonlocal mismatches
        while len(latencies) < args.steps and time.monotonic() < stop_at:
            episode = await ready.get()
            started = time.perf_counter()
            if not await step(stub, mode, episode):
                mismatches += 1
            latencies.append(time.perf_counter() - started)
            if episode.at >= len(episode.line["steps"]):
                # Played to its end: the same line again from a fresh session.
                fresh = await open_episode(stub, mode, rng.randrange(1 << 30), episode.line)
                episode.state, episode.at = fresh.state, 0
                episode.key = fresh.key
                latencies.append(-1.0)  # a create: not a step, not timed
            ready.put_nowait(episode)

    worker_before, jail_before = worker_cpu_s(worker_pid)
    started = time.monotonic()
    await asyncio.gather(*(player() for _ in range(args.concurrency)))
    seconds = time.monotonic() - started
    worker_after, jail_after = worker_cpu_s(worker_pid)
    for episode in episodes:
        for key in (episode.key, f"{episode.key}-0", f"{episode.key}-1"):
            await release(stub, key)
    steps = [t for t in latencies if t >= 0]
    creates = len(latencies) - len(steps)
    worker_ms = (worker_after - worker_before) * 1000 / len(steps)
    jail_ms = (jail_after - jail_before) * 1000 / len(steps)
    return {
        "mode": mode,
        "steps": len(steps),
        "creates_beside": creates,
        "steps_per_s": len(steps) / seconds,
        "worker_ms": worker_ms,
        "jail_ms": jail_ms,
        "total_ms": worker_ms + jail_ms,
        "p50_ms": pct(steps, 0.5) * 1000,
        "mismatches": mismatches,
    }


async def hold(stub: pb_grpc.SandboxServiceStub, count: int, lines: list[Line]) -> list[str]:
    """`count` sessions made resident and left idle: a jail's fork, which every cold step pays,
    slows with the processes the jail holds, as in a stack with thousands of rollouts in flight."""
    keys = []
    for index in range(count):
        line = lines[index % len(lines)]
        episode = await open_episode(stub, "warm", 1_000_000 + index, line)
        keys.append(episode.key)
    return keys


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    lines = [
        line
        for line in read_trajectories(args.trajectories)
        if line.get("steps") and line["env_id"] in SOURCES
    ]
    worker = start_process(
        [
            "-m",
            "codegym_cli.cli",
            "serve",
            "sandbox",
            "--port",
            "0",
            "--jails",
            "1",
            "--resident-idle-s",
            "3600",
        ]
    )
    rows = []
    try:
        async with grpc.aio.insecure_channel(worker.address) as channel:
            stub = pb_grpc.SandboxServiceStub(channel)
            if args.held:
                progress(f"holding {args.held} idle resident sessions")
                await hold(stub, args.held, lines)
            for mode in args.modes:
                progress(f"{mode}: {args.sessions} sessions, {args.steps} steps, {args.concurrency} at once")
                rows.append(await measure(stub, worker.pid, mode, lines, args))
    finally:
        worker.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    parser.add_argument("--sessions", type=int, default=64, help="sessions played round robin")
    parser.add_argument("--steps", type=int, default=2000, help="steps measured per mode")
    parser.add_argument(
        "--held", type=int, default=0, help="idle resident sessions the jail holds throughout"
    )
    parser.add_argument("--concurrency", type=int, default=4, help="steps in flight")
    parser.add_argument("--max-seconds", type=float, default=60.0, help="time cap per mode")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--trajectories", type=Path, default=ROOT / "codegym" / "samples" / "trajectories.jsonl"
    )
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args()
    args.modes = [m for m in args.modes.split(",") if m]
    unknown = set(args.modes) - set(MODES)
    if unknown:
        parser.error(f"unknown modes: {', '.join(sorted(unknown))}")
    rows = asyncio.run(run(args))
    print(
        f"{'mode':6} {'steps':>6} {'steps/s':>8} {'worker ms':>10} {'jail ms':>8} {'total ms':>9} {'p50 ms':>7} {'mism.':>5}"
    )
    for row in rows:
        print(
            f"{row['mode']:6} {row['steps']:6d} {row['steps_per_s']:8.0f} {row['worker_ms']:10.2f} "
            f"{row['jail_ms']:8.2f} {row['total_ms']:9.2f} {row['p50_ms']:7.2f} {row['mismatches']:5d}"
        )
    by_mode = {row["mode"]: row for row in rows}
    if "warm" in by_mode and "cold" in by_mode:
        cold, warm = by_mode["cold"]["total_ms"], by_mode["warm"]["total_ms"]
        print(f"a resident saves {cold - warm:.2f} ms of CPU per step (cold {cold:.2f} - warm {warm:.2f})")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()

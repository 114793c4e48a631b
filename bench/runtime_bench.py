"""Runtime benchmark: oracle trajectories replayed through `codegym up` (1 runtime, 2 workers).

Replays the recorded oracle trajectories of the sample environments (codegym/samples/trajectories.jsonl)
with 1, 8, 32 and 256 concurrent sessions, then holds many open sessions and measures memory.
Every figure is printed beside a bare gRPC echo measured in the same run at the same concurrency.

    .venv/bin/python bench/runtime_bench.py [--steps 3000] [--open-sessions 10000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    closed_loop,
    cpu_by_role,
    echo_callable,
    median,
    pct,
    start_process,
    tree_memory_kb,
    zygote_children_memory_kb,
)
from codegym import proctree  # noqa: E402
from codegym_client.api.runtime.v1 import runtime_service_pb2 as rt  # noqa: E402
from codegym_client.async_client import AsyncRuntimeClient  # noqa: E402
from codegym_jobs.oracle import read_trajectories  # noqa: E402


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f}"


async def replay(
    client: AsyncRuntimeClient, trajectories: list[dict[str, Any]], sessions: int, total: int, max_s: float
) -> tuple[float, list[float], list[float]]:
    """`sessions` concurrent episodes, each replaying a trajectory; stops after `total` steps or `max_s`."""
    step_lat: list[float] = []
    create_lat: list[float] = []
    next_index = iter(range(10**9))
    stop_at = time.monotonic() + max_s

    async def session_loop() -> None:
        while len(step_lat) < total and time.monotonic() < stop_at:
            line = trajectories[next(next_index) % len(trajectories)]
            t = time.perf_counter()
            created = await client.create_session(env_id=line["env_id"], config=line["config"])
            create_lat.append(time.perf_counter() - t)
            for action, expected in line["steps"]:
                if len(step_lat) >= total or time.monotonic() > stop_at:
                    break
                t = time.perf_counter()
                response = await client.step(created.session_id, action)
                step_lat.append(time.perf_counter() - t)
                if response.observation != expected:
                    raise RuntimeError(f"{line['env_id']}: observation differs from the recording")
            await client.close_session(created.session_id)

    started = time.perf_counter()
    await asyncio.gather(*(session_loop() for _ in range(sessions)))
    return len(step_lat) / (time.perf_counter() - started), step_lat, create_lat


async def replay_batched(
    client: AsyncRuntimeClient, trajectories: list[dict[str, Any]], sessions: int, total: int, max_s: float
) -> tuple[float, list[float]]:
    """`sessions` episodes driven by one caller with BatchStep: one batch = one step of every session."""
    batch_lat: list[float] = []
    steps = 0
    stop_at = time.monotonic() + max_s
    started = time.perf_counter()
    cursor = 0
    while steps < total and time.monotonic() < stop_at:
        lines = [trajectories[(cursor + i) % len(trajectories)] for i in range(sessions)]
        cursor += sessions
        created = await asyncio.gather(
            *(client.create_session(env_id=t["env_id"], config=t["config"]) for t in lines)
        )
        live = {c.session_id: iter(t["steps"]) for c, t in zip(created, lines, strict=True)}
        while live and steps < total and time.monotonic() < stop_at:
            batch = []
            for sid, it in list(live.items()):
                step = next(it, None)
                if step is None:
                    del live[sid]
                else:
                    batch.append((sid, step[0]))
            if not batch:
                break
            t = time.perf_counter()
            results = await client.batch_step(batch)
            batch_lat.append(time.perf_counter() - t)
            steps += len(results)
            if any(r.code for r in results):
                raise RuntimeError("a batch entry failed")
        await asyncio.gather(*(client.close_session(c.session_id) for c in created))
    return steps / (time.perf_counter() - started), batch_lat


async def replay_streamed(
    client: AsyncRuntimeClient, trajectories: list[dict[str, Any]], sessions: int, total: int, max_s: float
) -> tuple[float, list[float]]:
    """`sessions` episodes driven by one caller over one StepStream: a session's next step goes out
    as soon as its previous one is answered, so no session waits for the slowest."""
    step_lat: list[float] = []
    stop_at = time.monotonic() + max_s
    cursor = iter(range(10**9))
    stream = client.step_stream()
    live: dict[str, tuple[Any, float]] = {}

    async def open_one() -> None:
        line = trajectories[next(cursor) % len(trajectories)]
        created = await client.create_session(env_id=line["env_id"], config=line["config"])
        steps = iter(line["steps"])
        action, expected = next(steps)
        live[created.session_id] = (steps, expected)
        await stream.send(created.session_id, action, tag=str(time.perf_counter()))

    started = time.perf_counter()
    await asyncio.gather(*(open_one() for _ in range(sessions)))
    while live:
        answer = await stream.recv()
        if answer is None:
            break
        step_lat.append(time.perf_counter() - float(answer.tag))
        steps, expected = live[answer.session_id]
        if answer.code or answer.response.observation != expected:
            raise RuntimeError(f"stream step failed: {answer.message or 'observation differs'}")
        step = next(steps, None)
        if step is None:
            del live[answer.session_id]
            await client.close_session(answer.session_id)
            if len(step_lat) < total and time.monotonic() < stop_at:
                await open_one()
            continue
        live[answer.session_id] = (steps, step[1])
        await stream.send(answer.session_id, step[0], tag=str(time.perf_counter()))
    await stream.done_sending()
    return len(step_lat) / (time.perf_counter() - started), step_lat


async def hold_sessions(client: AsyncRuntimeClient, count: int, max_s: float) -> list[str]:
    ids: list[str] = []
    stop_at = time.monotonic() + max_s
    config = {"nums": [3, -1, 4, -1, 5, -9, 2, 6]}

    async def opener() -> None:
        while len(ids) < count and time.monotonic() < stop_at:
            created = await client.create_session(env_id="Sample_0001_I__MaxSubarraySumEnv", config=config)
            ids.append(created.session_id)

    await asyncio.gather(*(opener() for _ in range(32)))
    return ids


def runtime_pid(up_pid: int) -> int:
    for pid in proctree.children_by_parent().get(up_pid, []):
        if "serve runtime" in (proctree.cmdline(pid) or ""):
            return pid
    raise RuntimeError("runtime process not found")


async def run(args: argparse.Namespace) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="codegym-bench-"))
    up = start_process(
        [
            "-m",
            "codegym_cli.cli",
            "up",
            "--library",
            str(workdir / "library.db"),
            "--port",
            "0",
            "--workers",
            "2",
        ]
    )
    echo = start_process([str(ROOT / "bench" / "common.py")])
    address, echo_address = up.address, echo.address
    trajectories = [t for t in read_trajectories(args.trajectories) if t.get("steps")]
    rows: list[tuple[str, str, str]] = []
    try:
        async with (
            AsyncRuntimeClient(address, timeout_s=120) as client,
            grpc.aio.insecure_channel(echo_address) as ech,
        ):
            await client.wait_ready()
            echo_call = echo_callable(ech)
            payload = rt.StepRequest(
                session_id="0" * 32, action_json='{"name": "GetElement", "parameters": {"index": 2}}'
            ).SerializeToString()

            async def echo_once(_: int) -> None:
                await echo_call(payload, timeout=10)

            await replay(client, trajectories, 4, 300, 30)  # warm up: sources cached on both workers
            await closed_loop(echo_once, 4, 300, 10)
            for sessions in args.sessions:
                total = args.steps if sessions > 1 else max(300, args.steps // 6)
                cpu_before = cpu_by_role(up.pid)
                rate, step_lat, create_lat = await replay(
                    client, trajectories, sessions, total, args.max_seconds
                )
                cpu_after = cpu_by_role(up.pid)
                per_step = {
                    role: (cpu_after[role] - cpu_before[role]) * 1000 / max(1, len(step_lat))
                    for role in cpu_after
                }
                echo_rate, echo_lat = await closed_loop(echo_once, sessions, total, args.max_seconds)
                rows += [
                    (f"{sessions} sessions: steps/s", f"{rate:.0f}", f"{echo_rate:.0f} calls/s"),
                    (
                        f"{sessions} sessions: step p50 / p99 ms",
                        f"{ms(median(step_lat))} / {ms(pct(step_lat, 0.99))}",
                        f"{ms(median(echo_lat))} / {ms(pct(echo_lat, 0.99))}",
                    ),
                    (
                        f"{sessions} sessions: create p50 / p99 ms",
                        f"{ms(median(create_lat))} / {ms(pct(create_lat, 0.99))}",
                        "",
                    ),
                    (
                        f"{sessions} sessions: CPU ms per step runtime/worker/jail",
                        " / ".join(f"{per_step[r]:.2f}" for r in ("runtime", "worker", "jail")),
                        "(creates and closes included)",
                    ),
                ]
                if sessions == 1:
                    ratio_1 = median(step_lat) / median(echo_lat)
                    rows.append(("1 session: step p50 / echo p50", f"{ratio_1:.1f}x", "target <= 3x"))
                if sessions == 32:
                    rows.append(
                        (
                            "32 sessions: steps/s / echo calls/s",
                            f"{100 * rate / echo_rate:.0f} %",
                            "target >= 40 %",
                        )
                    )
                print(f"... {sessions} sessions done", file=sys.stderr, flush=True)
            if 32 in args.sessions:
                rate, stream_lat = await replay_streamed(
                    client, trajectories, 32, args.steps, args.max_seconds
                )
                rows.append(
                    (
                        "32 sessions via StepStream (1 caller): steps/s",
                        f"{rate:.0f} (step p50 {ms(median(stream_lat))} ms)",
                        "",
                    )
                )
                rate, batch_lat = await replay_batched(client, trajectories, 32, args.steps, args.max_seconds)
                rows.append(
                    (
                        "32 sessions via BatchStep (1 caller): steps/s",
                        f"{rate:.0f} (batch p50 {ms(median(batch_lat))} ms)",
                        "",
                    )
                )
            count, uss, pss_each = zygote_children_memory_kb()
            rows.append(
                (
                    "resident session processes (+1 spare per jail): count, USS / PSS each MiB",
                    f"{count}, {uss / 1024:.1f} / {pss_each / 1024:.1f}",
                    "",
                )
            )
            rss_idle, pss_idle = tree_memory_kb(up.pid)
            runtime_idle = tree_memory_kb(runtime_pid(up.pid))[0]
            started = time.perf_counter()
            ids = await hold_sessions(client, args.open_sessions, args.max_seconds * 10)
            opened_s = time.perf_counter() - started
            rss, pss = tree_memory_kb(up.pid)
            runtime_rss = tree_memory_kb(runtime_pid(up.pid))[0]
            alive = await client.get_session(ids[-1])
            assert alive.status == rt.SESSION_STATUS_ACTIVE
            rows += [
                ("open sessions held", f"{len(ids)} (opened in {opened_s:.1f} s)", ""),
                (
                    "RSS all processes, idle -> with sessions MiB",
                    f"{rss_idle / 1024:.0f} -> {rss / 1024:.0f}",
                    "target <= 1024",
                ),
                (
                    "PSS all processes, idle -> with sessions MiB",
                    f"{pss_idle / 1024:.0f} -> {pss / 1024:.0f}",
                    "",
                ),
                ("runtime process RSS MiB", f"{runtime_idle / 1024:.0f} -> {runtime_rss / 1024:.0f}", ""),
                ("echo server RSS MiB", "", f"{tree_memory_kb(echo.pid)[0] / 1024:.0f}"),
            ]
    finally:
        up.stop(timeout_s=30)
        echo.stop(signal.SIGKILL, timeout_s=10)
        shutil.rmtree(workdir, ignore_errors=True)
    width = max(len(r[0]) for r in rows)
    print(f"{'figure':<{width}}  {'runtime':>26}  {'bare gRPC echo':>22}")
    for name, value, base in rows:
        print(f"{name:<{width}}  {value:>26}  {base:>22}")
    if args.json:
        print(json.dumps(rows))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trajectories", default=str(ROOT / "codegym" / "samples" / "trajectories.jsonl"))
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 8, 32, 256])
    parser.add_argument("--steps", type=int, default=3000, help="steps measured per concurrency level")
    parser.add_argument("--max-seconds", type=float, default=60.0, help="time cap per level")
    parser.add_argument(
        "--open-sessions", type=int, default=10_000, help="sessions held for the memory figure"
    )
    parser.add_argument("--json", action="store_true", help="also print the rows as JSON")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()

"""Soak with faults: episodes through the trainer paths, all at once, while infrastructure fails.

A training run lives for hours through deploys, scale-in and blips. This runs `codegym up
--runtimes 2 --workers 2 --openenv-port 0` over a Redis of its own (an append-only file, so a
restarted Redis keeps its sessions) and plays recorded oracle trajectories (examples/trajectories.jsonl)
through each path, with think time between steps, while a schedule of faults runs in a loop:

  rolling restart   each runtime replica sent SIGTERM in turn (`codegym up` starts it again on
                    its port), the next once the first answers again
  worker killed     a sandbox worker SIGKILLed
  worker drained    a sandbox worker sent SIGTERM (scale-in)
  worker frozen     a sandbox worker stopped with SIGSTOP for 15 s, then SIGCONT
  gateway restart   the OpenEnv gateway sent SIGTERM
  redis restart     Redis stopped and started again on its port and file

Paths: `client` (the async client, as the trainer adapters drive it: every call through
`codegym_client.outages.ride_out_async`, steps sent with their index) and `openenv` (a WebSocket
per episode, as OpenEnv's EnvClient opens them). TRL's `environment_factory` and verl's agent loop
run in their own venv (`make test-trainers`) and are not driven here yet.

Per path it reports episodes finished; episodes **shaped** by a fault (an observation that differs
from the recording: must be 0); episodes lost (ended by an error, with the reasons); and at the
end the sessions left open in Redis (must be 0 once every episode closed its own) and the PSS of
every server at start and end.

    .venv/bin/python bench/soak.py [--minutes 20] [--rollouts 16] [--think-s 1] [--faults all]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import re
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import tree_memory_kb  # noqa: E402
from bench.rollout_bench import Failed, Refused, WsEpisode  # noqa: E402
from codegym.procs import RedisServer, ServerProcess  # noqa: E402
from codegym_cli.oracle import read_trajectories  # noqa: E402
from codegym_client.async_client import AsyncRuntimeClient  # noqa: E402
from codegym_client.errors import CodeGymError  # noqa: E402
from codegym_client.outages import ride_out_async  # noqa: E402

Line = dict[str, Any]
FAULTS = ("rolling", "kill", "drain", "freeze", "gateway", "redis")
# A server's line in `codegym up`'s output: at start and after each restart.
SERVER_LINE = re.compile(r"(runtime \d+|sandbox worker \d+|openenv gateway) (?:back )?at (\S+) \(pid (\d+)\)")
FREEZE_S = 15.0
SERVERS = ("runtime 1", "runtime 2", "sandbox worker 1", "sandbox worker 2", "openenv gateway")


@dataclass
class PathTally:
    """What happened to the episodes of one path."""

    finished: int = 0
    shaped: int = 0
    # Episodes that ended mid-way by an error, by reason.
    lost: Counter[str] = field(default_factory=Counter)
    # Episodes that could not start (refused or no server at connect), by reason: sent again.
    not_started: Counter[str] = field(default_factory=Counter)
    steps: int = 0
    examples: list[str] = field(default_factory=list)


class Stack:
    """`codegym up` over our own Redis; knows each server's current pid from up's output."""

    def __init__(self, workdir: Path) -> None:
        self.redis_folder = workdir / "redis"
        self.redis_folder.mkdir()
        self.redis = RedisServer(folder=self.redis_folder)
        argv = [sys.executable, "-m", "codegym_cli.cli", "up", "--library", str(workdir / "library.db"),
                "--port", "0", "--runtimes", "2", "--workers", "2", "--openenv-port", "0",
                "--sessions", self.redis.url]  # fmt: skip
        self.up = ServerProcess(argv, name="codegym up", keep=100_000, timeout_s=180)
        self.runtimes = self.up.address.split(",")
        # `codegym up` names its servers right after its ready line.
        deadline = time.monotonic() + 30
        while len(self.servers()) < len(SERVERS):
            if time.monotonic() > deadline:
                raise RuntimeError(f"codegym up named only {sorted(self.servers())}")
            time.sleep(0.1)

    def servers(self) -> dict[str, tuple[str, int]]:
        """Each server's name → (address, pid), the latest line for each."""
        found: dict[str, tuple[str, int]] = {}
        for name, address, pid in SERVER_LINE.findall(self.up.text):
            found[name] = (address, int(pid))
        return found

    def gateway_url(self) -> str:
        return f"ws://{self.servers()['openenv gateway'][0]}/ws"

    def pid(self, name: str) -> int:
        return self.servers()[name][1]

    async def restarted(self, name: str, old_pid: int, timeout_s: float = 90.0) -> None:
        """Wait until `codegym up` says `name` is back under a new pid."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.servers().get(name, ("", old_pid))[1] != old_pid:
                return
            await asyncio.sleep(0.2)
        raise RuntimeError(f"{name} did not come back within {timeout_s:.0f} s")

    def memory_mib(self) -> dict[str, float]:
        """PSS of each server process (its jails included for the workers) and of Redis."""
        out = {name: tree_memory_kb(pid)[1] / 1024 for name, (_, pid) in sorted(self.servers().items())}
        out["redis"] = tree_memory_kb(self.redis.pid)[1] / 1024
        return out

    def stop(self) -> None:
        self.up.stop()
        self.redis.stop()


async def fault_loop(stack: Stack, faults: list[str], until: float, log: list[str]) -> None:
    """Run the faults one after the other, a pause between them, until `until`."""
    rng = random.Random(7)
    while time.monotonic() < until:
        for fault in faults:
            if time.monotonic() >= until:
                return
            await asyncio.sleep(rng.uniform(5, 15))
            started = time.monotonic()
            await FAULT_ACTIONS[fault](stack)
            log.append(f"{time.strftime('%H:%M:%S')} {fault} ({time.monotonic() - started:.1f} s)")
            print(f"... fault: {log[-1]}", file=sys.stderr, flush=True)


async def rolling(stack: Stack) -> None:
    for name in ("runtime 1", "runtime 2"):
        pid = stack.pid(name)
        os.kill(pid, signal.SIGTERM)
        await stack.restarted(name, pid)


async def kill_worker(stack: Stack) -> None:
    pid = stack.pid("sandbox worker 1")
    os.kill(pid, signal.SIGKILL)
    await stack.restarted("sandbox worker 1", pid)


async def drain_worker(stack: Stack) -> None:
    pid = stack.pid("sandbox worker 2")
    os.kill(pid, signal.SIGTERM)
    await stack.restarted("sandbox worker 2", pid)


async def freeze_worker(stack: Stack) -> None:
    pid = stack.pid("sandbox worker 1")
    os.kill(pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(FREEZE_S)
    finally:
        os.kill(pid, signal.SIGCONT)


async def restart_gateway(stack: Stack) -> None:
    pid = stack.pid("openenv gateway")
    os.kill(pid, signal.SIGTERM)
    await stack.restarted("openenv gateway", pid)


async def restart_redis(stack: Stack) -> None:
    port = stack.redis.port
    stack.redis.stop()
    stack.redis = RedisServer(port=port, folder=stack.redis_folder)


FAULT_ACTIONS: dict[str, Callable[[Stack], Awaitable[None]]] = {
    "rolling": rolling,
    "kill": kill_worker,
    "drain": drain_worker,
    "freeze": freeze_worker,
    "gateway": restart_gateway,
    "redis": restart_redis,
}


class RidingEpisode:
    """A session through the async client as the trainer adapters drive it: every call riding out
    outages, each step sent with its index (a repeat is answered from the record)."""

    def __init__(self, client: AsyncRuntimeClient) -> None:
        self.client = client
        self.session = ""
        self.index = 0

    async def create(self, line: Line) -> None:
        client = self.client
        created = await ride_out_async(
            lambda: client.create_session(env_id=line["env_id"], config=line["config"]), "create"
        )
        self.session, self.index = created.session_id, 0

    async def step(self, action: str) -> str:
        session, index = self.session, self.index
        reply = await ride_out_async(lambda: self.client.step(session, action, step_index=index), "step")
        self.index += 1
        return str(reply.observation)

    async def close(self) -> None:
        if self.session:
            session, self.session = self.session, ""
            with contextlib.suppress(Exception):
                await ride_out_async(lambda: self.client.close_session(session), "close", 60)


def failure_reason(exc: Exception) -> str:
    if isinstance(exc, CodeGymError):
        return exc.reason or type(exc).__name__
    if isinstance(exc, Failed | Refused):  # an OpenEnv error frame
        return str(exc).split(":", 1)[0]
    return type(exc).__name__  # the socket dropped or was refused (websockets' kin)


async def rollout(
    episode: Callable[[], RidingEpisode | WsEpisode],
    lines: list[Line],
    tally: PathTally,
    think_s: float,
    until: float,
    seed: int,
) -> None:
    """Episodes one after the other on one path, each observation compared with its recording."""
    rng = random.Random(seed)
    while time.monotonic() < until:
        line = rng.choice(lines)
        playing = episode()
        started = False
        try:
            await playing.create(line)
            started = True
            for index, (action, expected) in enumerate(line["steps"]):
                await asyncio.sleep(rng.uniform(0.5, 1.5) * think_s)
                observation = await playing.step(action)
                tally.steps += 1
                if observation != expected:
                    tally.shaped += 1
                    tally.examples.append(f"{line['env_id']} step {index}: {observation[:80]!r}")
                    break
            else:
                tally.finished += 1
        except Exception as exc:
            (tally.lost if started else tally.not_started)[failure_reason(exc)] += 1
            await asyncio.sleep(1)
        finally:
            await playing.close()


async def soak(args: argparse.Namespace, stack: Stack, lines: list[Line]) -> dict[str, Any]:
    until = time.monotonic() + args.minutes * 60
    tallies = {"client": PathTally(), "openenv": PathTally()}
    faults_log: list[str] = []
    memory_start = stack.memory_mib()
    async with AsyncRuntimeClient(",".join(stack.runtimes), timeout_s=60) as client:
        await client.wait_ready(60)
        paths: dict[str, Callable[[], RidingEpisode | WsEpisode]] = {
            "client": lambda: RidingEpisode(client),
            "openenv": lambda: WsEpisode(stack.gateway_url()),
        }
        tasks = [
            asyncio.create_task(rollout(make, lines, tallies[name], args.think_s, until, seed * 1000 + i))
            for seed, (name, make) in enumerate(paths.items())
            for i in range(args.rollouts)
        ]
        faults = FAULTS if args.faults == "all" else tuple(f for f in args.faults.split(",") if f)
        tasks.append(asyncio.create_task(fault_loop(stack, list(faults), until - 30, faults_log)))
        await asyncio.gather(*tasks)
    left_open = await sessions_left(stack.redis.url)
    return {
        "minutes": args.minutes,
        "faults": faults_log,
        "paths": {
            name: vars(t) | {"lost": dict(t.lost), "not_started": dict(t.not_started)}
            for name, t in tallies.items()
        },
        "sessions_left_open": left_open,
        "memory_mib": {"start": memory_start, "end": stack.memory_mib()},
    }


async def sessions_left(url: str) -> int:
    from redis.asyncio import Redis

    redis = Redis.from_url(url)
    try:
        return sum([1 async for _ in redis.scan_iter(match="codegym:session:*")])
    finally:
        await redis.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=20.0, help="how long episodes are started")
    parser.add_argument("--rollouts", type=int, default=16, help="episodes in flight per path")
    parser.add_argument("--think-s", type=float, default=1.0, help="mean think time before each step")
    parser.add_argument("--faults", default="all", help=f"comma list of {', '.join(FAULTS)}, or all")
    args = parser.parse_args()
    lines = [t for t in read_trajectories(ROOT / "examples" / "trajectories.jsonl") if t.get("steps")]
    workdir = Path(tempfile.mkdtemp(prefix="codegym-soak-"))
    os.chmod(workdir, 0o755)
    stack = Stack(workdir)
    try:
        report = asyncio.run(soak(args, stack, lines))
    finally:
        stack.stop()
    print(f"soak of {report['minutes']:g} min, faults: {len(report['faults'])}")
    for entry in report["faults"]:
        print(f"  {entry}")
    print(f"{'path':<8} {'finished':>8} {'shaped':>6} {'steps':>7}  lost mid-episode / could not start")
    for name, tally in report["paths"].items():
        print(
            f"{name:<8} {tally['finished']:>8} {tally['shaped']:>6} {tally['steps']:>7}  "
            f"{tally['lost'] or 0} / {tally['not_started'] or 0}"
        )
        for example in tally["examples"][:5]:
            print(f"         shaped: {example}")
    print(f"sessions left open in Redis: {report['sessions_left_open']}")
    print("PSS MiB at start -> end:")
    start, end = report["memory_mib"]["start"], report["memory_mib"]["end"]
    for name in sorted(set(start) | set(end)):
        print(f"  {name:<18} {start.get(name, 0):8.1f} -> {end.get(name, 0):8.1f}")


if __name__ == "__main__":
    main()

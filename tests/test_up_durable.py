"""`codegym up --runtimes 2` as durable as the cluster: its own redis-server is supervised.

The Redis that `up` starts for its runtimes keeps an append-only file beside the library and is
started again on its port and folder when it dies. Killed with SIGKILL while episodes are in flight
through the async client (every call riding out the outage, as the trainer adapters send them),
it costs no episode and shapes no observation, and the episode record that lives in it (Stats)
keeps what it held. The supervisor backs off a server that keeps dying at once (and stops the set
past its budget), but starts one killed after it served again at once, every time.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from codegym.procs import codegym_command
from codegym_cli import up as up_command
from codegym_client.async_client import AsyncRuntimeClient
from codegym_client.outages import ride_out_async
from tests.conftest import SAMPLES
from tests.helpers.processes import wait_until
from tests.helpers.servers import CodegymServer, require_redis_server

TRAJECTORIES = [
    t
    for t in (json.loads(x) for x in (SAMPLES / "trajectories.jsonl").read_text().splitlines())
    if 3 <= len(t["steps"]) <= 20
]
REDIS_LINE = re.compile(r"redis at redis://([\d.]+:\d+)/0 \(pid (\d+);")
REDIS_BACK = re.compile(r"redis back at ([\d.]+:\d+) \(pid (\d+)\)")
ROLLOUTS = 12
EPISODES_EACH = 3


def start_up(tmp_path: Path, *extra: str) -> CodegymServer:
    require_redis_server()
    args = ["up", "--library", str(tmp_path / "lib.db"), "--port", "0", "--jails", "2", "--runtimes", "2"]
    up = CodegymServer([*args, *extra], timeout=120)
    wait_until(lambda: "runtime 2 at" in up.text, 30, "codegym up to name its second runtime")
    return up


def runtimes(up: CodegymServer) -> list[str]:
    return re.findall(r"runtime \d+ at (\S+) \(pid", up.text)


class Tally:
    def __init__(self) -> None:
        self.finished = 0
        self.steps = 0
        self.lost: list[str] = []
        self.shaped: list[str] = []
        self.slowest_call_s = 0.0  # the outage, as a caller saw it


async def riding[T](call: Callable[[], Awaitable[T]], what: str, tally: Tally) -> T:
    """`ride_out_async` as the trainer adapters use it, timed."""
    started = time.monotonic()
    try:
        return await ride_out_async(call, what, 90)
    finally:
        tally.slowest_call_s = max(tally.slowest_call_s, time.monotonic() - started)


async def rollout(client: AsyncRuntimeClient, rng: random.Random, tally: Tally, count: int) -> None:
    """Episodes one after the other, each step sent with its index and compared with the recording."""
    for _ in range(count):
        line = rng.choice(TRAJECTORIES)
        try:
            create = partial(client.create_session, env_id=line["env_id"], config=line["config"])
            session = (await riding(create, "create", tally)).session_id
            for index, (action, expected) in enumerate(line["steps"]):
                await asyncio.sleep(rng.uniform(0.02, 0.12))
                reply = await riding(partial(client.step, session, action, step_index=index), "step", tally)
                tally.steps += 1
                if reply.observation != expected:
                    tally.shaped.append(f"{line['env_id']} step {index}: {reply.observation[:80]!r}")
                    break
            else:
                if not (reply.done and reply.reward == 1.0):
                    tally.shaped.append(f"{line['env_id']}: done={reply.done} reward={reply.reward}")
                else:
                    tally.finished += 1
            await riding(partial(client.close_session, session), "close", tally)
        except Exception as exc:
            tally.lost.append(f"{line['env_id']}: {type(exc).__name__}: {exc}"[:300])


async def episodes_recorded(client: AsyncRuntimeClient) -> int:
    entries = await client.stats(envs_only=True)
    return sum(e.env.episodes for e in entries if e.WhichOneof("entry") == "env")


async def settled_record(client: AsyncRuntimeClient, expected: int, timeout_s: float = 15.0) -> int:
    """The record's episode count once it reaches `expected` (the runtimes flush about every
    second), or what it holds after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        count = await episodes_recorded(client)
        if count >= expected or time.monotonic() > deadline:
            return count
        await asyncio.sleep(0.5)


async def kill_redis_mid_run(up: CodegymServer, redis_pid: int) -> dict[str, Any]:
    client = AsyncRuntimeClient(runtimes(up))
    try:
        # A first wave, recorded before the kill.
        before = Tally()
        await asyncio.gather(*(rollout(client, random.Random(100 + i), before, 1) for i in range(4)))
        assert before.finished == 4, vars(before)
        recorded_before = await settled_record(client, 4)
        # The second wave, with Redis SIGKILLed once a fifth of its steps are acknowledged.
        tally = Tally()
        rng = random.Random(7)
        plays = [
            asyncio.create_task(rollout(client, random.Random(rng.random()), tally, EPISODES_EACH))
            for _ in range(ROLLOUTS)
        ]
        expected_steps = ROLLOUTS * EPISODES_EACH * 10
        while tally.steps < expected_steps // 5 and not all(p.done() for p in plays):
            await asyncio.sleep(0.05)
        in_flight = sum(not p.done() for p in plays)
        steps_at_kill = tally.steps
        os.kill(redis_pid, signal.SIGKILL)
        killed_at = time.monotonic()
        while not REDIS_BACK.search(up.text):
            assert time.monotonic() - killed_at < 30, (
                "codegym up did not restart its redis\n" + up.text[-3000:]
            )
            await asyncio.sleep(0.05)
        back_s = time.monotonic() - killed_at
        recorded_on_restart = await riding(partial(episodes_recorded, client), "stats", Tally())
        await asyncio.gather(*plays)
        recorded_after = await settled_record(client, recorded_before + tally.finished)
        return {
            "tally": tally,
            "in_flight": in_flight,
            "steps_at_kill": steps_at_kill,
            "back_s": back_s,
            "recorded_before": recorded_before,
            "recorded_on_restart": recorded_on_restart,
            "recorded_after": recorded_after,
        }
    finally:
        await client.close()


@pytest.mark.jail
@pytest.mark.slow
def test_killing_ups_own_redis_mid_run_loses_no_episode_and_keeps_the_record(tmp_path: Path) -> None:
    up = start_up(tmp_path)
    try:
        found = REDIS_LINE.search(up.text)
        assert found, up.text
        address, redis_pid = found.group(1), int(found.group(2))
        assert (tmp_path / "lib.redis" / "appendonlydir").is_dir()  # beside the library
        result = asyncio.run(kill_redis_mid_run(up, redis_pid))
        tally: Tally = result["tally"]
        summary = {k: v for k, v in result.items() if k != "tally"} | vars(tally)
        print(f"redis SIGKILLed mid-run: {summary}")
        back = REDIS_BACK.search(up.text)
        assert back and back.group(1) == address and int(back.group(2)) != redis_pid
        assert result["in_flight"] >= ROLLOUTS // 2 and result["steps_at_kill"] > 0, summary
        assert tally.lost == [] and tally.shaped == [], summary
        assert tally.finished == ROLLOUTS * EPISODES_EACH, summary
        # The record kept what it held before the kill, and counts every episode of the second
        # wave, unless a flush fell in the outage: those entries are dropped by design (evidence for
        # a sampler, never worth holding steps for) and the runtime says so in its log.
        assert result["recorded_before"] == 4, summary
        assert result["recorded_on_restart"] >= result["recorded_before"], summary
        complete = result["recorded_after"] == result["recorded_before"] + tally.finished
        assert complete or "entries not written" in up.text, summary
    finally:
        assert up.stop() == 0


@pytest.mark.jail
@pytest.mark.slow
def test_a_second_up_on_the_same_redis_folder_stops_before_starting_anything(tmp_path: Path) -> None:
    up = start_up(tmp_path, "--workers", "1")
    try:
        args = [
            "up",
            "--library",
            str(tmp_path / "lib.db"),
            "--port",
            "0",
            "--runtimes",
            "2",
            "--workers",
            "1",
        ]
        done = subprocess.run(codegym_command(args), capture_output=True, text=True, timeout=60)
        assert done.returncode != 0
        assert f"another codegym up keeps its Redis in {tmp_path / 'lib.redis'}" in done.stderr
        assert "sandbox worker" not in done.stdout + done.stderr  # refused before any server started
    finally:
        assert up.stop() == 0


# --- The supervisor's back-off, on a clock of its own ------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


class FakeServer:
    """A supervised server whose process is alive until `die()`."""

    def __init__(self, name: str = "redis") -> None:
        self.name = name
        self.address = "127.0.0.1:1"
        self.code: int | None = None
        self.proc = SimpleNamespace(poll=lambda: self.code, pid=1)

    def die(self) -> None:
        self.code = -9

    def again(self) -> FakeServer:
        return FakeServer(self.name)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 20.0) -> int | None:
        return self.code


def test_a_server_that_keeps_dying_at_once_backs_off_and_stops_the_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = Clock()
    monkeypatch.setattr(up_command, "time", clock)
    servers: list[Any] = [FakeServer()]
    supervisor = up_command.Supervisor(servers)
    problem = ""
    for _ in range(10):
        servers[0].die()
        clock.now += 1.0  # it lived a second
        problem = supervisor.check()
        if problem:
            break
    assert clock.slept == [0.0, 0.5, 1.0, 2.0, 4.0]
    assert problem.startswith("redis exited with -9 6 times in 60 s")


def test_a_server_killed_after_it_served_is_restarted_at_once_every_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = Clock()
    monkeypatch.setattr(up_command, "time", clock)
    servers: list[Any] = [FakeServer()]
    supervisor = up_command.Supervisor(servers)
    for _ in range(20):  # a kill every 12 s, as the soak's faults come
        clock.now += 12.0
        servers[0].die()
        assert supervisor.check() == ""
    assert clock.slept == [0.0] * 20

"""The soak's stack and the faults it suffers (bench/soak.py).

The stack is `codegym up --runtimes 2 --workers 2 --openenv-port 0` (bench/stacks.py's `up`, as
every bench starts one) over the Redis `up` starts for itself, or over one of the soak's own
given with `--sessions`. Each fault acts on a server by the pid `up` last printed for it, and
waits until `up` says it is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

from bench.common import tree_memory_kb
from bench.stacks import ROOT, Stack, StackSpec, up
from codegym import proctree
from codegym.procs import RedisServer
from codegym_client.channels import TOKEN_ENV
from codegym_testkit.access import printed_access
from sandbox_worker.limits import JAIL_ZYGOTE

FAULTS = ("rolling", "kill", "drain", "freeze", "gateway", "redis")
FREEZE_S = 15.0
SERVERS = ("runtime 1", "runtime 2", "sandbox worker 1", "sandbox worker 2", "openenv gateway")
REDIS_URL = re.compile(r"redis at (redis://\S+) \(pid")


@contextlib.contextmanager
def soak_stack(
    workdir: Path, redis: str = "up", auth: bool = False, more: tuple[str, ...] = ()
) -> Iterator[Stack]:
    """The soak's `codegym up` over its own Redis (`redis="up"`, append-only in workdir/redis) or
    ours (`"given"`, `stack.redis`), once `up` has named every server; all stopped at the end.
    `auth`: `up --auth`, and every path of this process and its trainer processes plays on the
    trainer token `up` printed (`CODEGYM_TOKEN`), as a trainer would. `more`: more `up` options
    (the soak's capture options)."""
    folder = workdir / "redis"
    given: RedisServer | None = None
    up_args: tuple[str, ...] = ("--runtimes", "2", "--redis-dir", str(folder))
    if redis == "given":
        folder.mkdir()
        given = RedisServer(folder=folder)
        up_args = ("--runtimes", "2", "--sessions", given.url)
    if auth:
        up_args += ("--auth",)
    up_args += more
    spec = StackSpec("soak", ROOT, "working tree", workdir / "library.db", workdir / "up.log", up_args)
    stack: Stack | None = None
    try:
        with up(spec, openenv=True, keep=100_000) as stack:
            stack.redis = given
            # `codegym up` names its servers right after its ready line (its Redis before it).
            named = (*SERVERS, "redis") if given is None else SERVERS
            deadline = time.monotonic() + 30
            while len(stack.servers()) < len(named):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"codegym up named only {sorted(stack.servers())}")
                time.sleep(0.1)
            if auth:
                os.environ[TOKEN_ENV] = printed_access(stack.server.text, auth=True).token
            yield stack
    finally:
        current = stack.redis if stack is not None else given  # the redis fault replaces it
        if current is not None:
            current.stop()


def redis_url(stack: Stack) -> str:
    if stack.redis is not None:
        return stack.redis.url
    found = REDIS_URL.search(stack.server.text)
    assert found, "codegym up printed no redis line"
    return found.group(1)


def gateway_url(stack: Stack) -> str:
    """The gateway's WebSocket URL now (a restarted gateway may listen elsewhere)."""
    return f"ws://{stack.servers()['openenv gateway'][0]}/ws"


def memory_mib(stack: Stack) -> dict[str, float]:
    """PSS of each server process (a worker with its jails, without the session processes its
    jails' zygotes forked: those are bounded by the resident budget and reclaimed when idle,
    and one whose release a fault lost lingers until then), and of Redis; and the session
    processes still resident, under "resident sessions" (a count)."""
    links = proctree.children_by_parent()
    out: dict[str, float] = {}
    sessions = 0
    for name, (_, pid) in sorted(stack.servers().items()):
        tree = proctree.descendants([pid], links)
        zygotes = [p for p in tree if JAIL_ZYGOTE in (proctree.cmdline(p) or "")]
        session_pids = [c for z in zygotes for c in links.get(z, [])]
        forked = set(proctree.descendants(session_pids, links))
        sessions += len(session_pids)
        out[name] = sum((proctree.memory_kb(p) or {}).get("Pss", 0) for p in tree if p not in forked) / 1024
    if stack.redis is not None:  # up's own Redis is one of its servers above
        out["redis"] = tree_memory_kb(stack.redis.pid)[1] / 1024
    out["resident sessions"] = float(sessions)
    return out


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
        pid = stack.server_pid(name)
        os.kill(pid, signal.SIGTERM)
        await stack.restarted(name, pid)


async def kill_worker(stack: Stack) -> None:
    pid = stack.server_pid("sandbox worker 1")
    os.kill(pid, signal.SIGKILL)
    await stack.restarted("sandbox worker 1", pid)


async def drain_worker(stack: Stack) -> None:
    pid = stack.server_pid("sandbox worker 2")
    os.kill(pid, signal.SIGTERM)
    await stack.restarted("sandbox worker 2", pid)


async def freeze_worker(stack: Stack) -> None:
    pid = stack.server_pid("sandbox worker 1")
    os.kill(pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(FREEZE_S)
    finally:
        os.kill(pid, signal.SIGCONT)


async def restart_gateway(stack: Stack) -> None:
    pid = stack.server_pid("openenv gateway")
    os.kill(pid, signal.SIGTERM)
    await stack.restarted("openenv gateway", pid)


async def restart_redis(stack: Stack) -> None:
    if stack.redis is not None:
        stack.redis.stop()
        stack.redis = stack.redis.again()
        return
    pid = stack.server_pid("redis")
    os.kill(pid, signal.SIGKILL)
    await stack.restarted("redis", pid)


FAULT_ACTIONS: dict[str, Callable[[Stack], Awaitable[None]]] = {
    "rolling": rolling,
    "kill": kill_worker,
    "drain": drain_worker,
    "freeze": freeze_worker,
    "gateway": restart_gateway,
    "redis": restart_redis,
}

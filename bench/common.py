"""Benchmark helpers: a bare gRPC echo server for the baseline, percentiles, process-tree memory."""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc

ECHO_METHOD = "/bench.Echo/Echo"


async def serve_echo() -> None:
    """A gRPC server whose one method returns its request bytes: the floor any service sits on."""

    async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return request

    handler = grpc.method_handlers_generic_handler(
        "bench.Echo",
        {"Echo": grpc.unary_unary_rpc_method_handler(echo)},
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"listening on 127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()


def start_process(args: list[str]) -> tuple[subprocess.Popen[str], str]:
    """`python ARGS...` once it prints `listening on HOST:PORT`: (its process, that address).

    The shared server lifecycle (`codegym.procs`): the process dies with the benchmark however the
    benchmark ends, and its output keeps being drained so it never blocks on a full pipe. Imported
    here, not at the top: this file also runs as the bare echo server, whose footprint is the floor.
    """
    from codegym.procs import ServerProcess

    server = ServerProcess(
        [sys.executable, *args], name=" ".join(args[:4]), stderr=subprocess.DEVNULL, keep=50
    )
    return server.proc, server.address


def echo_callable(channel: grpc.aio.Channel) -> Callable[[bytes], Awaitable[bytes]]:
    return channel.unary_unary(ECHO_METHOD, request_serializer=None, response_deserializer=None)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def median(values: list[float]) -> float:
    return statistics.median(values)


async def closed_loop(
    call: Callable[[int], Awaitable[object]], concurrency: int, total: int, max_seconds: float
) -> tuple[float, list[float]]:
    """`concurrency` callers issue `total` calls (bounded in count and time); returns calls/s and latencies."""
    latencies: list[float] = []
    counter = iter(range(total))
    stop_at = time.monotonic() + max_seconds

    async def caller() -> None:
        for i in counter:
            if time.monotonic() > stop_at:
                return
            t = time.perf_counter()
            await call(i)
            latencies.append(time.perf_counter() - t)

    started = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(concurrency)))
    return len(latencies) / (time.perf_counter() - started), latencies


def _children() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    return children


def _cpu_ticks(pid: int, reaped: bool) -> int:
    """utime + stime (+ cutime + cstime: children it already reaped) of one process, in clock ticks."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    own = int(fields[11]) + int(fields[12])
    return own + (int(fields[13]) + int(fields[14]) if reaped else 0)


def cpu_by_role(up_pid: int) -> dict[str, float]:
    """CPU seconds so far of `codegym up`'s runtime, its sandbox worker processes, and their jails.

    Jails count every process below a worker (nsjail, zygote, request and resident children,
    reaped ones included through their parent's cutime); workers and the runtime count only their
    own process.
    """
    import os

    tick = os.sysconf("SC_CLK_TCK")
    children = _children()
    roles = {"runtime": 0, "worker": 0, "jail": 0}
    for pid in children.get(up_pid, []):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"runtime" in cmd:
            roles["runtime"] += _cpu_ticks(pid, reaped=False)
        elif b"sandbox" in cmd:
            roles["worker"] += _cpu_ticks(pid, reaped=False)
            stack = list(children.get(pid, []))
            while stack:
                child = stack.pop()
                stack.extend(children.get(child, []))
                roles["jail"] += _cpu_ticks(child, reaped=True)
    return {role: ticks / tick for role, ticks in roles.items()}


def zygote_children_memory_kb() -> tuple[int, float, float]:
    """(count, mean USS, mean PSS) in KiB of the processes the jails' zygotes forked: resident
    sessions plus one spare per jail. USS (private pages) is what each one costs on its own."""
    children = _children()
    zygotes = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if b"/sandbox/zygote.py" in (entry / "cmdline").read_bytes():
                    zygotes.append(int(entry.name))
            except OSError:
                continue
    uss: list[int] = []
    pss: list[int] = []
    for zygote in zygotes:
        for pid in children.get(zygote, []):
            private = proportional = 0
            try:
                for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                    if line.startswith(("Private_Clean:", "Private_Dirty:")):
                        private += int(line.split()[1])
                    elif line.startswith("Pss:"):
                        proportional += int(line.split()[1])
            except OSError:
                continue
            uss.append(private)
            pss.append(proportional)
    if not uss:
        return 0, 0.0, 0.0
    return len(uss), sum(uss) / len(uss), sum(pss) / len(pss)


def tree_memory_kb(root_pid: int) -> tuple[int, int]:
    """(RSS, PSS) in KiB summed over a process and all its descendants; PSS splits shared pages fairly."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    rss = pss = 0
    stack = [root_pid]
    while stack:
        pid = stack.pop()
        stack.extend(children.get(pid, []))
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Rss:"):
                    rss += int(line.split()[1])
                elif line.startswith("Pss:"):
                    pss += int(line.split()[1])
        except OSError:
            continue
    return rss, pss


if __name__ == "__main__":
    asyncio.run(serve_echo())

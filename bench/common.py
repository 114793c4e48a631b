"""Benchmark helpers: a bare gRPC echo server for the baseline, starting a server, percentiles,
timing, progress lines, and the CPU and memory of process trees.

Process trees are read from /proc through `codegym.proctree`, which the tests share; it is imported
inside the functions that use it, not at the top, as `codegym.procs` is: this file also runs as
the bare echo server, whose footprint is the floor.
"""

from __future__ import annotations

import asyncio
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Generator
from typing import TYPE_CHECKING, Any

import grpc

if TYPE_CHECKING:
    from codegym.procs import ServerProcess

Line = dict[str, Any]  # one recorded trajectory: env_id, config, steps = [[action, observation], ...]
Figures = dict[str, Any]  # one measurement's figures, in display units (ms, MiB, KiB), JSON-ready

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


def start_process(args: list[str], **options: Any) -> ServerProcess:
    """`python ARGS...` once it prints `listening on HOST:PORT` (its `address`): the one way the
    benches start a server, `codegym up` included (bench/stacks.py).

    The shared server lifecycle (`codegym.procs`): the process dies with the benchmark however the
    benchmark ends, its output keeps being drained so it never blocks on a full pipe, and `stop`
    ends it by pid. `options` go to `ServerProcess` (by default stderr is dropped and the last 50
    lines of output kept).
    """
    from codegym.procs import ServerProcess

    settings: dict[str, Any] = {"name": " ".join(args[:4]), "stderr": subprocess.DEVNULL, "keep": 50}
    return ServerProcess([sys.executable, *args], **(settings | options))


def progress(message: str) -> None:
    """Progress goes to stderr, so stdout holds only the tables."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def echo_callable(channel: grpc.aio.Channel) -> grpc.aio.UnaryUnaryMultiCallable:
    """The echo method, bytes in and bytes out (called with `timeout=`)."""
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


class CoroutineCpu:
    """Awaits a coroutine, summing the CPU time of this thread spent inside its own frames (`cpu`).

    Every resumption of the coroutine (one `send`/`throw` into it) is timed with thread_time, so
    the work other coroutines do on the event loop while this one waits is not counted.
    """

    __slots__ = ("coro", "cpu")

    def __init__(self, coro: Awaitable[Any]) -> None:
        self.coro = coro
        self.cpu = 0.0

    def __await__(self) -> Generator[Any, Any, Any]:
        inner = self.coro.__await__()
        resume: Callable[[Any], Any] = inner.send
        value: Any = None
        while True:
            started = time.thread_time()
            try:
                yielded = resume(value)
            except StopIteration as done:
                self.cpu += time.thread_time() - started
                return done.value
            except BaseException:
                self.cpu += time.thread_time() - started
                raise
            self.cpu += time.thread_time() - started
            try:
                value = yield yielded
                resume = inner.send
            except GeneratorExit:
                inner.close()
                raise
            except BaseException as exc:  # CancelledError and the like go on into the coroutine
                value, resume = exc, inner.throw


def rusage_cpu_s(who: int = resource.RUSAGE_SELF) -> float:
    """User + system CPU seconds of this process (every thread), or of its reaped children."""
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def tree_cpu_s(root_pids: list[int]) -> float:
    """User + system CPU seconds of processes and all their descendants, reaped children included."""
    from codegym import proctree

    ticks = sum(proctree.cpu_ticks(pid, reaped=True) for pid in proctree.descendants(root_pids))
    return ticks / proctree.CLK_TCK


def cpu_by_role(up_pid: int) -> dict[str, float]:
    """CPU seconds so far of `codegym up`'s runtime, its sandbox worker processes, and their jails.

    Jails count every process below a worker (nsjail, zygote, request and resident children,
    reaped ones included through their parent's cutime); workers and the runtime count only their
    own process.
    """
    from codegym import proctree

    links = proctree.children_by_parent()
    roles = {"runtime": 0, "worker": 0, "jail": 0, "redis": 0}
    for pid in links.get(up_pid, []):
        cmd = proctree.cmdline(pid)
        if cmd is None:
            continue
        if "redis-server" in cmd:  # the sessions' store of `--runtimes N` (N > 1)
            roles["redis"] += proctree.cpu_ticks(pid, reaped=False)
        elif "runtime" in cmd:
            roles["runtime"] += proctree.cpu_ticks(pid, reaped=False)
        elif "sandbox" in cmd:
            roles["worker"] += proctree.cpu_ticks(pid, reaped=False)
            jailed = proctree.descendants(links.get(pid, []), links)
            roles["jail"] += sum(proctree.cpu_ticks(child, reaped=True) for child in jailed)
    return {role: ticks / proctree.CLK_TCK for role, ticks in roles.items()}


def zygote_children_memory_kb() -> tuple[int, float, float]:
    """(count, mean USS, mean PSS) in KiB of the processes the jails' zygotes forked: resident
    sessions plus one spare per jail. USS (private pages) is what each one costs on its own."""
    from codegym import proctree

    links = proctree.children_by_parent()
    zygotes = [pid for pid in proctree.pids() if "/sandbox/zygote.py" in (proctree.cmdline(pid) or "")]
    uss: list[int] = []
    pss: list[int] = []
    for zygote in zygotes:
        for pid in links.get(zygote, []):
            memory = proctree.memory_kb(pid)
            if memory is None:
                continue
            uss.append(memory.get("Private_Clean", 0) + memory.get("Private_Dirty", 0))
            pss.append(memory.get("Pss", 0))
    if not uss:
        return 0, 0.0, 0.0
    return len(uss), sum(uss) / len(uss), sum(pss) / len(pss)


def tree_memory_kb(root_pid: int) -> tuple[int, int]:
    """(RSS, PSS) in KiB summed over a process and all its descendants; PSS splits shared pages fairly."""
    from codegym import proctree

    rss = pss = 0
    for pid in proctree.descendants([root_pid]):
        memory = proctree.memory_kb(pid)
        if memory is not None:
            rss += memory.get("Rss", 0)
            pss += memory.get("Pss", 0)
    return rss, pss


if __name__ == "__main__":
    asyncio.run(serve_echo())

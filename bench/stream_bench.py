"""The runtime → worker hop alone: CPU per operation of a unary `Execute` per operation against the
runtime's `ExecuteStream` (services/worker_stream.py), at a trainer's rate.

One sandbox worker process (`codegym serve sandbox --jails 1`) and, in this process on uvloop as the
runtime runs, a caller that starts operations at a fixed rate (open loop: arrivals do not wait for
answers). Each operation is a step (a ~600-byte state, as the sample environments' are) whose
source the worker has not cached: it answers SOURCE_NEEDED at once, without a jail, so what is
measured is the transport and the servicer, both ends, and nothing of the environment. With
`--concurrency C` the callers send back to back instead (the saturated peak, where operations
queue up and share messages). The modes alternate (unary, stream, unary, stream, ...) so drift on
a shared machine falls on both alike; CPU is this process's (every thread: gRPC's poller too) and
the worker's own (its jails do nothing here), per operation.

    .venv/bin/python bench/stream_bench.py [--rate 256 | --concurrency 32] [--seconds 10] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import median, progress, rusage_cpu_s, start_process  # noqa: E402
from codegym import proctree  # noqa: E402
from codegym.sandbox.v1 import sandbox_service_pb2 as pb  # noqa: E402
from codegym.sandbox.v1 import sandbox_service_pb2_grpc as pb_grpc  # noqa: E402
from codegym_client.channels import aio_channel  # noqa: E402
from services.dispatcher import SANDBOX_SERVICE  # noqa: E402
from services.worker_stream import WorkerStream  # noqa: E402

ACTION = '{"name": "GetElement", "parameters": {"index": 2}}'


def operation(i: int) -> pb.Operation:
    return pb.Operation(
        source=pb.SourceRef(sha256=f"{i:064x}"),
        limits=pb.Limits(wall_ms=5000),
        step=pb.StepOp(state=os.urandom(600), action=ACTION, session_key=f"s{i % 1024}"),
    )


async def offered(
    send: Callable[[pb.Operation], Awaitable[pb.OperationResult]], rate: float, seconds: float
) -> int:
    """Start `rate` operations a second for `seconds`; wait for every answer; the count answered."""
    loop = asyncio.get_running_loop()
    ops = [operation(i) for i in range(int(rate * seconds))]
    tasks: list[asyncio.Task[pb.OperationResult]] = []
    started = loop.time()
    for i, op in enumerate(ops):
        delay = started + i / rate - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(loop.create_task(send(op)))  # type: ignore[arg-type]
    results = await asyncio.gather(*tasks)
    return sum(r.status == pb.STATUS_SOURCE_NEEDED for r in results)


async def back_to_back(
    send: Callable[[pb.Operation], Awaitable[pb.OperationResult]], concurrency: int, seconds: float
) -> int:
    """`concurrency` callers, each sending its next operation as soon as its last is answered,
    for `seconds`; the count answered (the saturated peak, where operations queue up together)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    answered = 0

    async def caller(first: int) -> None:
        nonlocal answered
        i = first
        while loop.time() < end:
            result = await send(operation(i))  # awaited before `answered` is read, not within +=
            answered += result.status == pb.STATUS_SOURCE_NEEDED
            i += concurrency

    await asyncio.gather(*(caller(k) for k in range(concurrency)))
    return answered


async def measure(args: argparse.Namespace) -> dict[str, list[tuple[float, float]]]:
    worker = start_process(["-m", "codegym_cli.cli", "serve", "sandbox", "--port", "0", "--jails", "1"])
    figures: dict[str, list[tuple[float, float]]] = {"unary": [], "stream": []}
    try:
        channel = aio_channel(worker.address, [SANDBOX_SERVICE], retry=False, health_service=SANDBOX_SERVICE)
        stub = pb_grpc.SandboxServiceStub(channel)
        stream = WorkerStream(stub, worker.address)

        async def unary(op: pb.Operation) -> pb.OperationResult:
            return (await stub.Execute(pb.ExecuteRequest(operation=op), timeout=15)).result

        modes = {"unary": unary, "stream": stream.submit}
        for warm in modes.values():  # both paths (connections, caches)
            await offered(warm, args.rate, 1.0)
        for round_ in range(args.rounds):
            for mode, send in modes.items():
                cpu_before, ticks_before = rusage_cpu_s(), proctree.cpu_ticks(worker.pid, reaped=False)
                if args.concurrency:
                    answered = await back_to_back(send, args.concurrency, args.seconds)
                else:
                    answered = await offered(send, args.rate, args.seconds)
                mine = rusage_cpu_s() - cpu_before
                theirs = (proctree.cpu_ticks(worker.pid, reaped=False) - ticks_before) / proctree.CLK_TCK
                figures[mode].append((mine * 1000 / answered, theirs * 1000 / answered))
                progress(
                    f"round {round_ + 1} {mode}: caller {figures[mode][-1][0]:.3f}, worker {figures[mode][-1][1]:.3f} ms/op"
                )
        await stream.close()
        await channel.close()
    finally:
        worker.stop()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rate", type=float, default=256.0, help="operations started per second")
    parser.add_argument(
        "--concurrency",
        type=int,
        default=0,
        help="instead of --rate: this many callers back to back (e.g. 32: the saturated peak)",
    )
    parser.add_argument("--seconds", type=float, default=10.0, help="length of one measurement")
    parser.add_argument("--rounds", type=int, default=3, help="measurements of each mode, alternating")
    args = parser.parse_args()
    try:
        import uvloop

        figures = uvloop.run(measure(args))
    except ImportError:
        figures = asyncio.run(measure(args))
    load = os.getloadavg()[0]
    shape = f"{args.concurrency} back to back" if args.concurrency else f"{args.rate:g}/s"
    print(
        f"\nCPU ms per operation, median of {args.rounds} ({shape} for {args.seconds:g} s; load {load:.1f})"
    )
    print(f"{'mode':8} {'caller':>8} {'worker':>8} {'both':>8}")
    for mode, rows in figures.items():
        caller, worker = median([r[0] for r in rows]), median([r[1] for r in rows])
        print(f"{mode:8} {caller:8.3f} {worker:8.3f} {caller + worker:8.3f}")
    print(f"(ended {time.strftime('%H:%M:%S')}; on a shared machine compare the two rows only)")


if __name__ == "__main__":
    main()

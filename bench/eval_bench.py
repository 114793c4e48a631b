"""Agent-evaluation benchmark: the oracle agent played through `codegym eval`'s loop (1 runtime, 2 workers).

The Evaluator of codegym_jobs/evaluation/evaluator.py runs in-process, as `codegym eval` runs it, against a
zero-latency scripted OpenAI-compatible server (codegym_testkit/fake_llm.py, in a thread of this
process, as the tests run it) that replays the oracle trajectories of codegym/samples/trajectories.jsonl.
Per concurrency level it prints episodes/s, turns/s and wall time, and splits every turn into
  (a) the runtime Step call (AsyncRuntimeClient.step, from call to return),
  (b) the LLM call (LLMGateway.chat; includes the scripted server's own cost, reported apart),
  (c) everything else of the loop: parsing the reply, building messages, bookkeeping
      (the synchronous stretches between those calls, measured per episode task),
with (c) as a share of (a): the target is that the loop adds < 10 % to the runtime's time per
step. The CPU of this process per turn is split the same way (thread CPU time inside each call's
own coroutine frames; the rest of the event-loop thread, the scripted server's threads and the
remaining threads are reported apart), beside the CPU `codegym up` spends per turn.

Beside (a), the runtime's step latency at the same concurrency without the agent loop (the
oracle trajectories replayed straight through AsyncRuntimeClient, the LLM idle) is measured
too: in the eval run (a) also holds the time a step's answer waits for the busy event loop.

Each concurrency level plays the tasks (in a fixed shuffled order, so a capped run is a fair
mix) until all are played or --max-seconds have passed; the episodes still in flight are then
cancelled (their finished turns count in the per-turn figures, not in episodes/s).

    .venv/bin/python bench/eval_bench.py [--tasks 100] [--samples 4] [--concurrency 8 32]
        [--max-seconds 65]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import CoroutineCpu, cpu_by_role, start_process  # noqa: E402
from bench.eval_meter import Meter  # noqa: E402
from bench.eval_tables import Rows, print_table, rows_of  # noqa: E402
from codegym.library.store import Library  # noqa: E402
from codegym_client.async_client import AsyncRuntimeClient  # noqa: E402
from codegym_jobs.evaluation.evaluator import (  # noqa: E402
    EvalTask,
    Evaluator,
    run_episodes,
    tasks_from_library,
)
from codegym_jobs.evaluation.results import summarize  # noqa: E402
from codegym_jobs.oracle import read_trajectories  # noqa: E402
from codegym_testkit.agents import oracle_agent  # noqa: E402
from codegym_testkit.fake_llm import Reply, ScriptedLLM  # noqa: E402
from services.synthesis.llm import LLMGateway, StageParams  # noqa: E402
from services.synthesis.settings import LLMSettings  # noqa: E402

SAMPLES = ROOT / "codegym" / "samples"


def instrument(evaluator: Evaluator, meter: Meter) -> None:
    """Wrap the instances' runtime and gateway calls the agent loop makes with timing wrappers."""

    def timed(what: str, call: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            meter.enter(what)
            started = time.perf_counter()
            coro = CoroutineCpu(call(*args, **kwargs))
            try:
                return await coro
            finally:
                meter.exit(what, time.perf_counter() - started, coro.cpu)

        return wrapper

    runtime: Any = evaluator.runtime
    gateway: Any = evaluator.gateway
    runtime.create_session = timed("create", runtime.create_session)
    runtime.step = timed("step", runtime.step)
    runtime.close_session = timed("close", runtime.close_session)
    gateway.chat = timed("chat", gateway.chat)


class ServerMeter:
    """The scripted LLM server's own cost, measured in its threads (one per connection)."""

    def __init__(self, llm: ScriptedLLM) -> None:
        self.lock = threading.Lock()
        self.reset()
        server: Any = llm.server
        handle = server.finish_request  # runs the handler of one connection in that thread

        def finish_request(request: Any, client_address: Any) -> None:
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                handle(request, client_address)
            finally:
                spent_cpu, spent_wall = time.thread_time() - cpu, time.perf_counter() - wall
                with self.lock:
                    self.connections += 1
                    self.cpu += spent_cpu
                    self.wall += spent_wall

        server.finish_request = finish_request
        agent = llm.script

        def script(body: dict[str, Any]) -> Reply:
            cpu = time.thread_time()
            try:
                return agent(body)
            finally:
                spent = time.thread_time() - cpu
                with self.lock:
                    self.requests += 1
                    self.script_cpu += spent

        llm.script = script
        # The server keeps every request body; over thousands of growing conversations that heap
        # would make the collector's full passes (in every thread of this process) the bench.
        llm.requests = Discard()

    def reset(self) -> None:
        with self.lock:
            self.connections = self.requests = 0
            self.cpu = self.wall = self.script_cpu = 0.0


class Discard(list[dict[str, Any]]):
    def append(self, item: dict[str, Any]) -> None:
        pass


async def replay_steps(
    address: str, trajectories: list[dict[str, Any]], sessions: int, total: int, max_s: float
) -> tuple[float, list[float]]:
    """The runtime alone: `sessions` concurrent oracle episodes replayed straight through the client."""
    latencies: list[float] = []
    cursor = iter(range(10**9))
    stop_at = time.monotonic() + max_s
    async with AsyncRuntimeClient(address, timeout_s=60.0) as client:
        await client.wait_ready()

        async def session_loop() -> None:
            while len(latencies) < total and time.monotonic() < stop_at:
                line = trajectories[next(cursor) % len(trajectories)]
                created = await client.create_session(env_id=line["env_id"], config=line["config"])
                try:
                    for action, _ in line["steps"]:
                        if len(latencies) >= total or time.monotonic() > stop_at:
                            break
                        started = time.perf_counter()
                        await client.step(created.session_id, action)
                        latencies.append(time.perf_counter() - started)
                finally:
                    await client.close_session(created.session_id)

        started = time.perf_counter()
        await asyncio.gather(*(session_loop() for _ in range(sessions)))
        return len(latencies) / (time.perf_counter() - started), latencies


def eval_gateway(base_url: str, concurrency: int) -> tuple[LLMGateway, StageParams]:
    """The LLM gateway and sampling parameters `codegym eval` builds, pointed at the scripted server."""
    settings = LLMSettings(
        base_url=base_url, api_key="x", model="scripted", timeout_s=60.0, max_concurrency=concurrency
    )
    params = StageParams(model="scripted", temperature=1.0, top_p=1.0, max_tokens=1024, samples=1)
    return LLMGateway(settings, cache=None), params


async def play_capped(
    evaluator: Evaluator,
    tasks: list[EvalTask],
    samples: int,
    concurrency: int,
    max_s: float,
    out: Path,
    up_pid: int,
    server: ServerMeter,
) -> dict[str, Any]:
    """The measured phase: the episodes played (capped at `max_s`) with the CPU of every process."""
    server.reset()
    up_before = cpu_by_role(up_pid)
    process_before, thread_before = time.process_time(), time.thread_time()
    started = time.perf_counter()
    capped = False
    try:
        await asyncio.wait_for(run_episodes(evaluator, tasks, samples, out, concurrency), max_s)
    except TimeoutError:
        capped = True
    wall = time.perf_counter() - started
    process_cpu = time.process_time() - process_before
    loop_thread_cpu = time.thread_time() - thread_before
    up_after = cpu_by_role(up_pid)
    return {
        "capped": capped,
        "wall": wall,
        "process_cpu": process_cpu,
        "loop_thread_cpu": loop_thread_cpu,
        "up": {role: up_after[role] - up_before[role] for role in up_after},
    }


def read_records(out: Path, samples: int) -> dict[str, Any]:
    """What the run wrote: its episodes, the attempts that failed outside the agent (runtime,
    endpoint; kept apart from episodes), the end reasons, and the cost of an episode's record."""
    path = out / "episodes.jsonl"
    episodes = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    failed_path = out / "failures.jsonl"
    failures = (
        [json.loads(line) for line in failed_path.read_text().splitlines()] if failed_path.exists() else []
    )
    started = time.thread_time()
    record_bytes = sum(len(json.dumps(e, ensure_ascii=False)) + 1 for e in episodes)
    record_cpu = time.thread_time() - started
    return {
        "episodes": episodes,
        "failures": failures,
        "end_reasons": summarize(path, samples, "scripted")["overall"].get("end_reasons", {})
        if episodes
        else {},
        "record_bytes": record_bytes,
        "record_cpu": record_cpu,
    }


def server_figures(server: ServerMeter) -> dict[str, Any]:
    return {
        "connections": server.connections,
        "requests": server.requests,
        "cpu": server.cpu,
        "wall": server.wall,
        "script_cpu": server.script_cpu,
    }


async def play(
    address: str,
    base_url: str,
    tasks: list[EvalTask],
    samples: int,
    concurrency: int,
    max_s: float,
    out: Path,
    up_pid: int,
    server: ServerMeter,
) -> dict[str, Any]:
    """One `codegym eval` run, in-process and instrumented (capped at `max_s`); its figures."""
    out.mkdir(parents=True)
    gateway, params = eval_gateway(base_url, concurrency)
    meter = Meter()
    try:
        async with AsyncRuntimeClient(address, timeout_s=60.0) as runtime:
            await runtime.wait_ready()
            evaluator = Evaluator(runtime, gateway, params, tool_mode="text")
            instrument(evaluator, meter)
            measured = await play_capped(evaluator, tasks, samples, concurrency, max_s, out, up_pid, server)
    finally:
        await gateway.close()
    return {
        "total": len(tasks) * samples,
        **measured,
        **read_records(out, samples),
        "meter": meter,
        "retries": gateway.usage["agent"].retries,
        "server": server_figures(server),
    }


def build_library(workdir: Path) -> tuple[Path, dict[str, str]]:
    """A library of the sample environments and tasks: (its path, each env's task text)."""
    library = workdir / "library.db"
    with Library(library) as lib:
        lib.import_paths([SAMPLES / "envs", SAMPLES / "tasks.jsonl"])
        task_texts = {r.env_id: r.task_text for r in lib.load_all().values()}
    return library, task_texts


def pick_tasks(library: Path, count: int) -> tuple[list[EvalTask], list[EvalTask]]:
    """(the first `count` tasks in a fixed shuffled order, one task of every environment)."""
    all_tasks = tasks_from_library(library, "text")
    tasks = all_tasks[:count]
    random.Random(0).shuffle(tasks)  # a run cut by --max-seconds still mixes every environment
    warm: dict[str, EvalTask] = {}
    for task in all_tasks:
        warm.setdefault(task.env_id, task)
    return tasks, list(warm.values())


async def warm_up(
    address: str, llm: ScriptedLLM, warm: list[EvalTask], out: Path, up_pid: int, server: ServerMeter
) -> None:
    """Every environment's source cached on both workers; fails unless the oracle solved something."""
    warmed = await play(address, llm.base_url, warm, 1, 8, 60, out, up_pid, server)
    if not warmed["end_reasons"].get("solved"):
        failed: dict[str, Any] = next(
            iter(warmed["failures"] + [e for e in warmed["episodes"] if e["end_reason"] != "solved"]),
            {},
        )
        raise RuntimeError(f"warm-up: the oracle solved nothing; first error: {failed.get('error')}")


async def measure_levels(
    args: argparse.Namespace,
    address: str,
    llm: ScriptedLLM,
    tasks: list[EvalTask],
    trajectories: list[dict[str, Any]],
    workdir: Path,
    up_pid: int,
    server: ServerMeter,
) -> list[tuple[int, Rows]]:
    """Per concurrency level: the runtime alone, then the eval run; the rows of each level."""
    columns: list[tuple[int, Rows]] = []
    for concurrency in args.concurrency:
        baseline = await replay_steps(address, trajectories, concurrency, 2000, 5.0)
        result = await play(
            address,
            llm.base_url,
            tasks,
            args.samples,
            concurrency,
            args.max_seconds,
            workdir / f"c{concurrency}",
            up_pid,
            server,
        )
        columns.append((concurrency, rows_of(result, baseline)))
        print(f"... concurrency {concurrency} done", file=sys.stderr, flush=True)
    return columns


async def measure(args: argparse.Namespace, workdir: Path) -> tuple[int, list[tuple[int, Rows]]]:
    """(tasks played, the rows of every concurrency level): `codegym up` and the scripted server
    started, warmed up, measured, stopped."""
    library, task_texts = build_library(workdir)
    tasks, warm = pick_tasks(library, args.tasks)
    trajectories = [t for t in read_trajectories(Path(args.trajectories)) if t.get("steps")]
    up = start_process(
        ["-m", "codegym_cli.cli", "up", "--library", str(library), "--port", "0", "--workers", "2"]
    )
    address = up.address
    try:
        with ScriptedLLM(oracle_agent(trajectories, task_texts)) as llm:
            # http.server listens with a backlog of 5: more connects at once get refused and
            # retried after a 1 s back-off, which would be the scripted server's doing, not the loop's.
            llm.server.socket.listen(256)
            server = ServerMeter(llm)
            await warm_up(address, llm, warm, workdir / "warm", up.pid, server)
            columns = await measure_levels(args, address, llm, tasks, trajectories, workdir, up.pid, server)
    finally:
        up.stop(timeout_s=30)
    return len(tasks), columns


async def run(args: argparse.Namespace) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="codegym-eval-bench-"))
    try:
        tasks, columns = await measure(args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print_table(args, tasks, columns)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trajectories", default=str(SAMPLES / "trajectories.jsonl"))
    parser.add_argument("--tasks", type=int, default=100, help="task configs of the library played")
    parser.add_argument("--samples", type=int, default=4, help="episodes per task")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 32], help="episodes in flight")
    parser.add_argument("--max-seconds", type=float, default=65.0, help="time cap per concurrency level")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()

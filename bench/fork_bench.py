"""Fork benchmark: forks, checkpoints and restores (docs/fork.md) beside what they stand in for.

Parts (--parts, all by default), each on its own `codegym up` of the working tree (bench/stacks.py),
replaying the recorded oracle trajectories (codegym/samples/trajectories.jsonl) through the
rollout benches' load generator (bench/load.py), so every observation is judged against its
recording:

  mixed       `make bench-rollouts`' steady shape (N rollouts thinking T; 1024:4 by default) with
              R forks/s, R checkpoints/s and R restores/s sent beside it (open loop, each at its
              scheduled time) against a pool of sessions mid-episode: each call's p50/p99 over the
              load's window, the load served (served/offered), and step p50/p99 against the same
              load without the calls, runs alternating off/on (--runs pairs), judged by the
              run-to-run spread (bench/targets.py).
  backtoback  closed loops of C callers, no think: creates/s against forks/s (count 1), with the
              stack's CPU per create, per fork, per fork's first step (cold, from the copied
              state) and per created session's first step, side by side.
  memory      over `codegym up --runtimes 2` (its own Redis): an idle fork's `MEMORY USAGE` less
              its state's bytes, Redis's used_memory added per fork; an episode suspended by
              `checkpoint_session(close=True)`: what of it is left in Redis (its keys; its
              idempotency entry); and in the memory store (this process, tracemalloc) the bytes a
              fork adds beyond its state, made as `Copies._fork` makes it.
  tree        R roots, each forked W ways at step 5 and again W ways at step 10 (W*W*R leaves),
              every leaf played to the end of its recording, no think: makespan and stack CPU
              beside W*W*R straight episodes of the same trajectories (each on a fresh stack).

    .venv/bin/python bench/fork_bench.py [--quick] [--parts mixed,backtoback,memory,tree] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import secrets
import shutil
import signal
import sys
import tempfile
import time
import tracemalloc
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import Figures, Line, closed_loop, cpu_by_role, median, pct, progress  # noqa: E402
from bench.episodes import GrpcEpisode  # noqa: E402
from bench.load import CLIENT_TIMEOUT_S, Load, measure, plan  # noqa: E402
from bench.stacks import Stack, StackSpec, stack_specs, up  # noqa: E402
from bench.tables import print_rows  # noqa: E402
from bench.targets import print_targets, spread_verdicts, verdict  # noqa: E402
from codegym_client.async_client import AsyncRuntimeClient  # noqa: E402
from codegym_client.errors import CodeGymError  # noqa: E402
from codegym_jobs.oracle import read_trajectories  # noqa: E402

PARTS = ("mixed", "backtoback", "memory", "tree")
CALLS = ("fork", "checkpoint", "restore")
KIB = 1024


def ms(values: Sequence[float], q: float) -> float | None:
    return pct(list(values), q) * 1000 if values else None


def reason(exc: Exception) -> str:
    return (exc.reason or exc.code().name) if isinstance(exc, CodeGymError) else type(exc).__name__


async def mid_episode(
    client: AsyncRuntimeClient, lines: Sequence[Line], count: int, rng: random.Random
) -> list[tuple[str, Line, int]]:
    """`count` sessions, each played halfway through its recording (at least a step): (id, line, step)."""
    chosen = [rng.choice(lines) for _ in range(count)]

    async def one(line: Line) -> tuple[str, Line, int]:
        created = await client.create_session(env_id=line["env_id"], config=line["config"])
        at = max(1, len(line["steps"]) // 2)
        for action, _ in line["steps"][:at]:
            await client.step(created.session_id, action)
        return created.session_id, line, at

    return list(await asyncio.gather(*(one(line) for line in chosen)))


# ---------------------------------------------------------------------------------------------
# mixed: the rollout shape with forks, checkpoints and restores beside it.


class SideCalls:
    """Forks, checkpoints and restores at `rate` each per second, each sent at its scheduled time
    (open loop: a slow answer does not slow the schedule), against a pool of sessions mid-episode.
    A fork and a restored session are closed once answered (not timed); blobs are kept (a bound)
    for the restores. Latencies are kept with the time each call was sent."""

    def __init__(self, client: AsyncRuntimeClient, rate: float) -> None:
        self.client = client
        self.rate = rate
        self.sources: list[str] = []
        self.blobs: deque[bytes] = deque(maxlen=64)
        self.sent: dict[str, list[tuple[float, float]]] = {call: [] for call in CALLS}
        self.errors: Counter[str] = Counter()
        self.pending: set[asyncio.Task[Any]] = set()
        self.rng = random.Random(7)

    async def fork(self) -> None:
        (made,) = await self.client.fork_session(self.rng.choice(self.sources))
        self.closing(made.session_id)

    async def checkpoint(self) -> None:
        self.blobs.append(await self.client.checkpoint_session(self.rng.choice(self.sources)))

    async def restore(self) -> None:
        if self.blobs:
            made = await self.client.restore_session(self.rng.choice(self.blobs))
            self.closing(made.session_id)

    def closing(self, session_id: str) -> None:
        task = asyncio.create_task(self.client.close_session(session_id))
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    async def timed(self, call: str, fn: Callable[[], Awaitable[None]]) -> None:
        started = time.monotonic()
        try:
            await fn()
        except Exception as exc:
            self.errors[f"{call}:{reason(exc)}"] += 1
            return
        if call != "restore" or self.blobs:
            self.sent[call].append((started, time.monotonic() - started))

    async def schedule(self, call: str, fn: Callable[[], Awaitable[None]], offset: float) -> None:
        start = time.monotonic() + offset
        for i in range(10**9):
            await asyncio.sleep(max(0.0, start + i / self.rate - time.monotonic()))
            task = asyncio.create_task(self.timed(call, fn))
            self.pending.add(task)
            task.add_done_callback(self.pending.discard)

    async def prepare(self, lines: Sequence[Line], pool: int) -> None:
        """The sessions the calls act on, mid-episode, made before the load starts (the longest
        trajectories left out: playing half of one back to back is load of its own)."""
        short = [line for line in lines if len(line["steps"]) <= 40]
        self.sources = [sid for sid, _, _ in await mid_episode(self.client, short, pool, self.rng)]

    async def run(self) -> None:
        fns = {"fork": self.fork, "checkpoint": self.checkpoint, "restore": self.restore}
        await asyncio.gather(*(self.schedule(c, fns[c], i / (3 * self.rate)) for i, c in enumerate(CALLS)))

    async def stop(self) -> None:
        if self.pending:
            await asyncio.wait(list(self.pending), timeout=30)
        for sid in self.sources:
            with contextlib.suppress(Exception):
                await self.client.close_session(sid)

    def figures(self, start: float, end: float) -> Figures:
        out: Figures = {"call_errors": dict(self.errors)}
        for call, sent in self.sent.items():
            lat = [latency for at, latency in sent if start <= at < end]
            out[f"{call}_n"] = len(lat)
            out[f"{call}_per_s"] = len(lat) / (end - start) if end > start else None
            out[f"{call}_p50_ms"] = ms(lat, 0.5)
            out[f"{call}_p99_ms"] = ms(lat, 0.99)
        return out


async def mixed_run(stack: Stack, lines: Sequence[Line], args: argparse.Namespace, calls: bool) -> Figures:
    async with AsyncRuntimeClient(stack.address, timeout_s=CLIENT_TIMEOUT_S) as client:
        await client.wait_ready(60)
        side = SideCalls(client, args.rate)
        if calls:
            await side.prepare(lines, args.pool)
        beside = asyncio.create_task(side.run()) if calls else None
        try:
            figures = await measure(stack, lines, plan(args, args.n, args.think, args.window_s))
        finally:
            if beside is not None:
                beside.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await beside
                await side.stop()
    if calls:
        figures.update(side.figures(figures["window_start"], figures["window_end"]))
    return figures


def run_mixed(
    spec: StackSpec, lines: list[Line], args: argparse.Namespace
) -> tuple[list[Figures], list[Figures]]:
    rows: list[Figures] = []
    for run in range(args.runs):
        for mode in ("off", "on"):
            progress(f"mixed run {run + 1}/{args.runs}: {args.n}:{args.think:g}, calls {mode}")
            with up(spec) as stack:
                figures = asyncio.run(mixed_run(stack, lines, args, mode == "on"))
            rows.append({"stack": mode, "point": f"run {run + 1}", **figures})
            progress(
                f"  served {figures['served']:.1f}/s ({figures.get('served_pct', 0):.1f} %), step p50 "
                f"{figures['p50_ms']:.1f} p99 {figures['p99_ms']:.1f} ms"
                + "".join(
                    f", {c} p50 {figures[f'{c}_p50_ms'] or 0:.1f} p99 {figures[f'{c}_p99_ms'] or 0:.1f} ms"
                    for c in CALLS
                    if mode == "on"
                )
            )
    header = ["run", "calls", "served/s", "served %", "step p50", "step p99", "stack CPU %", "other CPU %"]
    header += ["errors", "mismatch"]
    header += [f"{c} {q}" for c in CALLS for q in ("/s", "p50", "p99")]
    body = []
    for row in rows:
        cells = [row["point"], row["stack"], f"{row['served']:.0f}", f"{row.get('served_pct') or 0:.1f}"]
        cells += [f"{row['p50_ms']:.1f}", f"{row['p99_ms']:.1f}"]
        cells += [f"{row['stack_cpu_pct']:.0f}", f"{row['other_cpu_pct']:.0f}"]
        cells += [str(row["errors"]), str(row["mismatches"])]
        for c in CALLS:
            got = [row.get(f"{c}_per_s"), row.get(f"{c}_p50_ms"), row.get(f"{c}_p99_ms")]
            cells += ["" if v is None else f"{v:.1f}" for v in got]
        body.append(cells)
    print(
        f"\nmixed: {args.n} rollouts thinking {args.think:g} s, {args.rate:g}/s each of {', '.join(CALLS)} "
        f"beside (on) or not (off); ms over the window ({args.window_s:g} s)"
    )
    print_rows(header, body)
    print("  (CPU %: 100 = one CPU; other: the machine's CPU outside the stack and this generator)")
    on = [r for r in rows if r["stack"] == "on"]
    verdicts = []
    for c in CALLS:
        p50 = [r[f"{c}_p50_ms"] for r in on if r.get(f"{c}_p50_ms") is not None]
        p99 = [r[f"{c}_p99_ms"] for r in on if r.get(f"{c}_p99_ms") is not None]
        if p50:
            verdicts.append(verdict(f"mixed: {c} p50", "<= 5 ms", f"{max(p50):.2f} ms", max(p50) <= 5))
            verdicts.append(verdict(f"mixed: {c} p99", "<= 50 ms", f"{max(p99):.2f} ms", max(p99) <= 50))
        else:
            verdicts.append(verdict(f"mixed: {c}", "answered", "none answered", False))
    served = [r.get("served_pct") or 0.0 for r in on]
    verdicts.append(
        verdict("mixed: load served (calls on)", ">= 97 %", f"{min(served):.1f} %", min(served) >= 97)
    )
    errors = sum(r["errors"] + sum(r.get("call_errors", {}).values()) + r["mismatches"] for r in rows)
    verdicts.append(verdict("mixed: errors and mismatches", "0", str(errors), errors == 0))
    verdicts += [v for v in spread_verdicts(rows, "on", "off", name="mixed") if "p99" in v["target"]]
    verdicts += [
        {**v, "met": None} for v in spread_verdicts(rows, "on", "off", name="mixed") if "p50" in v["target"]
    ]
    return rows, verdicts


# ---------------------------------------------------------------------------------------------
# backtoback: creates/s against forks/s, and the CPU of each.


async def backtoback(stack: Stack, lines: list[Line], args: argparse.Namespace) -> Figures:
    rng = random.Random(args.seed)
    async with AsyncRuntimeClient(stack.address, timeout_s=CLIENT_TIMEOUT_S) as client:
        await client.wait_ready(60)
        sources = await mid_episode(client, lines, 32, rng)
        plays = [rng.choice(lines) for _ in range(args.calls)]
        created: list[tuple[str, Line]] = []
        forked: list[tuple[str, Line, int]] = []

        async def create(i: int) -> None:
            line = plays[i]
            made = await client.create_session(env_id=line["env_id"], config=line["config"])
            created.append((made.session_id, line))

        async def fork(i: int) -> None:
            sid, line, at = sources[i % len(sources)]
            (made,) = await client.fork_session(sid)
            forked.append((made.session_id, line, at))

        async def first_of_fork(i: int) -> None:
            sid, line, at = forked[i]
            await client.step(sid, line["steps"][at][0])

        async def first_of_created(i: int) -> None:
            sid, line = created[i]
            await client.step(sid, line["steps"][0][0])

        out: Figures = {}
        for name, call in (
            ("create", create),
            ("fork", fork),
            ("fork first step", first_of_fork),
            ("created first step", first_of_created),
        ):
            before = sum(cpu_by_role(stack.pid).values())
            rate, lat = await closed_loop(call, args.concurrency, args.calls, args.max_seconds)
            cpu = sum(cpu_by_role(stack.pid).values()) - before
            out[name] = {
                "per_s": rate,
                "p50_ms": ms(lat, 0.5),
                "p99_ms": ms(lat, 0.99),
                "cpu_ms": cpu * 1000 / len(lat) if lat else None,
                "n": len(lat),
            }
            progress(f"backtoback {name}: {rate:.0f}/s, CPU {out[name]['cpu_ms'] or 0:.2f} ms each")
        ids = [sid for sid, _ in created] + [sid for sid, _, _ in forked] + [sid for sid, _, _ in sources]
        await asyncio.gather(*(client.close_session(sid) for sid in ids), return_exceptions=True)
    return out


def run_backtoback(
    spec: StackSpec, lines: list[Line], args: argparse.Namespace
) -> tuple[Figures, list[Figures]]:
    with up(spec) as stack:
        out = asyncio.run(backtoback(stack, lines, args))
    print(f"\nback to back: {args.calls} calls, {args.concurrency} callers, no think; stack CPU per call")
    print_rows(
        ["call", "", "calls/s", "p50 ms", "p99 ms", "CPU ms"],
        [
            [name, "", f"{f['per_s']:.0f}", f"{f['p50_ms']:.2f}", f"{f['p99_ms']:.2f}", f"{f['cpu_ms']:.2f}"]
            for name, f in out.items()
        ],
    )
    ratio = out["fork"]["per_s"] / out["create"]["per_s"]
    out["ratio"] = ratio
    return out, [verdict("back to back: forks/s over creates/s", ">= 3x", f"{ratio:.2f}x", ratio >= 3)]


# ---------------------------------------------------------------------------------------------
# memory: an idle fork in Redis and in the memory store; a suspended episode.


def redis_of(stack: Stack) -> Any:
    import redis as redis_py

    from bench.soak_stack import redis_url

    return redis_py.Redis.from_url(redis_url(stack))


async def memory_redis(stack: Stack, lines: list[Line], args: argparse.Namespace) -> tuple[Figures, bytes]:
    rng = random.Random(args.seed)
    db = redis_of(stack)
    prefix = "codegym:"
    async with AsyncRuntimeClient(stack.runtimes[0], timeout_s=CLIENT_TIMEOUT_S) as client:
        await client.wait_ready(60)
        sources = await mid_episode(client, lines, args.memory_sources, rng)
        db.execute_command("MEMORY", "PURGE")
        used_before = int(db.info("memory")["used_memory"])
        forks: list[str] = []
        for sid, _, _ in sources:
            forks += [f.session_id for f in await client.fork_session(sid, count=4)]
        used_after = int(db.info("memory")["used_memory"])
        beyond: list[float] = []
        states: list[float] = []
        for fid in forks:
            key = f"{prefix}session:{fid}"
            state = db.hget(key, "state") or b""
            usage = db.memory_usage(key, samples=0)
            states.append(len(state))
            beyond.append(usage - len(state))
        state = db.hget(f"{prefix}session:{forks[0]}", "state") or b""
        added = (used_after - used_before - sum(states)) / len(forks)
        # Suspended episodes: checkpoint close=True, then what of each is left.
        suspend = [sid for sid, _, _ in await mid_episode(client, lines, args.memory_sources, rng)]
        answers_before = set(db.scan_iter(f"{prefix}answer:*", count=1000))
        left_keys = 0
        for sid in suspend:
            await client.checkpoint_session(sid, close=True)
        for sid in suspend:
            left_keys += sum(db.exists(f"{prefix}{kind}:{sid}") for kind in ("session", "history", "lock"))
            left_keys += sum(1 for _ in db.scan_iter(f"*{sid}*", count=1000))
        answers = [k for k in db.scan_iter(f"{prefix}answer:*", count=1000) if k not in answers_before]
        answer_usage = [db.memory_usage(k, samples=0) for k in answers]
        await asyncio.gather(*(client.close_session(fid) for fid in forks), return_exceptions=True)
        await asyncio.gather(*(client.close_session(sid) for sid, _, _ in sources), return_exceptions=True)
    return {
        "forks": len(forks),
        "state_p50_b": median(states),
        "beyond_state_p50_b": median(beyond),
        "beyond_state_max_b": max(beyond),
        "used_memory_per_fork_beyond_state_b": added,
        "suspended": len(suspend),
        "suspended_keys_left": left_keys,
        "suspended_new_answer_entries": len(answers),
        "answer_entry_p50_b": median(answer_usage) if answer_usage else None,
    }, state


def memory_store(state: bytes, count: int) -> Figures:
    """Bytes a fork adds to the memory store beyond its state, made as `Copies._fork` makes one
    (a copy of the source's `Session` under a new id, put with `put_new`)."""
    from services.runtime.sessions import InMemorySessionStore, Session

    store = InMemorySessionStore()
    source = Session(
        session_id=secrets.token_hex(16),
        env_id="Sample_0001_I__MaxSubarraySumEnv",
        config_json=json.dumps({"nums": list(range(9))}),
        state=state,
        max_steps=1000,
        step_timeout_ms=10_000,
        seed=1,
        step_index=5,
        reward=0.0,
        sha256="0" * 64,
    )

    async def fork_all() -> None:
        made: list[tuple[Session, list[bytes]]] = []
        for _ in range(count):
            fork = dataclasses.replace(source, session_id=secrets.token_hex(16), tenant="", branch=True)
            fork.touch()
            made.append((fork, []))
        await store.put_new(made)

    asyncio.run(store.put(source))
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    asyncio.run(fork_all())
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    # The fork shares its state's bytes object with its source (as `dataclasses.replace` does).
    return {"forks": count, "per_fork_b": (after - before) / count, "state_b": len(state)}


def run_memory(
    spec: StackSpec, lines: list[Line], args: argparse.Namespace, workdir: Path
) -> tuple[Figures, list[Figures]]:
    redis_spec = dataclasses.replace(spec, up_args=("--runtimes", "2", "--redis-dir", str(workdir / "redis")))
    with up(redis_spec) as stack:
        redis_figures, state = asyncio.run(memory_redis(stack, lines, args))
    store = memory_store(state, args.memory_forks)
    print("\nmemory: an idle fork beyond its state; a suspended episode (checkpoint close=True)")
    r = redis_figures
    print_rows(
        ["where", "", "figure", "bytes"],
        [
            [
                "redis",
                "",
                f"MEMORY USAGE of a fork's hash less its state, p50 ({r['forks']} forks)",
                f"{r['beyond_state_p50_b']:.0f}",
            ],
            ["redis", "", "the same, max", f"{r['beyond_state_max_b']:.0f}"],
            [
                "redis",
                "",
                "used_memory added per fork less its state (index, answer)",
                f"{r['used_memory_per_fork_beyond_state_b']:.0f}",
            ],
            ["redis", "", "a fork's state, p50", f"{r['state_p50_b']:.0f}"],
            [
                "memory store",
                "",
                f"tracemalloc per fork ({store['forks']} forks; state shared)",
                f"{store['per_fork_b']:.0f}",
            ],
            ["redis", "", f"keys left of {r['suspended']} suspended episodes", str(r["suspended_keys_left"])],
            [
                "redis",
                "",
                f"idempotency entries they added (MEMORY USAGE p50 {r['answer_entry_p50_b'] or 0:.0f} B)",
                str(r["suspended_new_answer_entries"]),
            ],
        ],
    )
    verdicts = [
        verdict(
            "memory: idle fork beyond state, redis",
            "<= 4 KiB",
            f"{r['beyond_state_max_b']:.0f} B",
            r["beyond_state_max_b"] <= 4 * KIB,
        ),
        verdict(
            "memory: idle fork beyond state, memory store",
            "<= 4 KiB",
            f"{store['per_fork_b']:.0f} B",
            store["per_fork_b"] <= 4 * KIB,
        ),
        verdict(
            "memory: suspended episode leaves only its entry",
            "0 keys, 1 entry each",
            f"{r['suspended_keys_left']} keys, {r['suspended_new_answer_entries']} entries",
            r["suspended_keys_left"] == 0 and r["suspended_new_answer_entries"] == r["suspended"],
        ),
    ]
    return {"redis": redis_figures, "memory_store": store}, verdicts


# ---------------------------------------------------------------------------------------------
# tree: roots branched twice, played to the end, beside as many straight episodes.


async def tree(stack: Stack, roots: list[Line], args: argparse.Namespace, branched: bool) -> Figures:
    rng = random.Random(args.seed)
    async with AsyncRuntimeClient(stack.address, timeout_s=CLIENT_TIMEOUT_S) as client:
        await client.wait_ready(60)
        load = Load(lambda: GrpcEpisode(client), roots, 0.0, rng, 10**9)
        leaves = args.ways ** len(args.branch_at)
        finished: list[float] = []
        opened: list[str] = []
        points = [0, *args.branch_at]

        def episode(sid: str) -> GrpcEpisode:
            made = GrpcEpisode(client)
            made.session_id = sid
            opened.append(sid)
            return made

        async def grow(who: int, sid: str, line: Line, level: int) -> None:
            """Play from points[level] to the next branch point (then fork), or to the end."""
            steps = line["steps"]
            start = points[level]
            stop = points[level + 1] if level + 1 < len(points) else len(steps)
            ok = await load.play(episode(sid), line, steps[start:stop], [0.0] * (stop - start), who)
            if not ok:
                return
            if level + 1 < len(points):
                forks = await client.fork_session(sid, count=args.ways)
                await client.close_session(sid)
                await asyncio.gather(*(grow(who, f.session_id, line, level + 1) for f in forks))
            else:
                finished.append(time.monotonic())
                await client.close_session(sid)

        async def straight(who: int, line: Line) -> None:
            made = GrpcEpisode(client)
            if await load.create(made, line):
                opened.append(made.session_id)
                steps = line["steps"]
                if await load.play(made, line, steps, [0.0] * len(steps), who):
                    finished.append(time.monotonic())
            await made.close()

        async def root(who: int, line: Line) -> None:
            made = GrpcEpisode(client)
            if await load.create(made, line):
                await grow(who, made.session_id, line, 0)

        before = sum(cpu_by_role(stack.pid).values())
        started = time.monotonic()
        if branched:
            await asyncio.gather(*(root(i, line) for i, line in enumerate(roots)))
        else:
            await asyncio.gather(*(straight(i, line) for i, line in enumerate(roots) for _ in range(leaves)))
        makespan = time.monotonic() - started
        cpu = sum(cpu_by_role(stack.pid).values()) - before
    steps = load.tally.counts["steps"]
    return {
        "episodes": len(roots) * leaves,
        "finished": len(finished),
        "steps": steps,
        "makespan_s": makespan,
        "cpu_s": cpu,
        "cpu_ms_per_step": cpu * 1000 / steps if steps else None,
        "errors": load.tally.errors(),
        "mismatches": load.tally.counts["mismatches"],
        "counts": dict(load.tally.counts),
    }


def run_tree(spec: StackSpec, lines: list[Line], args: argparse.Namespace) -> tuple[Figures, list[Figures]]:
    need = max(args.branch_at) + 2  # a step past the last branch point at least
    long_enough = [line for line in lines if len(line["steps"]) >= need]
    rng = random.Random(args.seed)
    roots = [rng.choice(long_enough) for _ in range(args.roots)]
    out: Figures = {}
    for name, branched in (("straight", False), ("tree", True)):
        progress(f"tree part: {name}")
        with up(spec) as stack:
            out[name] = asyncio.run(tree(stack, roots, args, branched))
        progress(f"  {name}: makespan {out[name]['makespan_s']:.1f} s, CPU {out[name]['cpu_s']:.1f} s")
    leaves = args.roots * args.ways ** len(args.branch_at)
    print(
        f"\ntree: {args.roots} roots forked {args.ways} ways at steps {', '.join(map(str, args.branch_at))} "
        f"({leaves} leaves) beside {leaves} straight episodes; trajectories of >= {need} steps "
        f"({len(long_enough)} of {len(lines)}), no think"
    )
    print_rows(
        [
            "shape",
            "",
            "episodes",
            "finished",
            "steps",
            "makespan s",
            "CPU s",
            "CPU ms/step",
            "errors",
            "mismatch",
        ],
        [
            [
                name,
                "",
                str(f["episodes"]),
                str(f["finished"]),
                str(f["steps"]),
                f"{f['makespan_s']:.1f}",
                f"{f['cpu_s']:.1f}",
                f"{f['cpu_ms_per_step'] or 0:.2f}",
                str(f["errors"]),
                str(f["mismatches"]),
            ]
            for name, f in out.items()
        ],
    )
    t, s = out["tree"], out["straight"]
    verdicts = [
        verdict(
            "tree: leaves played to the end",
            f"{leaves}",
            str(t["finished"]),
            t["finished"] == leaves and not t["errors"] and not t["mismatches"],
        ),
        verdict("tree: makespan / straight", "", f"{t['makespan_s'] / s['makespan_s']:.2f}x", None),
        verdict("tree: CPU / straight", "", f"{t['cpu_s'] / s['cpu_s']:.2f}x", None),
    ]
    return out, verdicts


# ---------------------------------------------------------------------------------------------
# Command line.


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    parser.add_argument("--n", type=int, default=1024, help="mixed: rollouts in flight")
    parser.add_argument("--think", type=float, default=4.0, help="mixed: think time T, s")
    parser.add_argument(
        "--rate", type=float, default=20.0, help="mixed: forks, checkpoints and restores per s, each"
    )
    parser.add_argument("--pool", type=int, default=32, help="mixed: sessions mid-episode the calls act on")
    parser.add_argument("--runs", type=int, default=2, help="mixed: alternating off/on pairs")
    parser.add_argument("--window-s", type=float, default=30.0, help="mixed: measurement window")
    parser.add_argument("--calls", type=int, default=2000, help="backtoback: calls of each kind")
    parser.add_argument("--concurrency", type=int, default=8, help="backtoback: callers")
    parser.add_argument(
        "--memory-sources", type=int, default=64, help="memory: sessions forked 4 ways, suspended"
    )
    parser.add_argument("--memory-forks", type=int, default=10_000, help="memory: forks in the memory store")
    parser.add_argument("--roots", type=int, default=64, help="tree: roots")
    parser.add_argument("--ways", type=int, default=4, help="tree: forks at each branch point")
    parser.add_argument("--branch-at", type=lambda s: [int(x) for x in s.split(",")], default=[5, 10])
    parser.add_argument("--max-seconds", type=float, default=120.0, help="time cap of each measurement")
    parser.add_argument("--max-episodes", type=int, default=50_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--trajectories", type=Path, default=ROOT / "codegym" / "samples" / "trajectories.jsonl"
    )
    parser.add_argument("--json", type=Path, help="also write every figure to this file")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: mixed 256:1 at 5/s each for 10 s, one pair; 200 calls back to back; "
        "16 sources; a tree of 4 roots forked 2 ways twice",
    )
    args = parser.parse_args(argv)
    args.parts = [p for p in args.parts.split(",") if p]
    unknown = set(args.parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown parts: {', '.join(sorted(unknown))}")
    if args.quick:
        args.n, args.think, args.rate, args.window_s, args.runs = 256, 1.0, 5.0, 10.0, 1
        args.calls, args.memory_sources, args.memory_forks = 200, 16, 1000
        args.roots, args.ways, args.max_seconds = 4, 2, 60.0
    # What bench/stacks.py's `stack_specs` reads: the working tree only.
    args.no_base, args.base, args.up_args = True, "HEAD", ""
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    lines = [line for line in read_trajectories(args.trajectories) if line.get("steps")]
    results: Figures = {}
    verdicts: list[Figures] = []
    loads = [os.getloadavg()]
    with contextlib.ExitStack() as cleanup:
        workdir = Path(tempfile.mkdtemp(prefix="codegym-fork-bench-"))
        cleanup.callback(shutil.rmtree, workdir, True)
        (spec,) = stack_specs(args, cleanup, workdir)
        for part in args.parts:
            progress(f"part {part} (load average {os.getloadavg()[0]:.2f})")
            if part == "mixed":
                results[part], found = run_mixed(spec, lines, args)
            elif part == "backtoback":
                results[part], found = run_backtoback(spec, lines, args)
            elif part == "memory":
                results[part], found = run_memory(spec, lines, args, workdir)
            else:
                results[part], found = run_tree(spec, lines, args)
            verdicts += found
            loads.append(os.getloadavg())
    print_targets(verdicts)
    print(
        f"  ({spec.revision}; load average at each part's start and the end: "
        + ", ".join(f"{x[0]:.2f}" for x in loads)
        + f"; {os.cpu_count()} CPUs)"
    )
    if args.json:
        meta = {
            "revision": spec.revision,
            "loadavg": loads,
            "cpus": os.cpu_count(),
            "args": {k: str(v) for k, v in vars(args).items()},
        }
        args.json.write_text(
            json.dumps({"meta": meta, "parts": results, "targets": verdicts}, indent=2, default=str)
        )
        progress(f"figures written to {args.json}")


if __name__ == "__main__":
    main()

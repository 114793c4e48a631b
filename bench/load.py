"""The load generator of the rollout benches: rollouts replaying recorded oracle trajectories with
think time between steps, each observation judged against its recording (bench/judge.py), counting
what happened (`Tally`), and what a window of it measures (`measure` for a steady shape, `burst`
for N episodes created at once): served steps/s, step and create latencies, the stack's CPU by
role and PSS, the generator's own CPU and other work on the machine.

Cheap by design (one task per rollout, one client for all), so thousands of rollouts in flight
cost the machine little beside the stack they load.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import Figures, Line, cpu_by_role, pct, progress, rusage_cpu_s, tree_memory_kb
from bench.episodes import DEFAULT_RETRY_S, EpisodeTransport, GrpcEpisode, Refused, WsEpisode
from bench.judge import Judge
from bench.stacks import Stack
from codegym import proctree
from codegym.server.serving import settle_heap
from codegym_client.async_client import AsyncRuntimeClient
from codegym_client.errors import CodeGymError

CLIENT_TIMEOUT_S = 60.0
SHOWN_PROBLEMS = 5  # mismatches and errors printed one by one; the rest only counted


@dataclass
class Tally:
    """What the rollouts did: `counts` over the whole run, `in_window`, `latencies` (steps) and
    `create_latencies` (creates that succeeded) in the window.

    Keys: steps, episodes, refusals, mismatches, error:<reason>. `stepped` holds the rollouts that
    have done a first step (the warm-up waits for all of them).
    """

    window_start: float = math.inf
    window_end: float = math.inf
    latencies: list[float] = field(default_factory=list)
    # The same latencies split: episodes' first steps (a session new to every worker: cold), and
    # the rest.
    first_latencies: list[float] = field(default_factory=list)
    later_latencies: list[float] = field(default_factory=list)
    create_latencies: list[float] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)
    in_window: Counter[str] = field(default_factory=Counter)
    stepped: set[int] = field(default_factory=set)

    def note(self, what: str) -> None:
        self.counts[what] += 1
        if self.window_start <= time.monotonic() < self.window_end:
            self.in_window[what] += 1

    def step_answered(self, started: float, who: int, first: bool = False) -> None:
        now = time.monotonic()
        self.counts["steps"] += 1
        self.stepped.add(who)
        if self.window_start <= now < self.window_end:
            self.in_window["steps"] += 1
            self.latencies.append(now - started)
            (self.first_latencies if first else self.later_latencies).append(now - started)

    def create_answered(self, started: float) -> None:
        now = time.monotonic()
        if self.window_start <= now < self.window_end:
            self.create_latencies.append(now - started)

    def errors(self) -> int:
        return sum(n for key, n in self.counts.items() if key.startswith("error:"))


class Load:
    """Rollouts on one transport: episodes drawn from `lines`, think times from `rng`."""

    def __init__(
        self,
        new_episode: Callable[[], EpisodeTransport],
        lines: Sequence[Line],
        think_s: float,
        rng: random.Random,
        max_episodes: int,
        staggered: bool = False,
    ) -> None:
        self.new_episode = new_episode
        self.lines = lines
        self.think_s = think_s
        self.rng = rng
        self.max_episodes = max_episodes
        self.staggered = staggered
        self.tally = Tally()

    def thinks(self, count: int) -> list[float]:
        """Think times before each of `count` steps: uniform in [0.5 T, 1.5 T]."""
        t = self.think_s
        return [self.rng.uniform(0.5 * t, 1.5 * t) if t else 0.0 for _ in range(count)]

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`await fn(*args)`, sent again after each capacity refusal (counted), as a trainer would."""
        while True:
            try:
                return await fn(*args)
            except Refused as refused:
                self.tally.note("refusals")
                await asyncio.sleep(refused.delay_s)

    def failed(self, exc: Exception) -> None:
        """An error other than a refusal: counted by reason, the first few shown; the episode ends."""
        reason = (exc.reason or exc.code().name) if isinstance(exc, CodeGymError) else type(exc).__name__
        self.tally.note(f"error:{reason}")
        if self.tally.errors() <= SHOWN_PROBLEMS:
            progress(f"error ({reason}): {str(exc)[:200]}")

    async def create(self, episode: EpisodeTransport, line: Line) -> bool:
        """Open an episode (counted as begun, toward the episode cap, even when it fails)."""
        self.tally.note("episodes")
        started = time.monotonic()
        try:
            await self.call(episode.create, line)
        except Exception as exc:
            self.failed(exc)
            return False
        self.tally.create_answered(started)
        return True

    async def play(
        self, episode: EpisodeTransport, line: Line, steps: list[Any], thinks: list[float], who: int
    ) -> bool:
        """Think, step, judge, for each step; False when the episode ended early (error, mismatch)."""
        judge = Judge(line, steps)
        for index, ((action, _), think) in enumerate(zip(steps, thinks, strict=True)):
            if think:
                await asyncio.sleep(think)
            started = time.monotonic()
            try:
                observation = await self.call(episode.step, action)
            except Exception as exc:
                self.failed(exc)
                return False
            self.tally.step_answered(started, who, first=index == 0)
            if not judge.saw(observation):
                self.mismatch(line, index, observation, judge.expected[index])
                return False
        return True

    def mismatch(self, line: Line, index: int, got: str, expected: str) -> None:
        self.tally.note("mismatches")
        if self.tally.counts["mismatches"] <= SHOWN_PROBLEMS:
            progress(
                f"!!! MISMATCH {line['env_id']} step {index}: got {got[:100]!r}, recorded {expected[:100]!r}"
            )

    async def rollout(self, who: int, offset_s: float) -> None:
        """Episode after episode (until cancelled or the episode cap), starting `offset_s` late."""
        await asyncio.sleep(offset_s)
        first = True
        while self.tally.counts["episodes"] < self.max_episodes:
            line = self.rng.choice(self.lines)
            episode = self.new_episode()
            try:
                steps = line["steps"]
                if first and self.staggered and steps:
                    # The first episode plays a prefix of its recording, of random length: the
                    # rollouts' episodes then end at every phase from the start, as in a steady
                    # run, instead of all together an episode's length after the ramp.
                    steps = steps[: self.rng.randint(1, len(steps))]
                first = False
                ok = await self.create(episode, line) and await self.play(
                    episode, line, steps, self.thinks(len(steps)), who
                )
            finally:
                await episode.close()
            if not ok:  # an error or a mismatch: no tight loop of failing episodes
                await asyncio.sleep(max(DEFAULT_RETRY_S, self.think_s))


def memory_read(pid: int) -> tuple[int, float]:
    """Whole-tree PSS in KiB, and the CPU the read itself cost (taken off the generator's CPU)."""
    started = time.thread_time()
    _, pss = tree_memory_kb(pid)
    return pss, time.thread_time() - started


RoleReader = Callable[[int], dict[str, float]]  # `codegym up`'s pid -> figures by role (e.g. PSS MiB)


def roles_read(read: RoleReader, pid: int) -> tuple[dict[str, float], float]:
    """`read(pid)`, and the CPU the read itself cost (taken off the generator's CPU)."""
    started = time.thread_time()
    figures = read(pid)
    return figures, time.thread_time() - started


def machine_busy_s() -> float:
    """CPU seconds the whole machine has spent busy (every CPU; not idle, not waiting on I/O)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / proctree.CLK_TCK


def other_cpu_pct(machine_s: float, stack_s: float, generator_s: float, seconds: float) -> float:
    """CPU % (100 = one CPU) that the machine spent outside the stack and this load generator over
    `seconds`: other work on the machine competing with the measurement (steal time included)."""
    return 100 * max(0.0, machine_s - stack_s - generator_s) / seconds


def cpu_by_process() -> dict[int, tuple[str, int]]:
    """Every process's command name and CPU so far (utime + stime, clock ticks), kernel threads
    included: read at both ends of a window to name what the "other CPU" went to."""
    found = {}
    for pid in proctree.pids():
        stat = proctree.named_stat(pid)
        if stat:
            name, fields = stat
            found[pid] = (name, int(fields[11]) + int(fields[12]))
    return found


def top_others(
    before: dict[int, tuple[str, int]], after: dict[int, tuple[str, int]], skip: set[int], seconds: float
) -> str:
    """The three command names outside `skip` (the stack, this generator) that took the most CPU
    between two `cpu_by_process` readings, as "name NN %" (100 = one CPU); those under 2 % left out."""
    by_name: Counter[str] = Counter()
    for pid, (name, ticks) in after.items():
        if pid not in skip:
            by_name[name] += ticks - before.get(pid, (name, 0))[1]
    shares = [(name, 100 * ticks / proctree.CLK_TCK / seconds) for name, ticks in by_name.most_common(3)]
    return ", ".join(f"{name} {share:.0f} %" for name, share in shares if share >= 2)


def ms(seconds: list[float], q: float) -> float | None:
    return pct(seconds, q) * 1000 if seconds else None


async def stop_rollouts(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel the rollouts; each closes its session on the way out (bounded wait)."""
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=30)


@dataclass
class Plan:
    """One windowed measurement: N rollouts thinking T, a warm-up, then a window."""

    n: int
    think_s: float
    window_s: float
    max_seconds: float
    max_episodes: int
    seed: int
    transport: str = "grpc"  # or "openenv"
    # How the client sends its steps (AsyncRuntimeClient's step_transport): "stream" or "unary".
    client_steps: str = "stream"
    read_memory: bool = False
    read_roles: RoleReader | None = None  # also read idle and halfway through the window
    min_warmup_s: float = 2.0  # for T = 0: the first steps of a fresh stack are cold
    # Each rollout's first episode cut to a random prefix (`Load.staggered`).
    staggered: bool = False
    # Run beside the window (given the stack and the window's length), its figures added to the
    # window's: a profiler attached to the stack's processes (bench/profile_bench.py).
    during: Callable[[Stack, float], Coroutine[Any, Any, Figures]] | None = None


async def warm_up(tally: Tally, plan: Plan, started: float) -> float:
    """Wait until 1.5 T has passed and every rollout has done its first step (which comes up to
    2.5 T after the start), or until 3 T + 10 s at most, within the measurement's time cap.
    Returns how long it took."""
    earliest = started + max(1.5 * plan.think_s, plan.min_warmup_s if not plan.think_s else 0.0)
    latest = started + max(0.0, min(3 * plan.think_s + 10, plan.max_seconds - plan.window_s))
    while time.monotonic() < latest and not (time.monotonic() >= earliest and len(tally.stepped) >= plan.n):
        await asyncio.sleep(0.1)
    return time.monotonic() - started


async def measure(stack: Stack, lines: Sequence[Line], plan: Plan) -> Figures:
    """Run `plan` against a stack and read its figures; the rollouts are stopped however it ends."""
    rng = random.Random(plan.seed)
    client = AsyncRuntimeClient(stack.address, timeout_s=CLIENT_TIMEOUT_S, step_transport=plan.client_steps)
    async with client:
        await client.wait_ready(60)
        new_episode: Callable[[], EpisodeTransport] = (
            (lambda: WsEpisode(stack.openenv_url))
            if plan.transport == "openenv"
            else (lambda: GrpcEpisode(client))
        )
        load = Load(new_episode, lines, plan.think_s, rng, plan.max_episodes, plan.staggered)
        idle_pss = (await asyncio.to_thread(memory_read, stack.pid))[0] if plan.read_memory else None
        idle_roles = (await asyncio.to_thread(plan.read_roles, stack.pid)) if plan.read_roles else None
        # The generator's own heap (the recordings it replays, thousands of lines for a large
        # library) out of the collector's sight, as a server's: a 60-80 ms pause of the generator
        # would read as every step in flight answering that much later.
        settle_heap()
        started = time.monotonic()
        tasks = [asyncio.create_task(load.rollout(i, rng.uniform(0, plan.think_s))) for i in range(plan.n)]
        try:
            warmup = await warm_up(load.tally, plan, started)
            window_s = max(1.0, min(plan.window_s, plan.max_seconds - warmup))
            beside = asyncio.ensure_future(plan.during(stack, window_s)) if plan.during else None
            figures = await observe(stack, load.tally, window_s, plan.read_memory, plan.read_roles)
            if beside is not None:
                figures.update(await beside)
        finally:
            await stop_rollouts(tasks)
    tally = load.tally
    figures.update(
        n=plan.n,
        think_s=plan.think_s,
        offered=plan.n / plan.think_s if plan.think_s else None,
        warmup_s=round(warmup, 1),
        all_stepped=len(tally.stepped) >= plan.n,
        refusals=tally.counts["refusals"],
        errors=tally.errors(),
        mismatches=tally.counts["mismatches"],
        episodes=tally.counts["episodes"],
        creates_in_window=len(tally.create_latencies),
        create_p50_ms=ms(tally.create_latencies, 0.5),
        create_p99_ms=ms(tally.create_latencies, 0.99),
        # Where the step tail sits: episodes' first steps (cold, new to every worker) and the rest.
        first_steps_in_window=len(tally.first_latencies),
        first_step_p50_ms=ms(tally.first_latencies, 0.5),
        first_step_p99_ms=ms(tally.first_latencies, 0.99),
        later_step_p99_ms=ms(tally.later_latencies, 0.99),
        counts=dict(tally.counts),
        counts_in_window=dict(tally.in_window),
        # The window on the monotonic clock: a load run beside this one (bench/fork_bench.py)
        # counts its own calls over the same seconds.
        window_start=tally.window_start,
        window_end=tally.window_end,
    )
    if idle_roles is not None:
        figures["idle_by_role"] = idle_roles
    if figures["offered"]:
        figures["served_pct"] = 100 * figures["served"] / figures["offered"]
    if idle_pss is not None and figures.get("pss_mib") is not None:
        figures["idle_pss_mib"] = idle_pss / 1024
        figures["kib_per_episode"] = figures["pss_mib"] * 1024 / plan.n
        figures["added_kib_per_episode"] = (figures["pss_mib"] * 1024 - idle_pss) / plan.n
    return figures


async def observe(
    stack: Stack, tally: Tally, window_s: float, read_memory: bool, read_roles: RoleReader | None = None
) -> Figures:
    """The window: steps answered in it, the stack's CPU over it, its PSS (and `read_roles`) read
    halfway through."""
    cpu_before, gen_before, machine_before = cpu_by_role(stack.pid), rusage_cpu_s(), machine_busy_s()
    processes_before = cpu_by_process()
    tally.window_start = time.monotonic()
    tally.window_end = tally.window_start + window_s
    pss_kb, read_cpu, by_role = None, 0.0, None
    if read_memory or read_roles:
        await asyncio.sleep(window_s / 2)
    if read_memory:
        pss_kb, read_cpu = await asyncio.to_thread(memory_read, stack.pid)
    if read_roles:
        by_role, roles_cpu = await asyncio.to_thread(roles_read, read_roles, stack.pid)
        read_cpu += roles_cpu
    await asyncio.sleep(max(0.0, tally.window_end - time.monotonic()))
    cpu_after, gen_after, machine_after = cpu_by_role(stack.pid), rusage_cpu_s(), machine_busy_s()
    stack_pids = {os.getpid(), *proctree.descendants([stack.pid])}
    others = top_others(processes_before, cpu_by_process(), stack_pids, window_s)
    steps = tally.in_window["steps"]
    cpu = {role: cpu_after[role] - cpu_before[role] for role in cpu_after}
    stack_cpu = sum(cpu.values())
    other = other_cpu_pct(machine_after - machine_before, stack_cpu, gen_after - gen_before, window_s)
    return {
        "window_s": round(window_s, 1),
        "steps_in_window": steps,
        "served": steps / window_s,
        "p50_ms": ms(tally.latencies, 0.5),
        "p99_ms": ms(tally.latencies, 0.99),
        "cpu_ms_per_step": stack_cpu * 1000 / steps if steps else None,
        "cpu_s_by_role": {role: round(s, 2) for role, s in cpu.items()},
        # Each process's share of a step: runtime_ms_per_step, worker_..., jail_..., redis_...
        **{f"{role}_ms_per_step": s * 1000 / steps if steps else None for role, s in cpu.items()},
        "stack_cpu_pct": 100 * stack_cpu / window_s,
        "gen_cpu_pct": 100 * (gen_after - gen_before - read_cpu) / window_s,
        # The load generator's CPU per step: its client's share of a step (and the rollouts' own work).
        "gen_ms_per_step": (gen_after - gen_before - read_cpu) * 1000 / steps if steps else None,
        "other_cpu_pct": other,
        "other_top": others,
        "pss_mib": pss_kb / 1024 if pss_kb is not None else None,
        **({"by_role": by_role} if by_role is not None else {}),
    }


BurstPlan = tuple[Line, list[Any], list[float]]  # an episode: its line, the steps it plays, thinks


def burst_plans(
    lines: Sequence[Line], args: argparse.Namespace, rng: random.Random, load: Load
) -> tuple[list[BurstPlan], str]:
    """`burst_n` episodes, each a line drawn among those with `burst_steps` steps; and a note."""
    long_enough = [line for line in lines if len(line["steps"]) >= args.burst_steps]
    note = f"trajectories with >= {args.burst_steps} steps only ({len(long_enough)} of {len(lines)})"
    if not long_enough:
        long_enough = sorted(lines, key=lambda line: len(line["steps"]))[-10:]
        note = f"no trajectory has {args.burst_steps} steps: the 10 longest, played to their end"
    plans = []
    for _ in range(args.burst_n):
        line = rng.choice(long_enough)
        steps = line["steps"][: args.burst_steps]
        plans.append((line, steps, load.thinks(len(steps))))
    return plans, note


PlansOf = Callable[[Sequence[Line], argparse.Namespace, random.Random, Load], tuple[list[BurstPlan], str]]


async def burst(
    stack: Stack, lines: Sequence[Line], args: argparse.Namespace, plans_of: PlansOf = burst_plans
) -> Figures:
    """N creates at once (the episodes `plans_of` draws), then every episode plays its steps
    (`burst_steps`) thinking T before each."""
    rng = random.Random(args.seed)
    transport = getattr(args, "client_steps", ["stream"])[0]
    async with AsyncRuntimeClient(
        stack.address, timeout_s=CLIENT_TIMEOUT_S, step_transport=transport
    ) as client:
        await client.wait_ready(60)
        load = Load(lambda: GrpcEpisode(client), lines, args.burst_think, rng, args.burst_n)
        plans, note = plans_of(lines, args, rng, load)
        ideal = max(sum(thinks) for _, _, thinks in plans)
        episodes = [GrpcEpisode(client) for _ in plans]
        settle_heap()  # as in `measure`
        cpu_before, gen_before = sum(cpu_by_role(stack.pid).values()), rusage_cpu_s()
        machine_before = machine_busy_s()
        started = load.tally.window_start = time.monotonic()
        create_lat: list[float] = []
        finished: list[float] = []

        async def create(episode: GrpcEpisode, line: Line) -> bool:
            t = time.monotonic()
            ok = await load.create(episode, line)
            create_lat.append(time.monotonic() - t)
            return ok

        async def play(who: int, episode: GrpcEpisode, item: BurstPlan) -> None:
            await load.play(episode, item[0], item[1], item[2], who)
            finished.append(time.monotonic())

        try:
            created = await asyncio.wait_for(
                asyncio.gather(*(create(e, p[0]) for e, p in zip(episodes, plans, strict=True))),
                args.max_seconds,
            )
            all_created_s = time.monotonic() - started
            players = [
                play(i, e, p) for i, (e, p, ok) in enumerate(zip(episodes, plans, created, strict=True)) if ok
            ]
            await asyncio.wait_for(asyncio.gather(*players), max(1.0, args.max_seconds - all_created_s))
            makespan = max(finished) - started if finished else None
            cpu = sum(cpu_by_role(stack.pid).values()) - cpu_before
            machine, gen = machine_busy_s() - machine_before, rusage_cpu_s() - gen_before
            other = other_cpu_pct(machine, cpu, gen, time.monotonic() - started)
        finally:
            await asyncio.wait_for(asyncio.gather(*(e.close() for e in episodes)), 60)
    tally = load.tally
    steps = tally.counts["steps"]
    return {
        "n": len(plans),
        "steps_each": args.burst_steps,
        "think_s": args.burst_think,
        "note": note,
        "all_created_s": all_created_s,
        "create_p50_ms": ms(create_lat, 0.5),
        "create_p99_ms": ms(create_lat, 0.99),
        "makespan_s": makespan,
        "ideal_s": ideal,
        "makespan_ratio": makespan / ideal if makespan else None,
        "p50_ms": ms(tally.latencies, 0.5),
        "p99_ms": ms(tally.latencies, 0.99),
        "steps": steps,
        "cpu_ms_per_step": cpu * 1000 / steps if steps else None,
        "other_cpu_pct": other,
        "refusals": tally.counts["refusals"],
        "errors": tally.errors(),
        "mismatches": tally.counts["mismatches"],
        "counts": dict(tally.counts),
    }


def plan(args: argparse.Namespace, n: int, think_s: float, window_s: float, **extra: Any) -> Plan:
    return Plan(n, think_s, window_s, args.max_seconds, args.max_episodes, args.seed, **extra)

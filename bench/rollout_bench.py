"""Rollout benchmark: the service under a trainer's shape of load, a base commit beside the working tree.

A trainer does not step back to back: each rollout waits for its model between steps (the think
time), so thousands of episodes are in flight while few steps are. Here a rollout replays recorded
oracle trajectories (codegym/samples/trajectories.jsonl, lines with steps): create a session, then for
each recorded step think a time drawn uniformly in [0.5 T, 1.5 T], send the action and compare the
observation with the recording, then close the session and start the next episode. Step latency is
the step call alone (capacity refusals resent after their `retry_after_s` included), never the
think time. Shapes (--shapes, all by default):

  steady      N rollouts, think T, started at random offsets within the first T s; after a warm-up
              (1.5 T and every rollout's first step), a window: offered (N/T) against served
              steps/s, step p50/p99, stack CPU per step, whole-stack PSS per episode in flight
              (KiB/episode; +KiB/episode: the PSS added over the idle stack's, per episode).
  burst       N episodes created at once, then each plays 20 steps with think T; makespan against
              the ideal (the longest episode's summed think time, drawn up front).
  overload    the back-to-back peak (32 sessions, no think), then 256 rollouts thinking so that
              they offer twice that peak: served against the peak, refusals, p50/p99.
  backtoback  32 sessions and 1 session with no think: steps/s and p50, a regression check.
  openenv     the steady shape through the OpenEnv gateway, one WebSocket per episode as OpenEnv's
              EnvClient opens them.

Every measurement starts its own `codegym up` (2 sandbox workers, 1 runtime, 127.0.0.1 only) and
stops it by pid when done, for the working tree ("new") and for a base commit ("base", checked out
with `git worktree add --detach` into a temp dir and run from there, its modules first on
PYTHONPATH), one stack after the other on the same load. Figures of a 2-core machine: the load
generator shares it with the stack (its own CPU is in the tables).

    .venv/bin/python bench/rollout_bench.py [--quick] [--shapes steady,burst] [--base REV | --no-base]
        [--steady 256:1,1024:4,4096:16] [--window-s 30] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import cpu_by_role, median, pct, rusage_cpu_s, tree_memory_kb  # noqa: E402
from codegym import proctree  # noqa: E402
from codegym.procs import ServerProcess  # noqa: E402
from codegym_cli.oracle import read_trajectories  # noqa: E402
from codegym_client.async_client import AsyncRuntimeClient  # noqa: E402
from codegym_client.errors import CapacityExceeded, CodeGymError  # noqa: E402

Line = dict[str, Any]  # one recorded trajectory: env_id, config, steps = [[action, observation], ...]
Figures = dict[str, Any]  # one measurement's figures, in display units (ms, MiB, KiB), JSON-ready

SHAPES = ("steady", "burst", "overload", "backtoback", "openenv")
DEFAULT_RETRY_S = 0.05  # a refusal that came without a retry-after hint
CLIENT_TIMEOUT_S = 60.0
GATEWAY_LINE = re.compile(r"openenv gateway at (\S+:\d+)")
SHOWN_PROBLEMS = 5  # mismatches and errors printed one by one; the rest only counted


def progress(message: str) -> None:
    """Progress goes to stderr, so stdout holds only the tables."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# The stacks: a base commit in a worktree, the working tree, and one `codegym up` of either.


@dataclass
class StackSpec:
    """Which code a stack runs: `tree` (a checkout) first on PYTHONPATH, from `tree` as cwd."""

    name: str  # "base" or "new"
    tree: Path
    revision: str  # what the tables say it is
    library: Path  # built by the stack's first `codegym up`, from its own sample environments
    log: Path  # the servers' stderr (their logs), for a post-mortem
    up_args: tuple[str, ...] = ()  # more `codegym up` options for this stack (--up-args)

    @property
    def env(self) -> dict[str, str]:
        # The venv holds editable installs of the working tree; PYTHONPATH comes before them (the
        # editable finder is appended to sys.meta_path), so the tree's modules are imported.
        return dict(os.environ, PYTHONPATH=f"{self.tree}:{self.tree / 'clients'}")


@dataclass
class Stack:
    """A running `codegym up`: its process (CPU and memory are read from its tree) and addresses."""

    server: ServerProcess
    address: str
    openenv_url: str = ""

    @property
    def pid(self) -> int:
        return self.server.pid


def git(*args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(ROOT), *args], check=True, capture_output=True, text=True
    ).stdout.strip()


def check_imports(spec: StackSpec) -> None:
    """Fail unless `python` under the stack's env imports the servers and the client from its tree.

    The editable installs of the venv point at the working tree: a base that silently imported them
    would measure the new code twice.
    """
    modules = ("codegym", "codegym_cli", "codegym_client", "sandbox_worker", "services")
    code = f"import {', '.join(modules)}; " + "; ".join(f"print({m}.__file__)" for m in modules)
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=spec.tree, env=spec.env, capture_output=True, text=True, check=True
    ).stdout.split()
    stray = [path for path in out if not Path(path).resolve().is_relative_to(spec.tree.resolve())]
    if stray or len(out) != len(modules):
        raise RuntimeError(f"{spec.name} stack imports modules from outside {spec.tree}: {stray or out}")
    progress(f"{spec.name}: python under its env imports {', '.join(modules)} from {spec.tree}")


@contextlib.contextmanager
def base_worktree(rev: str) -> Iterator[Path]:
    """REV checked out (`git worktree add --detach`) in a temp dir, removed however the bench ends.

    The temp dir is made traversable by others: the jails run as other uids and mount
    the jail's package (codegym/inside) from the imported package's path.
    """
    folder = Path(tempfile.mkdtemp(prefix="codegym-rollout-base-"))
    folder.chmod(0o755)
    tree = folder / "tree"
    try:
        git("worktree", "add", "--detach", "--quiet", str(tree), rev)
        yield tree
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            git("worktree", "remove", "--force", str(tree))
        shutil.rmtree(folder, ignore_errors=True)
        with contextlib.suppress(subprocess.CalledProcessError):
            git("worktree", "prune")


def stack_specs(args: argparse.Namespace, cleanup: contextlib.ExitStack, workdir: Path) -> list[StackSpec]:
    """The stacks to measure, base first: ("base" unless --no-base, "new")."""
    head = git("rev-parse", "--short", "HEAD")
    dirty = " + uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else ""
    specs = []
    if not args.no_base:
        tree = cleanup.enter_context(base_worktree(args.base))
        base_rev = git("rev-parse", "--short", args.base)
        specs.append(StackSpec("base", tree, base_rev, workdir / "base.db", workdir / "base.log"))
    up_args = tuple(args.up_args.split())
    revision = f"{head}{dirty}" + (f" {args.up_args}" if up_args else "")
    specs.append(StackSpec("new", ROOT, revision, workdir / "new.db", workdir / "new.log", up_args))
    for spec in specs:
        check_imports(spec)
    return specs


def tree_pids(root: int) -> set[int]:
    """A process and its descendants now."""
    return set(proctree.descendants([root]))


def alive(pid: int) -> bool:
    fields = proctree.stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def make_sure_gone(pids: set[int], name: str) -> None:
    """Every process of a stopped stack must be gone: wait a little, then SIGKILL stragglers by pid."""
    deadline = time.monotonic() + 15
    while (left := {p for p in pids if alive(p)}) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left:
        progress(f"!!! {name}: pid {pid} outlived its stack; SIGKILL")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def gateway_address(server: ServerProcess, timeout_s: float = 30.0) -> str:
    """The OpenEnv gateway's address, from `codegym up`'s line after its ready line."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in server.output:
            match = GATEWAY_LINE.search(line)
            if match:
                return match.group(1)
        if server.proc.poll() is not None:
            break
        time.sleep(0.1)
    raise RuntimeError(f"no OpenEnv gateway line from {server.name}:\n{server.text[-2000:]}")


@contextlib.contextmanager
def up(spec: StackSpec, *, openenv: bool = False) -> Iterator[Stack]:
    """`codegym up` of a stack (2 workers, 1 runtime, loopback), stopped by pid when the block ends."""
    argv = [sys.executable, "-m", "codegym_cli.cli", "up", "--library", str(spec.library),
            "--host", "127.0.0.1", "--port", "0", "--workers", "2"]  # fmt: skip
    if openenv:
        argv += ["--openenv-port", "0"]
    argv += spec.up_args
    with open(spec.log, "ab") as log:
        server = ServerProcess(
            argv, name=f"codegym up ({spec.name})", env=spec.env, cwd=spec.tree,
            stderr=log.fileno(), keep=200, timeout_s=180,
        )  # fmt: skip
        pids = tree_pids(server.pid)
        try:
            url = f"ws://{gateway_address(server)}/ws" if openenv else ""
            yield Stack(server, server.address, url)
        finally:
            pids |= tree_pids(server.pid)  # the jails' children forked during the run too
            server.stop()
            make_sure_gone(pids, server.name)


# ---------------------------------------------------------------------------------------------
# Episodes: the same rollout over gRPC or over the OpenEnv gateway.


class Refused(Exception):
    """The server said "not now" (CAPACITY): send the same call again after `delay_s`."""

    def __init__(self, delay_s: float | None) -> None:
        super().__init__("capacity")
        self.delay_s = delay_s or DEFAULT_RETRY_S


class Failed(Exception):
    """The server refused for good (an OpenEnv error frame): the episode ends."""


class Episode(Protocol):
    """One episode on one transport; `create` and `step` raise Refused to be sent again."""

    async def create(self, line: Line) -> None: ...
    async def step(self, action: str) -> str: ...
    async def close(self) -> None: ...


class GrpcEpisode:
    """A session through the runtime's gRPC API (AsyncRuntimeClient), as the trainer adapters open them."""

    def __init__(self, client: AsyncRuntimeClient) -> None:
        self.client = client
        self.session_id = ""

    async def create(self, line: Line) -> None:
        try:
            created = await self.client.create_session(env_id=line["env_id"], config=line["config"])
        except CapacityExceeded as exc:
            raise Refused(exc.retry_after_s) from None
        self.session_id = created.session_id

    async def step(self, action: str) -> str:
        try:
            response = await self.client.step(self.session_id, action)
        except CapacityExceeded as exc:
            raise Refused(exc.retry_after_s) from None
        observation: str = response.observation
        return observation

    async def close(self) -> None:
        if self.session_id:
            with contextlib.suppress(Exception):
                await self.client.close_session(self.session_id)
            self.session_id = ""


class WsEpisode:
    """An episode as OpenEnv's EnvClient plays it: its own WebSocket (connect options as EnvClient's
    defaults), `reset` naming the task, `call_tool` steps, `close`."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.ws: Any = None

    async def create(self, line: Line) -> None:
        if self.ws is None:
            from websockets.asyncio.client import connect

            self.ws = await connect(
                self.url, open_timeout=30, max_size=None, ping_interval=20, ping_timeout=20
            )
        ability = f"codegym_v1@{line['env_id']}@{json.dumps(line['config'])}"
        await self._ask("reset", {"ability": ability})

    async def step(self, action: str) -> str:
        parsed = json.loads(action)
        call = {"type": "call_tool", "tool_name": parsed["name"], "arguments": parsed["parameters"]}
        data = await self._ask("step", call)
        result: str = data["observation"]["result"]
        return result

    async def _ask(self, kind: str, data: dict[str, Any]) -> dict[str, Any]:
        await self.ws.send(json.dumps({"type": kind, "data": data}))
        answer = json.loads(await self.ws.recv())
        if answer.get("type") == "error":
            error = answer.get("data") or {}
            if error.get("code") == "CAPACITY_REACHED":
                raise Refused(None)
            raise Failed(f"{error.get('code')}: {error.get('message')}")
        reply: dict[str, Any] = answer["data"]
        return reply

    async def close(self) -> None:
        if self.ws is not None:
            with contextlib.suppress(Exception):
                await self.ws.send(json.dumps({"type": "close"}))
                await self.ws.close()
            self.ws = None


# ---------------------------------------------------------------------------------------------
# The load generator: cheap (one task per rollout, one client), counting what happened.


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
    create_latencies: list[float] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)
    in_window: Counter[str] = field(default_factory=Counter)
    stepped: set[int] = field(default_factory=set)

    def note(self, what: str) -> None:
        self.counts[what] += 1
        if self.window_start <= time.monotonic() < self.window_end:
            self.in_window[what] += 1

    def step_answered(self, started: float, who: int) -> None:
        now = time.monotonic()
        self.counts["steps"] += 1
        self.stepped.add(who)
        if self.window_start <= now < self.window_end:
            self.in_window["steps"] += 1
            self.latencies.append(now - started)

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
        new_episode: Callable[[], Episode],
        lines: Sequence[Line],
        think_s: float,
        rng: random.Random,
        max_episodes: int,
    ) -> None:
        self.new_episode = new_episode
        self.lines = lines
        self.think_s = think_s
        self.rng = rng
        self.max_episodes = max_episodes
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

    async def create(self, episode: Episode, line: Line) -> bool:
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
        self, episode: Episode, line: Line, steps: list[Any], thinks: list[float], who: int
    ) -> bool:
        """Think, step, compare, for each step; False when the episode ended early (error, mismatch)."""
        for index, ((action, expected), think) in enumerate(zip(steps, thinks, strict=True)):
            if think:
                await asyncio.sleep(think)
            started = time.monotonic()
            try:
                observation = await self.call(episode.step, action)
            except Exception as exc:
                self.failed(exc)
                return False
            self.tally.step_answered(started, who)
            if observation != expected:
                self.mismatch(line, index, observation, expected)
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
        while self.tally.counts["episodes"] < self.max_episodes:
            line = self.rng.choice(self.lines)
            episode = self.new_episode()
            try:
                steps = line["steps"]
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
    read_memory: bool = False
    read_roles: RoleReader | None = None  # also read idle and halfway through the window
    min_warmup_s: float = 2.0  # for T = 0: the first steps of a fresh stack are cold


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
    async with AsyncRuntimeClient(stack.address, timeout_s=CLIENT_TIMEOUT_S) as client:
        await client.wait_ready(60)
        if plan.transport == "openenv":
            load = Load(lambda: WsEpisode(stack.openenv_url), lines, plan.think_s, rng, plan.max_episodes)
        else:
            load = Load(lambda: GrpcEpisode(client), lines, plan.think_s, rng, plan.max_episodes)
        idle_pss = (await asyncio.to_thread(memory_read, stack.pid))[0] if plan.read_memory else None
        idle_roles = (await asyncio.to_thread(plan.read_roles, stack.pid)) if plan.read_roles else None
        started = time.monotonic()
        tasks = [asyncio.create_task(load.rollout(i, rng.uniform(0, plan.think_s))) for i in range(plan.n)]
        try:
            warmup = await warm_up(load.tally, plan, started)
            window_s = max(1.0, min(plan.window_s, plan.max_seconds - warmup))
            figures = await observe(stack, load.tally, window_s, plan.read_memory, plan.read_roles)
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
        counts=dict(tally.counts),
        counts_in_window=dict(tally.in_window),
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
        "stack_cpu_pct": 100 * stack_cpu / window_s,
        "gen_cpu_pct": 100 * (gen_after - gen_before - read_cpu) / window_s,
        "other_cpu_pct": other,
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
    async with AsyncRuntimeClient(stack.address, timeout_s=CLIENT_TIMEOUT_S) as client:
        await client.wait_ready(60)
        load = Load(lambda: GrpcEpisode(client), lines, args.burst_think, rng, args.burst_n)
        plans, note = plans_of(lines, args, rng, load)
        ideal = max(sum(thinks) for _, _, thinks in plans)
        episodes = [GrpcEpisode(client) for _ in plans]
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


# ---------------------------------------------------------------------------------------------
# The shapes: each measurement on a fresh stack, base then new, never both at once.


def plan(args: argparse.Namespace, n: int, think_s: float, window_s: float, **extra: Any) -> Plan:
    return Plan(n, think_s, window_s, args.max_seconds, args.max_episodes, args.seed, **extra)


def on_each_stack(specs: list[StackSpec], label: str, run: Callable[[StackSpec], Figures]) -> list[Figures]:
    """`run` for each stack in turn; a stack that fails gets a row saying why, the others go on."""
    rows = []
    for spec in specs:
        progress(f"{label} on {spec.name} ({spec.revision})")
        try:
            figures = run(spec)
        except Exception as exc:
            progress(f"!!! {label} on {spec.name} failed: {exc}")
            figures = {"failed": f"{type(exc).__name__}: {str(exc)[:300]}"}
        rows.append({"stack": spec.name, "point": label, **figures})
        summary = ", ".join(
            f"{k} {figures[k]:.1f}" for k in ("served", "p50_ms", "p99_ms") if figures.get(k) is not None
        )
        progress(f"{label} on {spec.name}: {summary or figures.get('failed', '')}")
    return rows


def run_steady(specs: list[StackSpec], lines: list[Line], args: argparse.Namespace) -> list[Figures]:
    rows = []
    for n, think in args.steady:

        def one(spec: StackSpec, n: int = n, think: float = think) -> Figures:
            with up(spec) as stack:
                return asyncio.run(
                    measure(stack, lines, plan(args, n, think, args.window_s, read_memory=True))
                )

        rows += on_each_stack(specs, f"{n}:{think:g}", one)
    return rows


def run_burst(specs: list[StackSpec], lines: list[Line], args: argparse.Namespace) -> list[Figures]:
    def one(spec: StackSpec) -> Figures:
        with up(spec) as stack:
            return asyncio.run(burst(stack, lines, args))

    return on_each_stack(specs, f"{args.burst_n} x {args.burst_steps}", one)


def run_overload(specs: list[StackSpec], lines: list[Line], args: argparse.Namespace) -> list[Figures]:
    def one(spec: StackSpec) -> Figures:
        with up(spec) as stack:
            peak = asyncio.run(measure(stack, lines, plan(args, args.peak_sessions, 0.0, args.peak_s)))
            if not peak["served"]:
                raise RuntimeError("no step served back to back: no peak to overload")
            think = args.overload_n / (2 * peak["served"])
            progress(f"peak {peak['served']:.0f} steps/s: {args.overload_n} rollouts thinking {think:.3f} s")
            over = asyncio.run(measure(stack, lines, plan(args, args.overload_n, think, args.window_s)))
        return {
            **over,
            "peak": peak["served"],
            "think_ms": think * 1000,
            "served_of_peak": over["served"] / peak["served"],
            "peak_figures": peak,
        }

    return on_each_stack(specs, f"N={args.overload_n}", one)


def run_backtoback(specs: list[StackSpec], lines: list[Line], args: argparse.Namespace) -> list[Figures]:
    rows = []
    for sessions in (32, 1):

        def one(spec: StackSpec, sessions: int = sessions) -> Figures:
            with up(spec) as stack:
                return asyncio.run(measure(stack, lines, plan(args, sessions, 0.0, args.peak_s)))

        rows += on_each_stack(specs, f"C={sessions}", one)
    return rows


def run_openenv(specs: list[StackSpec], lines: list[Line], args: argparse.Namespace) -> list[Figures]:
    n, think = args.openenv

    def one(spec: StackSpec) -> Figures:
        with up(spec, openenv=True) as stack:
            figures = asyncio.run(
                measure(
                    stack, lines, plan(args, n, think, args.window_s, transport="openenv", read_memory=True)
                )
            )
        if not figures["steps_in_window"]:
            raise RuntimeError(f"no step served through the gateway: {figures['counts']}")
        return figures

    return on_each_stack(specs, f"{n}:{think:g}", one)


RUNNERS: dict[str, Callable[[list[StackSpec], list[Line], argparse.Namespace], list[Figures]]] = {
    "steady": run_steady,
    "burst": run_burst,
    "overload": run_overload,
    "backtoback": run_backtoback,
    "openenv": run_openenv,
}


# ---------------------------------------------------------------------------------------------
# Tables: one per shape, a row per stack, new/base under the figures where a ratio means something.


@dataclass(frozen=True)
class Col:
    header: str
    key: str
    spec: str = ".0f"
    ratio: bool = False  # a new/base row shows this column's ratio


STEADY_COLS = [
    Col("offered/s", "offered"),
    Col("served/s", "served", ratio=True),
    Col("served %", "served_pct"),
    Col("p50 ms", "p50_ms", ".1f", ratio=True),
    Col("p99 ms", "p99_ms", ".1f", ratio=True),
    Col("CPU ms/step", "cpu_ms_per_step", ".2f", ratio=True),
    Col("stack CPU %", "stack_cpu_pct"),
    Col("PSS MiB", "pss_mib", ratio=True),
    Col("KiB/episode", "kib_per_episode", ".0f", ratio=True),
    Col("+KiB/episode", "added_kib_per_episode", ".0f", ratio=True),
    Col("refused", "refusals", "d"),
    Col("errors", "errors", "d"),
    Col("mismatch", "mismatches", "d"),
    Col("gen CPU %", "gen_cpu_pct"),
]
COLUMNS: dict[str, tuple[str, list[Col]]] = {
    "steady": (
        "steady: N rollouts thinking T s before each step (N:T); figures over the window",
        STEADY_COLS,
    ),
    "burst": (
        "burst: N episodes created at once, then S steps each thinking T (N x S)",
        [
            Col("all created s", "all_created_s", ".2f", ratio=True),
            Col("create p50 ms", "create_p50_ms", ".1f", ratio=True),
            Col("create p99 ms", "create_p99_ms", ".1f", ratio=True),
            Col("makespan s", "makespan_s", ".1f", ratio=True),
            Col("ideal s", "ideal_s", ".1f"),
            Col("makespan/ideal", "makespan_ratio", ".2f"),
            Col("step p50 ms", "p50_ms", ".1f", ratio=True),
            Col("step p99 ms", "p99_ms", ".1f", ratio=True),
            Col("CPU ms/step", "cpu_ms_per_step", ".2f", ratio=True),
            Col("refused", "refusals", "d"),
            Col("errors", "errors", "d"),
            Col("mismatch", "mismatches", "d"),
        ],
    ),
    "overload": (
        "overload: back-to-back peak (32 sessions), then N rollouts offering twice that peak",
        [
            Col("peak/s", "peak", ratio=True),
            Col("think ms", "think_ms", ".0f"),
            Col("offered/s", "offered"),
            Col("served/s", "served", ratio=True),
            Col("served/peak", "served_of_peak", ".2f"),
            Col("p50 ms", "p50_ms", ".1f", ratio=True),
            Col("p99 ms", "p99_ms", ".1f", ratio=True),
            Col("CPU ms/step", "cpu_ms_per_step", ".2f", ratio=True),
            Col("refused", "refusals", "d"),
            Col("errors", "errors", "d"),
            Col("mismatch", "mismatches", "d"),
            Col("gen CPU %", "gen_cpu_pct"),
        ],
    ),
    "backtoback": (
        "back to back: C sessions, no think time (regression check)",
        [
            Col("steps/s", "served", ratio=True),
            Col("p50 ms", "p50_ms", ".2f", ratio=True),
            Col("p99 ms", "p99_ms", ".2f", ratio=True),
            Col("CPU ms/step", "cpu_ms_per_step", ".2f", ratio=True),
            Col("stack CPU %", "stack_cpu_pct"),
            Col("refused", "refusals", "d"),
            Col("errors", "errors", "d"),
            Col("mismatch", "mismatches", "d"),
            Col("gen CPU %", "gen_cpu_pct"),
        ],
    ),
    "openenv": (
        "openenv: steady shape through the OpenEnv gateway, a WebSocket per episode (N:T)",
        STEADY_COLS,
    ),
}


def cell(row: Figures, col: Col) -> str:
    value = row.get(col.key)
    if value is None:
        return "n/a"
    return format(value, col.spec)


def ratio_cell(base: Figures, new: Figures, col: Col) -> str:
    b, n = base.get(col.key), new.get(col.key)
    if not col.ratio or not b or n is None:
        return ""
    return f"{n / b:.2f}x"


def print_table(
    shape: str, rows: list[Figures], specs: list[StackSpec], columns: tuple[str, list[Col]] | None = None
) -> None:
    """A shape's table on stdout: per point, a row per stack, then new/base; failures below it.
    `columns` (title, columns) instead of the shape's own (`COLUMNS`)."""
    title, cols = columns or COLUMNS[shape]
    header = ["point", "stack", *(c.header for c in cols)]
    body: list[list[str]] = []
    points = list(dict.fromkeys(row["point"] for row in rows))
    for point in points:
        by_stack = {row["stack"]: row for row in rows if row["point"] == point}
        for name, row in by_stack.items():
            cells = ["n/a" for _ in cols] if "failed" in row else [cell(row, c) for c in cols]
            body.append([point, name, *cells])
        base, new = by_stack.get("base"), by_stack.get("new")
        if base and new and "failed" not in base and "failed" not in new:
            body.append(["", "new/base", *(ratio_cell(base, new, c) for c in cols)])
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    print(f"\n{title}")
    for line in [header, *body]:
        print(
            "  ".join(
                text.ljust(w) if i < 2 else text.rjust(w)
                for i, (text, w) in enumerate(zip(line, widths, strict=True))
            )
        )
    revisions = ", ".join(f"{s.name} = {s.revision}" for s in specs)
    print(f"  ({revisions})")
    for row in rows:
        if "failed" in row:
            print(f"  {row['point']} on {row['stack']}: n/a, {row['failed']}")
        if row.get("note"):
            print(f"  {row['stack']}: {row['note']}")
        if row.get("all_stepped") is False:
            print(
                f"  {row['point']} on {row['stack']}: warm-up cut at its cap before every rollout had stepped"
            )
    sys.stdout.flush()


# ---------------------------------------------------------------------------------------------
# Command line.


def points(text: str) -> list[tuple[int, float]]:
    """ "N:T,N:T" → [(N, T), ...]."""
    out = []
    for item in text.split(","):
        n, think = item.split(":")
        out.append((int(n), float(think)))
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)}")
    parser.add_argument("--base", default="c33c920", help="base commit measured beside the working tree")
    parser.add_argument("--no-base", action="store_true", help="measure the working tree only")
    parser.add_argument(
        "--up-args",
        default="",
        help="more `codegym up` options for the working tree's stack, e.g. '--resident-memory-mb 1800'",
    )
    parser.add_argument(
        "--steady", type=points, default=points("256:1,1024:4,4096:16"), help="N:T,... points"
    )
    parser.add_argument("--window-s", type=float, default=30.0, help="measurement window after the warm-up")
    parser.add_argument("--burst-n", type=int, default=512, help="episodes created at once")
    parser.add_argument("--burst-steps", type=int, default=20, help="steps each burst episode plays")
    parser.add_argument("--burst-think", type=float, default=2.0, help="think time T of the burst, s")
    parser.add_argument("--peak-sessions", type=int, default=32, help="sessions of the back-to-back peak")
    parser.add_argument("--peak-s", type=float, default=15.0, help="window of the back-to-back runs, s")
    parser.add_argument("--overload-n", type=int, default=256, help="rollouts offering twice the peak")
    parser.add_argument("--openenv", type=lambda s: points(s)[0], default=(1024, 4.0), help="N:T via OpenEnv")
    parser.add_argument("--max-seconds", type=float, default=120.0, help="time cap of each measurement")
    parser.add_argument("--max-episodes", type=int, default=50_000, help="episode cap of each measurement")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--trajectories", type=Path, default=ROOT / "codegym" / "samples" / "trajectories.jsonl"
    )
    parser.add_argument("--json", type=Path, help="also write every figure to this file")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: N/4 and T/4 (same offered steps/s), windows 10 s and 5 s, burst N/4 and T/4",
    )
    args = parser.parse_args(argv)
    args.shapes = [s for s in args.shapes.split(",") if s]
    unknown = set(args.shapes) - set(SHAPES)
    if unknown:
        parser.error(f"unknown shapes: {', '.join(sorted(unknown))}")
    if args.quick:
        args.steady = [(max(1, n // 4), max(0.25, t / 4)) for n, t in args.steady]
        args.openenv = (max(1, args.openenv[0] // 4), max(0.25, args.openenv[1] / 4))
        args.window_s = min(args.window_s, 10.0)
        args.peak_s = min(args.peak_s, 5.0)
        args.burst_n = max(1, args.burst_n // 4)
        args.burst_think /= 4
        args.overload_n = max(1, args.overload_n // 4)
        args.max_seconds = min(args.max_seconds, 60.0)
    return args


def report_problems(results: dict[str, list[Figures]]) -> None:
    """Mismatches and errors, loudly, after the tables."""
    for shape, rows in results.items():
        for row in rows:
            if row.get("mismatches"):
                print(f"!!! {shape} {row['point']} on {row['stack']}: {row['mismatches']} observations "
                      "differed from the recording")  # fmt: skip
            if row.get("errors"):
                kinds = {k[6:]: v for k, v in row["counts"].items() if k.startswith("error:")}
                print(f"!!! {shape} {row['point']} on {row['stack']}: errors {kinds}")


def main() -> None:
    args = parse_args()
    # SIGTERM ends the bench like Ctrl-C: the blocks below stop the servers and remove the worktree.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    lines = [line for line in read_trajectories(args.trajectories) if line.get("steps")]
    results: dict[str, list[Figures]] = {}
    with contextlib.ExitStack() as cleanup:
        workdir = Path(tempfile.mkdtemp(prefix="codegym-rollout-bench-"))
        cleanup.callback(shutil.rmtree, workdir, True)
        specs = stack_specs(args, cleanup, workdir)
        for shape in args.shapes:
            results[shape] = RUNNERS[shape](specs, lines, args)
            print_table(shape, results[shape], specs)
    report_problems(results)
    if args.json:
        meta = {
            "stacks": {s.name: s.revision for s in specs},
            "args": {k: v for k, v in vars(args).items() if k not in ("json", "trajectories")},
            "cpus": os.cpu_count(),
            "loadavg": os.getloadavg(),
            "median_episode_steps": median([len(line["steps"]) for line in lines]),
        }
        args.json.write_text(json.dumps({"meta": meta, "shapes": results}, indent=2, default=str))
        progress(f"figures written to {args.json}")


if __name__ == "__main__":
    main()

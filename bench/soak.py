"""Soak with faults: episodes through the trainer paths, all at once, while infrastructure fails.

A training run lives for hours through deploys, scale-in and blips. This runs `codegym up
--runtimes 2 --workers 2 --openenv-port 0` over the Redis that `up` starts for itself (its
append-only file beside the library, supervised by `up`; `--redis given`: a Redis of the soak's own
given through `--sessions`, also append-only) and plays recorded oracle trajectories (codegym/samples/trajectories.jsonl)
through each path, with think time between steps, while a schedule of faults runs in a loop:

  rolling restart   each runtime replica sent SIGTERM in turn (`codegym up` starts it again on
                    its port), the next once the first answers again
  worker killed     a sandbox worker SIGKILLed
  worker drained    a sandbox worker sent SIGTERM (scale-in)
  worker frozen     a sandbox worker stopped with SIGSTOP for 15 s, then SIGCONT
  gateway restart   the OpenEnv gateway sent SIGTERM
  redis restart     up's own Redis SIGKILLed (`up` starts it again on its port and file); with
                    `--redis given`, the soak's Redis stopped and started again the same way

Paths, all at once:

  client   the async client as the trainer adapters drive it (`--rollouts` episodes in flight):
           every call through `codegym_client.outages.ride_out_async`, steps sent with their index
  trl      TRL's own `GRPOTrainer` training on `CodeGymSpec`'s `environment_factory` with a
           scripted model (bench/soak_trl.py, a process in the trainers' venv)
  verl     verl's own agent loop machinery running `CodeGymAgentLoop` (bench/soak_verl.py, a
           process in the trainers' venv, `--rollouts` episodes in flight)
  openenv  a WebSocket per episode through the gateway, as OpenEnv's EnvClient opens them

The trainers need torch: their venv is built by `make test-trainers` (`--trainers-python`).
Without it, the trl and verl paths run the adapters' contract in this process instead: the
spec's environment class called from threads as TRL's tool loop calls it, and verl's
`run_episode` with a thinking scripted model. The report says which ran.

Per path it reports episodes finished; episodes **shaped** by a fault (an observation that differs
from the recording: must be 0 — a trainer cannot tell it from a true one); episodes **failed** by
the infrastructure and marked so the trainer does not learn from them (TRL: `get_reward()` is
None; verl: `infrastructure_failure`, its row masked); episodes lost (an error escaped to the
trainer: a TRL `InfrastructureFailure` ends the run, an exception out of verl's episode fails its
worker; must be 0 on the trainer paths); trainer processes that died (must be 0); and at the end
the sessions left open in Redis (must be 0 once every episode closed its own) and the PSS of every
server at start and end (growth within `--memory-growth-mib`). It exits 1 when any of these
fails, after the report.

    .venv/bin/python bench/soak.py [--minutes 20] [--rollouts 16] [--think-s 1] [--faults all]
        [--paths all] [--redis up|given] [--trainers-python .venv-trainers/bin/python]
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
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import tree_memory_kb  # noqa: E402
from bench.rollout_bench import Failed, Refused, WsEpisode  # noqa: E402
from codegym import proctree  # noqa: E402
from codegym.procs import RedisServer, ServerProcess  # noqa: E402
from codegym_cli.oracle import read_trajectories  # noqa: E402
from codegym_client.async_client import AsyncRuntimeClient  # noqa: E402
from codegym_client.errors import CodeGymError, EpisodeEnded, EpisodeFailed, InfrastructureFailure  # noqa: E402
from codegym_client.outages import ride_out_async  # noqa: E402
from codegym_client.trl import CodeGymSpec  # noqa: E402
from codegym_client.verl import run_episode  # noqa: E402
from codegym_testkit.trainer_script import TOKENIZER, ability, oracle_turns  # noqa: E402
from sandbox_worker.limits import JAIL_ZYGOTE  # noqa: E402

Line = dict[str, Any]
FAULTS = ("rolling", "kill", "drain", "freeze", "gateway", "redis")
PATHS = ("client", "trl", "verl", "openenv")
TRAINER_PATHS = ("client", "trl", "verl")
# The trainers themselves, each in the trainers' venv (`make test-trainers` builds it): TRL's
# GRPOTrainer over CodeGymSpec, verl's CodeGymAgentLoop. Without that venv, the trl and verl paths
# run the adapters' contract in this process instead (TrlEpisode, verl_rollout).
TRAINER_SCRIPTS = {"trl": "soak_trl.py", "verl": "soak_verl.py"}
TRAINERS_PYTHON = ROOT / ".venv-trainers" / "bin" / "python"
# What a server may gain over a soak: allocator slack and caches (the environments' compiled code,
# the affinity map). A worker's session processes are counted apart (Stack.memory_mib).
MEMORY_GROWTH_MIB = 64.0
# The verl path's response budget: the scripted model's tokenizer is one token per byte, and the
# longest recorded episodes run past verl's usual 8,192 tokens in bytes.
RESPONSE_TOKENS = 1 << 20
# A server's line in `codegym up`'s output: at start and after each restart.
SERVER_LINE = re.compile(
    r"(runtime \d+|sandbox worker \d+|openenv gateway|redis) (?:back )?at (\S+) \(pid (\d+)[);]"
)
REDIS_URL = re.compile(r"redis at (redis://\S+) \(pid")
FREEZE_S = 15.0
SERVERS = ("runtime 1", "runtime 2", "sandbox worker 1", "sandbox worker 2", "openenv gateway")


@dataclass
class PathTally:
    """What happened to the episodes of one path."""

    finished: int = 0
    shaped: int = 0
    # Episodes the infrastructure failed, marked for the trainer not to learn from, by reason.
    failed: Counter[str] = field(default_factory=Counter)
    # Episodes that ended mid-way by an error that reached the trainer, by reason.
    lost: Counter[str] = field(default_factory=Counter)
    # Episodes that could not start (refused or no server at connect), by reason: sent again.
    not_started: Counter[str] = field(default_factory=Counter)
    steps: int = 0
    examples: list[str] = field(default_factory=list)
    # Trainer processes (TRL, verl) that exited with an error: a run that ended.
    died: int = 0
    # How the path ran: "in-process" (the adapter's contract) or the trainer's own process.
    mode: str = "in-process"


class Stack:
    """`codegym up` over its own Redis (`redis="up"`) or ours (`"given"`); knows each server's
    current pid from up's output."""

    def __init__(self, workdir: Path, redis: str = "up") -> None:
        self.workdir = workdir
        self.redis_folder = workdir / "redis"
        self.redis: RedisServer | None = None
        argv = [sys.executable, "-m", "codegym_cli.cli", "up", "--library", str(workdir / "library.db"),
                "--port", "0", "--runtimes", "2", "--workers", "2", "--openenv-port", "0",
                "--redis-dir", str(self.redis_folder)]  # fmt: skip
        if redis == "given":
            self.redis_folder.mkdir()
            self.redis = RedisServer(folder=self.redis_folder)
            argv[-2:] = ["--sessions", self.redis.url]
        self.up = ServerProcess(argv, name="codegym up", keep=100_000, timeout_s=180)
        self.runtimes = self.up.address.split(",")
        # `codegym up` names its servers right after its ready line (its Redis before it).
        named = (*SERVERS, "redis") if self.redis is None else SERVERS
        deadline = time.monotonic() + 30
        while len(self.servers()) < len(named):
            if time.monotonic() > deadline:
                raise RuntimeError(f"codegym up named only {sorted(self.servers())}")
            time.sleep(0.1)

    def servers(self) -> dict[str, tuple[str, int]]:
        """Each server's name → (address, pid), the latest line for each."""
        found: dict[str, tuple[str, int]] = {}
        for name, address, pid in SERVER_LINE.findall(self.up.text):
            found[name] = (address, int(pid))
        return found

    @property
    def redis_url(self) -> str:
        if self.redis is not None:
            return self.redis.url
        found = REDIS_URL.search(self.up.text)
        assert found, "codegym up printed no redis line"
        return found.group(1)

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
        """PSS of each server process (a worker with its jails, without the session processes its
        jails' zygotes forked: those are bounded by the resident budget and reclaimed when idle,
        and one whose release a fault lost lingers until then), and of Redis; and the session
        processes still resident, under "resident sessions" (a count)."""
        links = proctree.children_by_parent()
        out: dict[str, float] = {}
        sessions = 0
        for name, (_, pid) in sorted(self.servers().items()):
            tree = proctree.descendants([pid], links)
            zygotes = [p for p in tree if JAIL_ZYGOTE in (proctree.cmdline(p) or "")]
            session_pids = [c for z in zygotes for c in links.get(z, [])]
            forked = set(proctree.descendants(session_pids, links))
            sessions += len(session_pids)
            out[name] = (
                sum((proctree.memory_kb(p) or {}).get("Pss", 0) for p in tree if p not in forked) / 1024
            )
        if self.redis is not None:  # up's own Redis is one of its servers above
            out["redis"] = tree_memory_kb(self.redis.pid)[1] / 1024
        out["resident sessions"] = float(sessions)
        return out

    def stop(self) -> None:
        self.up.stop()
        if self.redis is not None:
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
    if stack.redis is not None:
        stack.redis.stop()
        stack.redis = stack.redis.again()
        return
    pid = stack.pid("redis")
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


class Unscored(Exception):
    """The episode failed in the infrastructure and the trainer is told so (not an error)."""


class RunEnded(Exception):
    """What would end the trainer's run (TRL: an `InfrastructureFailure` out of a tool call)."""


class TrlEpisode:
    """One rollout of TRL's `environment_factory` contract: an instance of the spec's class for
    the row's environment, `reset(**row)`, then a tool method per recorded action, each called from
    a thread as TRL's tool loop calls them (the adapter is synchronous)."""

    def __init__(self, spec: CodeGymSpec, pool: ThreadPoolExecutor) -> None:
        self.spec = spec
        self.pool = pool
        self.env: Any = None

    async def _call(self, call: Callable[[], Any]) -> Any:
        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, call)
        except InfrastructureFailure as exc:  # a BaseException: TRL's loop would not catch it
            raise RunEnded(f"InfrastructureFailure: {exc}") from exc

    async def create(self, line: Line) -> None:
        self.env = self.spec.environment_classes[line["env_id"]]()
        env = self.env
        await self._call(lambda: env.reset(ability=ability(line)))
        if env.get_reward() is None:  # CreateSession failed: the row is not scored
            raise Unscored(failure_reason(env._failure))  # the adapter's own record of why

    async def step(self, action: str) -> str:
        call = json.loads(action)
        method = getattr(self.env, call["name"])
        try:
            return str(await self._call(lambda: method(**call["parameters"])))
        except EpisodeFailed as exc:  # TRL shows the error text; get_reward() None leaves it unscored
            assert self.env.get_reward() is None
            raise Unscored(failure_reason(exc.__cause__ or exc)) from exc

    async def close(self) -> None:
        if self.env is not None:  # as at exit or when TRL drops the instance: one send, no wait
            env, self.env = self.env, None
            await asyncio.get_running_loop().run_in_executor(self.pool, env._finalizer)


def failure_reason(exc: BaseException | None) -> str:
    if isinstance(exc, CodeGymError):
        return exc.reason or type(exc).__name__
    if isinstance(exc, Failed | Refused):  # an OpenEnv error frame
        return str(exc).split(":", 1)[0]
    if isinstance(exc, Unscored | RunEnded):
        return str(exc)
    return type(exc).__name__  # the socket dropped or was refused (websockets' kin)


async def rollout(
    episode: Callable[[], RidingEpisode | WsEpisode | TrlEpisode],
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
        except Unscored as exc:
            tally.failed[str(exc)] += 1
        except RunEnded as exc:  # out of reset too: the trainer's run would end here
            tally.lost[str(exc)[:60]] += 1
        except EpisodeEnded as exc:  # the adapter ended the episode before its recording did
            tally.lost[f"EpisodeEnded: {exc}"] += 1
        except Exception as exc:
            (tally.lost if started else tally.not_started)[failure_reason(exc)] += 1
            await asyncio.sleep(1)
        finally:
            await playing.close()


class ThinkingModel:
    """verl's `generate` for one episode: thinks (a pause drawn around `think_s`), then answers the
    recorded action as a hermes tool call."""

    def __init__(self, line: Line, rng: random.Random, think_s: float) -> None:
        self.turns = oracle_turns(line)
        self.rng = rng
        self.think_s = think_s

    async def __call__(self, prompt_ids: list[int]) -> Any:
        await asyncio.sleep(self.rng.uniform(0.5, 1.5) * self.think_s)
        text = self.turns.pop(0) if self.turns else "I give up.<|im_end|>"
        return SimpleNamespace(token_ids=TOKENIZER.encode(text), log_probs=None)


async def verl_rollout(
    client: AsyncRuntimeClient,
    lines: list[Line],
    tally: PathTally,
    think_s: float,
    until: float,
    seed: int,
    outage_wait_s: float,
) -> None:
    """verl's episodes one after the other: what `CodeGymAgentLoop` hands verl, checked: the tool
    messages the model saw against the recording, a failure flagged (its row masked), nothing
    raised (an exception out of an agent loop fails verl's worker)."""
    rng = random.Random(seed)
    while time.monotonic() < until:
        line = rng.choice(lines)
        try:
            episode = await run_episode(
                client,
                ability(line),
                tokenizer=TOKENIZER,
                generate=ThinkingModel(line, rng, think_s),
                outage_wait_s=outage_wait_s,
                response_length=RESPONSE_TOKENS,
            )
        except Exception as exc:
            tally.lost[failure_reason(exc)] += 1
            await asyncio.sleep(1)
            continue
        tally.steps += episode.steps
        seen = [str(m["content"]) for m in episode.messages if m.get("role") == "tool"]
        expected = [observation for _, observation in line["steps"]]
        wrong = [i for i, (got, want) in enumerate(zip(seen, expected, strict=False)) if got != want]
        if wrong:
            tally.shaped += 1
            tally.examples.append(f"{line['env_id']} step {wrong[0]}: {seen[wrong[0]][:80]!r}")
        elif episode.infrastructure_failure:
            tally.failed[episode.failure_reason or "infrastructure"] += 1
        elif episode.done and episode.steps == len(expected) and len(seen) == len(expected) - 1:
            # The last answer ends the episode unshown: its reward says whether it was applied.
            if math.isclose(episode.reward, float(line["reward"])):
                tally.finished += 1
            else:
                tally.shaped += 1
                tally.examples.append(f"{line['env_id']}: reward {episode.reward}, recorded {line['reward']}")
        else:
            tally.lost[f"stop={episode.stop}"] += 1


async def trainer_process(
    name: str, script: str, args: argparse.Namespace, target: str, tally: PathTally, log: Path
) -> None:
    """A trainer in its own venv (bench/soak_trl.py: TRL's GRPOTrainer; bench/soak_verl.py: verl's
    agent loop), its episodes counted from the JSON line it prints for each."""
    argv = [args.trainers_python, str(ROOT / "bench" / script), "--target", target,
            "--minutes", str(args.minutes), "--outage-wait-s", str(args.outage_wait_s)]  # fmt: skip
    if name == "verl":
        argv += ["--rollouts", str(args.rollouts), "--think-s", str(args.think_s)]
    with log.open("wb") as errors:
        proc = await asyncio.create_subprocess_exec(
            *argv, cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=errors, limit=1 << 20
        )
        assert proc.stdout is not None
        async for raw in proc.stdout:
            try:
                line = json.loads(raw)
            except ValueError:
                continue
            if not isinstance(line, dict) or line.get("path") != name:
                continue  # a stray print of the trainer's, not an episode
            outcome, reason = line.get("outcome"), str(line.get("reason", ""))
            tally.steps += int(line.get("steps") or 0)
            if outcome == "finished":
                tally.finished += 1
            elif outcome == "shaped":
                tally.shaped += 1
                tally.examples.append(f"{line.get('env_id')}: {line.get('example', '')[:80]}")
            elif outcome == "failed":
                tally.failed[reason[:60]] += 1
            elif outcome != "died":
                tally.lost[reason[:60] or str(outcome)] += 1
        if await proc.wait() != 0:
            tally.died += 1
            tally.lost[f"{name} process exited {proc.returncode} (log: {log})"] += 1


async def soak(args: argparse.Namespace, stack: Stack, lines: list[Line]) -> dict[str, Any]:
    until = time.monotonic() + args.minutes * 60
    chosen = PATHS if args.paths == "all" else tuple(p for p in args.paths.split(",") if p)
    tallies = {name: PathTally() for name in chosen}
    trainers = Path(args.trainers_python).exists()
    faults_log: list[str] = []
    memory_start = stack.memory_mib()
    target = ",".join(stack.runtimes)
    # Each trainer path has its own client, as separate trainer processes would.
    async with (
        AsyncRuntimeClient(target, timeout_s=60) as client,
        AsyncRuntimeClient(target, timeout_s=60) as verl_client,
    ):
        await client.wait_ready(60)
        spec = CodeGymSpec(
            target,
            instances=[{"ability": ability(line)} for line in lines],
            outage_wait_s=args.outage_wait_s,
        )
        pool = ThreadPoolExecutor(max_workers=max(1, args.rollouts), thread_name_prefix="trl")
        paths: dict[str, Callable[[], RidingEpisode | WsEpisode | TrlEpisode]] = {
            "client": lambda: RidingEpisode(client),
            "trl": lambda: TrlEpisode(spec, pool),
            "openenv": lambda: WsEpisode(stack.gateway_url()),
        }
        tasks = []
        for seed, name in enumerate(chosen):
            if name in TRAINER_SCRIPTS and trainers:
                tallies[name].mode = TRAINER_SCRIPTS[name]
                log = stack.workdir / f"{name}.log"
                tasks.append(
                    asyncio.create_task(
                        trainer_process(name, TRAINER_SCRIPTS[name], args, target, tallies[name], log)
                    )
                )
                continue
            for i in range(args.rollouts):
                if name == "verl":
                    play = verl_rollout(
                        verl_client,
                        lines,
                        tallies[name],
                        args.think_s,
                        until,
                        seed * 1000 + i,
                        args.outage_wait_s,
                    )
                else:
                    play = rollout(paths[name], lines, tallies[name], args.think_s, until, seed * 1000 + i)
                tasks.append(asyncio.create_task(play))
        faults = FAULTS if args.faults == "all" else tuple(f for f in args.faults.split(",") if f)
        tasks.append(asyncio.create_task(fault_loop(stack, list(faults), until - 30, faults_log)))
        try:
            await asyncio.gather(*tasks)
        finally:
            pool.shutdown(wait=True)
            spec.client().close()
    left_open = await sessions_left(stack.redis_url)
    return {
        "minutes": args.minutes,
        "faults": faults_log,
        "paths": {
            name: vars(t)
            | {"failed": dict(t.failed), "lost": dict(t.lost), "not_started": dict(t.not_started)}
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
    parser.add_argument("--paths", default="all", help=f"comma list of {', '.join(PATHS)}, or all")
    parser.add_argument(
        "--redis",
        choices=("up", "given"),
        default="up",
        help="up: the Redis codegym up starts for itself, SIGKILLed by the redis fault; given: one of "
        "the soak's own, passed with --sessions, stopped and started again",
    )
    parser.add_argument(
        "--outage-wait-s", type=float, default=600.0, help="the trainer adapters' outage wait (their default)"
    )
    parser.add_argument(
        "--trainers-python",
        default=str(TRAINERS_PYTHON),
        help="the trainers' venv (TRL, verl); absent: their adapters' contract runs in this process",
    )
    parser.add_argument(
        "--memory-growth-mib",
        type=float,
        default=MEMORY_GROWTH_MIB,
        help="the PSS a server may gain from start to end (a restarted server's end against the first one's start)",
    )
    args = parser.parse_args()
    lines = [
        t for t in read_trajectories(ROOT / "codegym" / "samples" / "trajectories.jsonl") if t.get("steps")
    ]
    workdir = Path(tempfile.mkdtemp(prefix="codegym-soak-"))
    os.chmod(workdir, 0o755)
    stack = Stack(workdir, args.redis)
    try:
        report = asyncio.run(soak(args, stack, lines))
    finally:
        stack.stop()
    print(f"soak of {report['minutes']:g} min, faults: {len(report['faults'])}")
    for entry in report["faults"]:
        print(f"  {entry}")
    print(f"{'path':<8} {'finished':>8} {'shaped':>6} {'steps':>7}  failed (marked) / lost / could not start")
    for name, tally in report["paths"].items():
        print(
            f"{name:<8} {tally['finished']:>8} {tally['shaped']:>6} {tally['steps']:>7}  "
            f"{tally['failed'] or 0} / {tally['lost'] or 0} / {tally['not_started'] or 0}"
        )
        print(f"         ran as: {tally['mode']}; trainer processes died: {tally['died']}")
        for example in tally["examples"][:5]:
            print(f"         shaped: {example}")
    print(f"sessions left open in Redis: {report['sessions_left_open']}")
    print("PSS MiB at start -> end (workers without their session processes, counted apart):")
    start, end = report["memory_mib"]["start"], report["memory_mib"]["end"]
    for name in sorted(set(start) | set(end)):
        print(f"  {name:<18} {start.get(name, 0):8.1f} -> {end.get(name, 0):8.1f}")
    broken = verdict(report, args.memory_growth_mib)
    for line in broken:
        print(f"FAILED: {line}")
    print("soak: " + ("FAILED" if broken else "passed"))
    sys.exit(1 if broken else 0)


def verdict(report: dict[str, Any], growth_mib: float) -> list[str]:
    """What the soak must hold: no observation shaped by a fault on any path; no episode lost to a
    trainer path (the OpenEnv path is reported only: its protocol cannot resume an episode whose
    socket a gateway restart closed past its grace); no session left open; no server growing past
    `growth_mib`."""
    broken: list[str] = []
    for name, tally in report["paths"].items():
        if tally["shaped"]:
            broken.append(f"{name}: {tally['shaped']} episodes shaped by a fault")
        if name in TRAINER_PATHS and tally["lost"]:
            broken.append(f"{name}: episodes lost {tally['lost']}")
        if tally["died"]:
            broken.append(f"{name}: {tally['died']} trainer process died")
    if report["sessions_left_open"]:
        broken.append(f"{report['sessions_left_open']} sessions left open in Redis")
    start, end = report["memory_mib"]["start"], report["memory_mib"]["end"]
    for name in sorted(set(start) & set(end) - {"resident sessions"}):
        if end[name] - start[name] > growth_mib:
            broken.append(f"{name} grew {end[name] - start[name]:.1f} MiB (bound {growth_mib:g})")
    return broken


if __name__ == "__main__":
    main()

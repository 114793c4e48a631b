"""The soak's paths (bench/soak.py): episodes through the trainer adapters as the trainers drive
them, and over the OpenEnv gateway, each judged against its recording (bench/judge.py) and counted
in its path's `PathTally`.

In this process: the async client riding out outages (`RidingEpisode`), TRL's
`environment_factory` contract called from threads (`TrlEpisode`), verl's `run_episode` with a
thinking scripted model (`verl_rollout`), a WebSocket per episode (bench/episodes.py's
`WsEpisode`). In the trainers' venv: TRL's and verl's own processes (`trainer_process`), whose
JSON lines are counted here.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from bench.common import Line
from bench.episodes import Failed, Refused, WsEpisode
from bench.judge import Judge, Verdict
from bench.stacks import ROOT
from codegym_client.api.runtime.v1 import runtime_service_pb2 as rt
from codegym_client.async_client import AsyncRuntimeClient
from codegym_client.errors import CodeGymError, EpisodeEnded, EpisodeFailed, InfrastructureFailure
from codegym_client.outages import ride_out_async
from codegym_client.trl import CodeGymSpec
from codegym_client.verl import run_episode
from codegym_testkit.trainer_script import TOKENIZER, ability, oracle_turns

# The verl path's response budget: the scripted model's tokenizer is one token per byte, and the
# longest recorded episodes run past verl's usual 8,192 tokens in bytes.
RESPONSE_TOKENS = 1 << 20


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

    def count(self, line: Line, verdict: Verdict) -> None:
        """An episode judged against its recording (bench/judge.py)."""
        if verdict.outcome == "finished":
            self.finished += 1
        elif verdict.outcome == "shaped":
            self.shaped += 1
            self.examples.append(f"{line['env_id']} {verdict.example}"[:160])
        elif verdict.outcome == "failed":
            self.failed[verdict.reason[:60]] += 1
        else:
            self.lost[verdict.reason[:60]] += 1


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


@dataclass
class Moves:
    """The client path's forks and suspends (bench/soak.py): every session id a call handed it
    (`known`: created, forked, restored), and what the moves did. A session left open at the end
    that is in `known` was not closed by its episode; one that is not was made by a call whose
    answer the path never got (a fork or restore done twice by a resend): a duplicate."""

    known: set[str] = field(default_factory=set)
    forks: int = 0  # sessions made by forks
    suspends: int = 0  # checkpoints with close=True
    restores: int = 0  # sessions made by restores
    # A fork or restore that answered another count or another step than the one asked for.
    wrong: Counter[str] = field(default_factory=Counter)


class MovingEpisode(RidingEpisode):
    """The client path with forks and checkpoints (docs/fork.md), every call riding out outages
    as the step's do. At a step drawn per episode it either forks its session 2 ways, goes on in
    the first fork (the source closed) and plays the recording's rest in the second beside it,
    judged and counted as an episode of its own; or it suspends its session
    (`checkpoint_session(close=True)`: the server keeps nothing of it) and goes on in a restore of
    the blob. Either way the rest must be the recording's, observation by observation."""

    def __init__(
        self,
        client: AsyncRuntimeClient,
        tally: PathTally,
        moves: Moves,
        rng: random.Random,
        think_s: float,
        share: float,
    ) -> None:
        super().__init__(client)
        self.tally = tally
        self.moves = moves
        self.rng = rng
        self.think_s = think_s
        self.share = share
        self.line: Line = {}
        self.move_at: int | None = None
        self.kind = ""
        self.beside: list[asyncio.Task[None]] = []

    async def create(self, line: Line) -> None:
        await super().create(line)
        self.moves.known.add(self.session)
        self.line = line
        steps = len(line["steps"])
        moving = steps > 1 and self.rng.random() < self.share
        self.move_at = self.rng.randrange(1, steps) if moving else None
        self.kind = self.rng.choice(("fork", "suspend"))

    async def step(self, action: str) -> str:
        if self.index == self.move_at:
            await (self.fork() if self.kind == "fork" else self.suspend())
        return await super().step(action)

    def check(self, what: str, count: int, want: int, steps: list[int]) -> None:
        if count != want or any(index != self.index for index in steps):
            self.moves.wrong[f"{what}: {count} sessions at steps {steps}, asked {want} at {self.index}"] += 1

    async def fork(self) -> None:
        client, source, key = self.client, self.session, uuid.uuid4().hex
        # One key for every send of this fork, the outage's included: a fork the runtime made before
        # its answer was lost is answered again, not made twice.
        forks = await ride_out_async(lambda: client.fork_session(source, count=2, request_id=key), "fork")
        self.moves.known.update(fork.session_id for fork in forks)
        self.moves.forks += len(forks)
        self.check("fork", len(forks), 2, [fork.step_index for fork in forks])
        self.session = forks[0].session_id
        with contextlib.suppress(Exception):
            await ride_out_async(lambda: client.close_session(source), "close", 60)
        for fork in forks[1:]:
            self.beside.append(asyncio.create_task(self.branch(fork.session_id, self.index)))

    async def suspend(self) -> None:
        client, source, key = self.client, self.session, uuid.uuid4().hex
        blob = await ride_out_async(
            lambda: client.checkpoint_session(source, close=True, request_id=key), "checkpoint"
        )
        self.moves.suspends += 1
        restored = await ride_out_async(lambda: client.restore_session(blob, request_id=key), "restore")
        self.moves.known.add(restored.session_id)
        self.moves.restores += 1
        self.check("restore", 1, 1, [restored.step_index])
        self.session = restored.session_id

    async def branch(self, session: str, start: int) -> None:
        """The second fork: the recording's rest from `start`, judged as an episode of its own."""
        client, line = self.client, self.line
        rest = line["steps"][start:]
        judge = Judge(line, rest)
        try:
            for index, (action, _) in enumerate(rest, start):
                await asyncio.sleep(self.rng.uniform(0.5, 1.5) * self.think_s)

                def send(action: str = action, index: int = index) -> Awaitable[rt.StepResponse]:
                    return client.step(session, action, step_index=index)

                reply = await ride_out_async(send, "step")
                self.tally.steps += 1
                if not judge.saw(str(reply.observation)):
                    break
            self.tally.count(line, judge.verdict())
        except Exception as exc:
            self.tally.lost[f"fork: {failure_reason(exc)}"] += 1
        finally:
            with contextlib.suppress(Exception):
                await ride_out_async(lambda: client.close_session(session), "close", 60)

    async def close(self) -> None:
        await super().close()
        beside, self.beside = self.beside, []
        if beside:
            await asyncio.gather(*beside)


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
            raise Unscored(failure_reason(env._session.failure))  # the adapter's own record of why

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
    if isinstance(exc, Failed | Refused):  # an OpenEnv error frame: its code and the runtime's reason
        return ": ".join(str(exc).split(": ")[:2])[:60]
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
        judge = Judge(line)
        started = False
        try:
            await playing.create(line)
            started = True
            for action, _ in line["steps"]:
                await asyncio.sleep(rng.uniform(0.5, 1.5) * think_s)
                observation = await playing.step(action)
                tally.steps += 1
                if not judge.saw(observation):
                    break
            tally.count(line, judge.verdict())
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
        judge = Judge(line)
        for message in episode.messages:
            if message.get("role") == "tool":
                judge.saw(str(message["content"]))
        failure = (episode.failure_reason or "infrastructure") if episode.infrastructure_failure else None
        verdict = judge.verdict(
            failure=failure,
            done=episode.done,
            steps=episode.steps,
            reward=episode.reward,
            last_shown=False,
            stop=f"stop={episode.stop}",
        )
        tally.count(line, verdict)


async def trainer_process(
    name: str, script: str, args: argparse.Namespace, target: str, tally: PathTally, log: Path
) -> None:
    """A trainer in its own venv (bench/soak_trl.py: TRL's GRPOTrainer; bench/soak_verl.py: verl's
    agent loop), its episodes counted from the JSON line it prints for each."""
    argv = [
        args.trainers_python,
        str(ROOT / "bench" / script),
        "--target",
        target,
        "--minutes",
        str(args.minutes),
        "--outage-wait-s",
        str(args.outage_wait_s),
    ]
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

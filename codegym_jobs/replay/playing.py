"""Playing recorded tasks through sandbox workers for `codegym library replay`: each task as one
session, the verdict of each, their tally, and the state file a run resumes from."""

from __future__ import annotations

import asyncio
import json
import secrets
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TextIO

import grpc

from codegym.library.store import EnvRecord, Library
from codegym.sandbox.v1 import sandbox_service_pb2 as sb
from codegym_jobs.appending import open_to_append, whole_lines
from codegym_jobs.replay.recordings import (
    Recordings,
    TaskRow,
    Trajectory,
    Unreadable,
    cut,
    excerpt,
    fingerprint,
    first_difference,
    parse_trajectory,
)
from services.dispatcher import QueueFull, SandboxUnavailable
from services.runtime.config import RuntimeConfig

# The runtime's defaults: a replay holds an environment to the time a trainer's session would give it.
STEP_TIMEOUT_MS = RuntimeConfig.step_timeout_ms
CREATE_TIMEOUT_MS = RuntimeConfig.create_timeout_ms
# Sends of one operation while the infrastructure fails (each already retried by the dispatcher).
INFRA_ATTEMPTS = 3
INFRA_BACKOFF_S = 0.5


class Sandbox(Protocol):
    """What a replay needs of the workers (`services.dispatcher.SandboxDispatcher`)."""

    async def execute(self, op: sb.Operation, source: str, key: str = "") -> sb.OperationResult: ...

    async def release(self, key: str) -> None: ...


class InfrastructureFault(Exception):
    """No worker gave an answer to an operation, however often it was sent."""


@dataclass(frozen=True)
class Limits:
    step_ms: int = STEP_TIMEOUT_MS
    create_ms: int = CREATE_TIMEOUT_MS


async def run_operation(sandbox: Sandbox, op: sb.Operation, source: str, key: str) -> sb.OperationResult:
    """The worker's answer to `op`, sent again while the infrastructure fails: every operation is a
    pure function of (source, state, input, seed), so a resend cannot change a result."""
    problem = ""
    for attempt in range(INFRA_ATTEMPTS):
        if attempt:
            await asyncio.sleep(INFRA_BACKOFF_S * 2 ** (attempt - 1))
        try:
            result = await sandbox.execute(op, source, key)
        except (SandboxUnavailable, QueueFull) as exc:
            problem = str(exc)
        except grpc.aio.AioRpcError as exc:
            problem = f"{exc.code().name}: {exc.details()}"
        else:
            if result.status != sb.STATUS_SOURCE_NEEDED:
                return result
            problem = "the worker asked for the source again after it was sent"
    raise InfrastructureFault(f"{problem} ({INFRA_ATTEMPTS} attempts)")


def status_name(result: sb.OperationResult) -> str:
    return sb.Status.Name(result.status).removeprefix("STATUS_").lower()


def verdict(
    result: sb.OperationResult, step: int, action: str | None, expected: str | None
) -> dict[str, Any] | None:
    """How a task ended at this step (the environment failed, or answered otherwise than recorded),
    or None: it goes on."""
    if result.status != sb.STATUS_OK:
        return {
            "outcome": "failed",
            "fault": "environment",
            "status": status_name(result),
            "step": step,
            "action": None if action is None else cut(action),
            "message": cut(result.message or result.stderr or status_name(result)),
        }
    if expected is not None and result.observation != expected:
        at = first_difference(expected, result.observation)
        return {
            "outcome": "different",
            "step": step,
            "action": None if action is None else cut(action),
            "at": at,
            "expected": excerpt(expected, at),
            "got": excerpt(result.observation, at),
        }
    return None


async def replay_task(
    sandbox: Sandbox, task: TaskRow, code: EnvRecord, trajectory: Trajectory, limits: Limits, seed: int
) -> dict[str, Any]:
    """Play the recorded actions through the workers, as one session (resident on its worker, so a
    step costs no fork); the outcome's fields of the task's line."""
    key = f"replay-{task.task_id}-{secrets.token_hex(6)}"
    source = sb.SourceRef(sha256=code.sha256)
    step, action = 0, None
    try:
        create = sb.CreateOp(config_json=task.config_json, session_key=key)
        op = sb.Operation(source=source, limits=sb.Limits(wall_ms=limits.create_ms), seed=seed, create=create)
        result = await run_operation(sandbox, op, code.source, key)
        ended = verdict(result, 0, None, trajectory.first)
        for step, action in enumerate(trajectory.actions, 1):
            if ended is not None:
                return ended
            op = sb.Operation(
                source=source,
                limits=sb.Limits(wall_ms=limits.step_ms),
                seed=(seed + step) % (1 << 63),
                step=sb.StepOp(state=result.state, action=action, session_key=key),
            )
            result = await run_operation(sandbox, op, code.source, key)
            ended = verdict(result, step, action, trajectory.observations[step - 1])
        return ended or {"outcome": "identical", "reward": result.reward, "done": result.done}
    except InfrastructureFault as exc:
        return {
            "outcome": "failed",
            "fault": "infrastructure",
            "step": step,
            "action": None if action is None else cut(action),
            "message": cut(str(exc)),
        }
    finally:
        await sandbox.release(key)


@dataclass
class Tally:
    """Counts per environment (the outcomes, "failed" split into the environment's or the library's
    fault and the infrastructure's), and the first problems for the report."""

    envs: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    resumed: int = 0
    problems: list[dict[str, Any]] = field(default_factory=list)
    examples: int = 20

    @staticmethod
    def column(line: dict[str, Any]) -> str:
        if line["outcome"] == "failed":
            return "infra" if line.get("fault") == "infrastructure" else "failed"
        return str(line["outcome"])

    def add(self, line: dict[str, Any], resumed: bool) -> None:
        self.envs[line["env_id"]][self.column(line)] += 1
        self.resumed += resumed
        if line["outcome"] != "identical" and len(self.problems) < self.examples:
            self.problems.append(line)

    def total(self) -> Counter[str]:
        total: Counter[str] = Counter()
        for counts in self.envs.values():
            total.update(counts)
        return total


class StateFile:
    """Verdicts of finished tasks, one JSON line each, appended as they come (a killed run keeps
    every line it wrote; a line it left unfinished is cut off, and its task replayed)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.done: dict[int, dict[str, Any]] = {}
        self.file = open_to_append(path)  # a line cut by a kill is cut off: that task is replayed
        for text in whole_lines(path):
            try:
                line = json.loads(text)
            except ValueError:
                continue
            if isinstance(line, dict) and isinstance(line.get("task_id"), int) and "key" in line:
                self.done[line["task_id"]] = line

    def finished(self, task_id: int, key: str) -> dict[str, Any] | None:
        line = self.done.get(task_id)
        return line if line is not None and line.get("key") == key else None

    def record(self, line: dict[str, Any]) -> None:
        self.file.write(json.dumps(line, ensure_ascii=False) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


@dataclass(frozen=True)
class Settings:
    concurrency: int = 4
    limits: Limits = Limits()


async def replay_library(
    library: Library,
    task_ids: list[int],
    sandbox: Sandbox,
    state: StateFile,
    out: TextIO | None = None,
    settings: Settings = Settings(),
    progress: Callable[[dict[str, Any]], None] = lambda line: None,
) -> Tally:
    """Replay `task_ids` (skipping those `state` holds), `settings.concurrency` at a time."""
    recordings = Recordings(library)
    tally = Tally()
    pending: Iterator[int] = iter(task_ids)

    async def one(task_id: int) -> tuple[dict[str, Any], bool] | None:
        task = recordings.row(task_id)
        if task is None:  # removed since the ids were read
            return None
        code = recordings.code(task)
        key = fingerprint(task, code.sha256 if isinstance(code, EnvRecord) else task.source_sha)
        line: dict[str, Any] = {"task_id": task_id, "env_id": task.env_id, "source_sha": task.source_sha}
        finished = state.finished(task_id, key)
        if finished is not None:
            return finished, True
        try:
            trajectory = parse_trajectory(task.std_traj, task.obs_traj)
        except Unreadable as exc:
            line |= {"outcome": "unreadable", "message": cut(str(exc))}
        else:
            line["steps"] = len(trajectory.actions)
            if isinstance(code, str):
                line |= {"outcome": "failed", "fault": "library", "message": code}
            else:
                seed = int(key[:15], 16)
                line |= await replay_task(sandbox, task, code, trajectory, settings.limits, seed)
        line["key"] = key
        if line.get("fault") != "infrastructure":
            state.record(line)
        return line, False

    async def worker() -> None:
        # Each worker takes the next id when it is free: at most `concurrency` tasks in flight.
        for task_id in pending:
            done = await one(task_id)
            if done is None:
                continue
            line, resumed = done
            tally.add(line, resumed)
            if out is not None:
                out.write(json.dumps(line | {"resumed": resumed}, ensure_ascii=False) + "\n")
                out.flush()
            progress(line)

    await asyncio.gather(*(worker() for _ in range(max(1, settings.concurrency))))
    return tally

"""`codegym library replay`: CodeGym's published reference trajectories as a fidelity check.

CodeGym's published task rows carry, in `extra_info`, the oracle's actions (`std_traj`) and the
observations its environment answered (`obs_traj`), as Python-literal strings; `codegym library
import` keeps them verbatim in the library's `trajectories` table. This command plays each task's
actions in order through sandbox workers (create, then one step per action, each step from the state
the last one returned) with the code the task was recorded with (its `source_sha` variant when it
has one, else its environment's), and compares every observation with the recorded one as the
other fidelity checks do (`codegym demo`, the soak): exact string equality.

Reading the recordings. Their encoding is known only from what consumes them, so reading is
liberal where that cannot turn into a false "different", and anything else is *unreadable*
(reported apart, never as a difference):

- Each field is a Python literal (`ast.literal_eval`), else JSON text, holding a list (or the
  text of one, once: a field quoted twice on its way).
- An action is the JSON text of an action, an action object, or a list of exactly one of either;
  an action object is read by the one action rule the runtime and the clients apply
  (`codegym_client.actions`: `parameters` or `arguments`), and the environment is sent its
  canonical `{"name": ..., "parameters": {...}}` text, as the runtime would send it. Action text
  that is not JSON (a Python-literal dict, say) is unreadable: the environment could never have
  read it as recorded.
- An observation is read as the sandbox reads what `env.step()` returned: a pair (a tuple of two,
  `(True, text)`) stands for its second item, and a value that is not a string for its `str()`.
- `obs_traj` holds one observation per action, or one more: then its first entry is the
  observation of the reset (compared with what the create answered, reported as step 0) and the
  rest follow the actions (steps 1...). Any other length, or no action at all, is unreadable.

Outcomes per task: *identical*; *different* (the first differing step, the action, expected and
got, cut around the first differing character); *failed*, with its fault kept apart: the
environment's own (it raised, timed out, ran out of memory: the worker already ran anything that
may have come from outside once more), the infrastructure's (no worker answered, after the
dispatcher's retries and this command's own), or the library's (the code the task was recorded with
is not in it); *unreadable*. An infrastructure fault is never "different".

Resuming: every task with a verdict is appended (one JSON line, flushed) to a state file; a run
given the same state skips tasks whose line matches the task as it stands now (environment,
config, code and both recordings, by fingerprint) and reports the combined totals. Tasks that
failed for the infrastructure get no line, so the next run tries them again.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import hashlib
import json
import random
import secrets
import sqlite3
import sys
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TextIO

import grpc

from codegym.library import EnvRecord, Library, default_library_path
from codegym.sandbox.v1 import sandbox_service_pb2 as sb
from codegym.sandbox.v1 import sandbox_service_pb2_grpc as sb_grpc
from codegym_cli.progress import stderr_progress
from codegym_client.actions import ActionParseError, action_from_object
from codegym_client.channels import aio_channel, target_for
from services.dispatcher import SANDBOX_SERVICE, QueueFull, SandboxDispatcher, SandboxUnavailable

# The runtime's defaults (services/runtime/service.py RuntimeConfig): a replay holds an environment
# to the time a trainer's session would give it.
STEP_TIMEOUT_MS = 5_000
CREATE_TIMEOUT_MS = 10_000
# Sends of one operation while the infrastructure fails (each already retried by the dispatcher).
INFRA_ATTEMPTS = 3
INFRA_BACKOFF_S = 0.5
# How much of an observation or a message a report line holds.
EXCERPT = 160
MESSAGE = 300
# The report's columns: "failed" is the environment's (or the library's) fault, "infra" the
# infrastructure's.
COLUMNS = ("identical", "different", "failed", "infra", "unreadable")


# ---- reading the recordings -----------------------------------------------------------------------


class Unreadable(ValueError):
    """A recording that cannot be read as a list of actions and the observations they got."""


@dataclass(frozen=True)
class Trajectory:
    actions: list[str]  # canonical action JSON text, as the environment is sent it
    observations: list[str]  # one per action
    first: str | None = None  # the reset's observation, when the recording holds it


def _literal(text: str, what: str, quoted: bool = False) -> list[Any]:
    """A recorded field as a list: a Python literal, else JSON text (once more when that is itself
    a string, as a field quoted twice on its way)."""
    value: Any = None
    try:
        value = ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):
            raise Unreadable(f"{what} is neither a Python literal nor JSON: {cut(text, 60)!r}") from None
    if isinstance(value, str) and not quoted:
        return _literal(value, what, quoted=True)
    if not isinstance(value, list | tuple):
        raise Unreadable(f"{what} holds {type(value).__name__}, not a list")
    return list(value)


def _action(item: Any, index: int) -> str:
    """The canonical text of one recorded action (see the module doc for what is read)."""
    if isinstance(item, list | tuple) and len(item) == 1:
        item = item[0]
    if isinstance(item, str):
        try:
            item = json.loads(item)
        except (ValueError, RecursionError):
            raise Unreadable(f"action {index} is not JSON: {cut(item, 60)!r}") from None
        if isinstance(item, list) and len(item) == 1:
            item = item[0]
    try:
        return action_from_object(item).to_json()
    except ActionParseError as exc:
        raise Unreadable(f"action {index}: {exc}") from None
    except (TypeError, ValueError) as exc:  # parameters JSON cannot carry (a set, bytes)
        raise Unreadable(f"action {index} cannot be sent as JSON: {exc}") from None


def _observation(item: Any) -> str:
    """A recorded observation as the sandbox renders `env.step()`'s return (inside/operations.py)."""
    if isinstance(item, tuple) and len(item) == 2:
        item = item[1]
    return item if isinstance(item, str) else str(item)


def parse_trajectory(std_traj: str, obs_traj: str) -> Trajectory:
    raw_actions = _literal(std_traj, "std_traj")
    raw_observations = _literal(obs_traj, "obs_traj")
    if not raw_actions:
        raise Unreadable("std_traj holds no action")
    actions = [_action(item, i) for i, item in enumerate(raw_actions, 1)]
    observations = [_observation(item) for item in raw_observations]
    if len(observations) == len(actions):
        return Trajectory(actions, observations)
    if len(observations) == len(actions) + 1:
        return Trajectory(actions, observations[1:], observations[0])
    raise Unreadable(f"{len(actions)} actions but {len(observations)} observations")


def cut(text: str, limit: int = MESSAGE) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def first_difference(a: str, b: str) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def excerpt(text: str, at: int, width: int = EXCERPT) -> str:
    """`width` characters of `text` around offset `at` (where two texts part), marked where cut."""
    start = max(0, min(at - width // 4, len(text) - width))
    end = start + width
    return ("..." if start else "") + text[start:end] + ("..." if end < len(text) else "")


# ---- the library ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TaskRow:
    task_id: int
    env_id: str
    config_json: str
    source_sha: str
    std_traj: str
    obs_traj: str


class Recordings:
    """The library's tasks with trajectories, read by id (one indexed read per task)."""

    def __init__(self, library: Library) -> None:
        self.library = library
        db = library.db
        tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        self.present = "trajectories" in tables
        columns = {row[1] for row in db.execute("PRAGMA table_info(tasks)")}
        self.source_sha = "t.source_sha" if "source_sha" in columns else "''"

    def task_ids(self, prefix: str = "") -> list[int]:
        """Ids of the tasks with a trajectory whose env id starts with `prefix`, in order."""
        if not self.present:
            return []
        rows = self.library.db.execute(
            "SELECT t.id FROM trajectories r JOIN tasks t ON t.id = r.task_id"
            " WHERE substr(t.env_id, 1, ?) = ? ORDER BY t.id",
            (len(prefix), prefix),
        )
        return [int(row[0]) for row in rows]

    def row(self, task_id: int) -> TaskRow | None:
        row = self.library.db.execute(
            f"SELECT t.env_id, t.config_json, {self.source_sha}, r.std_traj, r.obs_traj"
            " FROM tasks t JOIN trajectories r ON r.task_id = t.id WHERE t.id = ?",
            (task_id,),
        ).fetchone()
        return None if row is None else TaskRow(task_id, *row)

    def code(self, task: TaskRow) -> EnvRecord | str:
        """The code the task was recorded with (as the runtime picks it, catalog.py), or why not."""
        env = self.library.get(task.env_id, tasks=False)
        if env is None:
            return f"environment {task.env_id} is not in the library"
        if not task.source_sha or task.source_sha == env.sha256:
            return env
        variant = self.library.variant(task.source_sha)
        if variant is None or variant.env_id != task.env_id:
            return (
                f"the code the task was recorded with (sha256 {task.source_sha[:12]}) is not in the library"
            )
        return variant


def select(task_ids: list[int], sample: int | None, seed: int) -> list[int]:
    """All of `task_ids`, or `sample` of them drawn with `seed` (the same draw every time), in order."""
    if sample is None or sample >= len(task_ids):
        return task_ids
    return sorted(random.Random(seed).sample(task_ids, sample))


def fingerprint(task: TaskRow, code_sha: str) -> str:
    """What a verdict depends on: a state line applies to a task only while this is unchanged."""
    text = json.dumps([task.env_id, task.config_json, code_sha, task.std_traj, task.obs_traj])
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:32]


# ---- replaying ------------------------------------------------------------------------------------


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
    every line it wrote; a cut last line is ignored)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.done: dict[int, dict[str, Any]] = {}
        if path.exists():
            for text in path.read_text(encoding="utf-8", errors="replace").splitlines():
                try:
                    line = json.loads(text)
                except ValueError:
                    continue
                if isinstance(line, dict) and isinstance(line.get("task_id"), int) and "key" in line:
                    self.done[line["task_id"]] = line
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "a+", encoding="utf-8")  # noqa: SIM115 (closed by close())
        if self.file.tell():
            self.file.seek(self.file.tell() - 1)
            if self.file.read(1) != "\n":  # a line cut by a kill: end it, so the next one is whole
                self.file.write("\n")

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


# ---- the command ----------------------------------------------------------------------------------


def report(tally: Tally, console: TextIO) -> None:
    """The per-environment table, the totals, and the first tasks that were not identical."""
    width = max([len(env_id) for env_id in tally.envs] + [len("environment")])
    header = f"{'environment':<{width}}  {'tasks':>6}" + "".join(f"  {c:>10}" for c in COLUMNS)
    print(header, file=console)

    def row(name: str, counts: Counter[str]) -> str:
        return f"{name:<{width}}  {sum(counts.values()):>6}" + "".join(f"  {counts[c]:>10}" for c in COLUMNS)

    for env_id in sorted(tally.envs):
        print(row(env_id, tally.envs[env_id]), file=console)
    totals = tally.total()
    print(row("total", totals), file=console)
    for line in tally.problems:
        print(problem_text(line), file=console)
    more = sum(totals.values()) - totals["identical"] - len(tally.problems)
    if more > 0:
        print(f"... and {more} more (--out has every task)", file=console)


def problem_text(line: dict[str, Any]) -> str:
    where = f"task {line['task_id']} {line['env_id']} step {line.get('step', 0)}"
    if line["outcome"] == "different":
        return f"different  {where}: expected {line['expected']!r}, got {line['got']!r}"
    if line["outcome"] == "unreadable":
        return f"unreadable task {line['task_id']} {line['env_id']}: {line['message']}"
    fault = line.get("fault", "")
    status = f" {line['status']}" if line.get("status") else ""
    return f"failed     {where} ({fault}{status}): {line.get('message', '')}"


def default_state(library: str, out: str | None) -> Path:
    return Path(f"{out}.state") if out else Path(f"{library}.replay-state.jsonl")


async def reachable(addresses: list[str], timeout_s: float) -> list[str]:
    """The workers among `addresses` that answer GetWorkerInfo within `timeout_s`."""

    async def probe(address: str) -> str | None:
        async with aio_channel(address, [SANDBOX_SERVICE]) as channel:
            try:
                await sb_grpc.SandboxServiceStub(channel).GetWorkerInfo(
                    sb.GetWorkerInfoRequest(), timeout=timeout_s, wait_for_ready=True
                )
            except grpc.aio.AioRpcError:
                return None
        return address

    return [a for a in await asyncio.gather(*(probe(a) for a in addresses)) if a is not None]


def run(args: argparse.Namespace) -> int:
    if not Path(args.library).is_file():
        print(f"codegym library replay: no library at {args.library}", file=sys.stderr)
        return 2
    addresses = [a.strip() for a in args.sandbox.split(",") if a.strip()]
    if not addresses:
        print("codegym library replay: --sandbox needs HOST:PORT[,HOST:PORT...]", file=sys.stderr)
        return 2
    try:
        for target in (addresses, *addresses):
            target_for(target)
    except ValueError as exc:
        print(f"codegym library replay: --sandbox {args.sandbox}: {exc}", file=sys.stderr)
        return 2
    state_path = Path(args.state) if args.state else default_state(args.library, args.out)
    try:
        library = Library(args.library, read_only=True)
    except sqlite3.DatabaseError as exc:
        print(f"codegym library replay: cannot read {args.library}: {exc}", file=sys.stderr)
        return 2
    with library:
        task_ids = select(Recordings(library).task_ids(args.prefix), args.sample, args.seed)
        if not task_ids:
            print(
                f"codegym library replay: no task with a trajectory in {args.library}"
                + (f" whose env id starts with {args.prefix!r}" if args.prefix else ""),
                file=sys.stderr,
            )
            return 0
        settings = Settings(args.concurrency, Limits(args.step_timeout_ms, 2 * args.step_timeout_ms))
        try:
            tally = asyncio.run(_replay(args, addresses, library, task_ids, state_path, settings))
        except KeyboardInterrupt:
            print(
                f"codegym library replay: stopped; finished tasks are in {state_path}, run again to resume",
                file=sys.stderr,
            )
            return 130
    if tally is None:
        return 2
    report(tally, sys.stdout)
    totals = tally.total()
    print(
        f"{sum(totals.values())} tasks ({tally.resumed} finished earlier, from {state_path}): "
        + ", ".join(f"{totals[c]} {c}" for c in COLUMNS)
    )
    return 1 if totals["different"] or totals["failed"] or totals["infra"] else 0


async def _replay(
    args: argparse.Namespace,
    addresses: list[str],
    library: Library,
    task_ids: list[int],
    state_path: Path,
    settings: Settings,
) -> Tally | None:
    live = await reachable(addresses, args.connect_timeout)
    if not live:
        print(f"codegym library replay: no sandbox worker answered at {args.sandbox}", file=sys.stderr)
        return None
    for address in sorted(set(addresses) - set(live)):
        print(
            f"codegym library replay: worker {address} did not answer; replaying without it", file=sys.stderr
        )
    progress = stderr_progress()
    bar = progress.add_task("replay", total=len(task_ids))
    seen: Counter[str] = Counter()

    def advance(line: dict[str, Any]) -> None:
        seen[Tally.column(line)] += 1
        problems = ", ".join(f"{seen[c]} {c}" for c in COLUMNS[1:] if seen[c])
        progress.update(bar, advance=1, description=f"replay ({problems or 'all identical'})")

    state = StateFile(state_path)
    dispatcher = SandboxDispatcher(live)
    out = open(args.out, "w", encoding="utf-8") if args.out else None  # noqa: SIM115
    try:
        with progress:
            return await replay_library(library, task_ids, dispatcher, state, out, settings, advance)
    finally:
        state.close()
        if out is not None:
            out.close()
        await dispatcher.close()


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_parser(library_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    replay = library_subparsers.add_parser(
        "replay",
        help="play the published reference trajectories (std_traj, obs_traj) through sandbox workers "
        "and compare every observation",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
    )
    replay.add_argument("--library", metavar="DB", default=str(default_library_path()), help="library file")
    replay.add_argument(
        "--sandbox", metavar="HOST:PORT[,HOST:PORT...]", required=True, help="sandbox workers to replay on"
    )
    replay.add_argument(
        "--sample", metavar="N", type=positive, help="replay N tasks drawn at random, not all"
    )
    replay.add_argument(
        "--seed", metavar="S", type=int, default=0, help="the same seed draws the same sample"
    )
    replay.add_argument("--prefix", metavar="P", default="", help="only env ids starting with this")
    replay.add_argument(
        "--state",
        metavar="FILE",
        help="verdicts of finished tasks, read to resume and appended to; when not given, OUT.state "
        "beside --out, else LIBRARY.replay-state.jsonl (delete it to replay everything again)",
    )
    replay.add_argument(
        "--out", metavar="FILE.jsonl", help="one JSON line per task (outcome, step, expected, got)"
    )
    replay.add_argument("--concurrency", metavar="C", type=positive, default=4, help="tasks in flight")
    replay.add_argument(
        "--step-timeout-ms",
        metavar="MS",
        type=positive,
        default=STEP_TIMEOUT_MS,
        help="wall-clock limit of one step, the runtime's default (a create gets twice this)",
    )
    replay.add_argument(
        "--connect-timeout", metavar="S", type=float, default=10.0, help="seconds to wait for the workers"
    )
    replay.set_defaults(func=run)
    return replay

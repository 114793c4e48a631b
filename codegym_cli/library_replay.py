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
import asyncio
import sqlite3
import sys
from collections import Counter
from pathlib import Path
from typing import Any, TextIO

import grpc

from codegym.library.location import default_library_path
from codegym.library.store import Library
from codegym.sandbox.v1 import sandbox_service_pb2 as sb
from codegym.sandbox.v1 import sandbox_service_pb2_grpc as sb_grpc
from codegym_cli.progress import stderr_progress
from codegym_client.channels import Access, aio_channel, target_for
from codegym_jobs.replay.playing import (
    Limits,
    Settings,
    StateFile,
    Tally,
    replay_library,
)
from codegym_jobs.replay.recordings import Recordings, Unreadable, parse_trajectory, select
from services.dispatcher import SANDBOX_SERVICE, SandboxDispatcher
from services.runtime.config import RuntimeConfig

# The command's API, the reading and playing it is made of included (replay_recordings.py,
# replay_playing.py): `from codegym_cli.library_replay import parse_trajectory` keeps working.
__all__ = [
    "Limits",
    "Settings",
    "StateFile",
    "Tally",
    "Unreadable",
    "add_parser",
    "parse_trajectory",
    "replay_library",
    "run",
]

# The report's columns: "failed" is the environment's (or the library's) fault, "infra" the
# infrastructure's.
COLUMNS = ("identical", "different", "failed", "infra", "unreadable")


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


async def reachable(addresses: list[str], timeout_s: float, access: Access) -> list[str]:
    """The workers among `addresses` that answer GetWorkerInfo within `timeout_s`."""

    async def probe(address: str) -> str | None:
        async with aio_channel(address, [SANDBOX_SERVICE], access=access) as channel:
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
    live = await reachable(addresses, args.connect_timeout, args.access)
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
    dispatcher = SandboxDispatcher(live, access=args.access)
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
        default=RuntimeConfig.step_timeout_ms,
        help="wall-clock limit of one step, the runtime's default (a create gets twice this)",
    )
    replay.add_argument(
        "--connect-timeout", metavar="S", type=float, default=10.0, help="seconds to wait for the workers"
    )
    replay.set_defaults(func=run)
    return replay

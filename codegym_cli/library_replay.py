"""What `codegym library replay` does; its options and description are in library_replay_options.py."""

from __future__ import annotations

import argparse
import asyncio
import sqlite3
import sys
from collections import Counter
from pathlib import Path
from typing import Any, TextIO

import grpc

from codegym.library.store import Library
from codegym.sandbox.v1 import sandbox_service_pb2 as sb
from codegym.sandbox.v1 import sandbox_service_pb2_grpc as sb_grpc
from codegym_cli.access import client_access
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

# The command's API, the reading and playing it is made of included (replay_recordings.py,
# replay_playing.py): `from codegym_cli.library_replay import parse_trajectory` keeps working.
__all__ = [
    "Limits",
    "Settings",
    "StateFile",
    "Tally",
    "Unreadable",
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
    live = await reachable(addresses, args.connect_timeout, client_access(args))
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
    dispatcher = SandboxDispatcher(live, access=client_access(args))
    out = open(args.out, "w", encoding="utf-8") if args.out else None  # noqa: SIM115
    try:
        with progress:
            return await replay_library(library, task_ids, dispatcher, state, out, settings, advance)
    finally:
        state.close()
        if out is not None:
            out.close()
        await dispatcher.close()

"""The Curriculum page's figures for one run, from what the runtime's API serves cheaply:

- `RunHistory`: the run's played tasks by pool (learnable, mastered, unsolved) as they stood at
  each policy version it reached (the record's bounded history, 1,000 versions per run); unseen
  is the library's size less the played tasks;
- `Stats` of the run with `played_only` (indexed: it reads the played tasks' rows, not the
  library's): the pools now, the played tasks' pass-rate distribution and the tasks that moved
  pools (where the published prior put a task, and where the run's own episodes have);
- the library's size from one `SampleTasks` (its pools' sum), kept for 5 minutes.

What the API does not give is said on the page, not approximated: the record counts a task's
episodes over the whole run (`Stats`) and its pools per version as counts (`RunHistory`), so

- the share of zero-variance groups, a (task, policy version) group whose rewards are all equal,
  cannot be computed; the page shows instead the share of played tasks (two episodes or more)
  whose rewards over the whole run were all equal, named as that;
- which tasks moved pools between two policy versions is not known, only each pool's net change
  from one version to the next (and, per task, its prior pool against its pool now).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from codegym_client.api.runtime.v1 import runtime_service_pb2 as rt
from codegym_client.async_client import AsyncRuntimeClient
from codegym_client.errors import InvalidRequest
from services.console import plots
from services.console.plays import CONSOLE_RUN

POOLS = ("unseen", "learnable", "mastered", "unsolved")
PLAYED_POOLS = POOLS[1:]
LOW, HIGH = 0.0, 1.0  # the sampler's default learnable band
VERSIONS_DRAWN = 20  # the pools-by-version chart draws the last this many versions (the table all)
MOVED_SHOWN = 200  # rows of the moved-tasks table


def pool_of(pass_rate: float) -> str:
    if pass_rate <= LOW:
        return "unsolved"
    if pass_rate >= HIGH:
        return "mastered"
    return "learnable"


@dataclass
class Moved:
    ability: str
    env_id: str
    before: str
    after: str
    pass_rate: float
    episodes: int


@dataclass
class VersionRow:
    """Pools at one policy version, and each played pool's net change from the version before."""

    version: int
    at: float
    pools: dict[str, int]
    change: dict[str, int]


@dataclass
class CurriculumView:
    pools: dict[str, int]
    played: int
    episodes: int
    zero_variance_tasks: float  # over the whole run, per task: not per (task, policy version)
    pool_chart: plots.BarChart
    pass_rates: plots.BarChart
    versions: list[VersionRow]
    version_chart: plots.StackedChart
    history_note: str  # why there is no history, from the runtime ("" when there is)
    moved: list[Moved]
    moved_total: int


class LibrarySize:
    """How many tasks the sampler can draw from, read with one SampleTasks (its pools' sum) and kept
    for `TTL_S`: a library's size changes with an import, not with each page; a run's own pools are
    counted from its played tasks on every page (what is not played is unseen)."""

    TTL_S = 300.0

    def __init__(self) -> None:
        self._held: tuple[float, int] | None = None

    async def tasks(self, client: AsyncRuntimeClient) -> int:
        now = time.monotonic()
        if self._held is None or now - self._held[0] > self.TTL_S:
            sampled = await client.sample_tasks(f"{CONSOLE_RUN}-size", 1, seed=1)
            self._held = (now, sum(int(n) for n in sampled.pools.values()))
        return self._held[1]


LIBRARY_SIZE = LibrarySize()


async def curriculum_view(client: AsyncRuntimeClient, run_id: str) -> CurriculumView:
    total, stats, (history, history_note) = await asyncio.gather(
        LIBRARY_SIZE.tasks(client), client.stats(run_id, played_only=True), run_history(client, run_id)
    )
    played = [entry.task for entry in stats if entry.HasField("task") and entry.task.episodes]
    pools = {pool: sum(1 for task in played if task.pool == pool) for pool in PLAYED_POOLS}
    pools = {"unseen": max(0, total - len(played)), **pools}
    multi = [task for task in played if task.episodes >= 2]
    zero = sum(1 for task in multi if task.passes in (0, task.episodes))
    moved = [m for m in (moved_from_prior(task) for task in played) if m is not None]
    versions = version_rows(history, total)
    return CurriculumView(
        pools=pools,
        played=len(played),
        episodes=sum(task.episodes for task in played),
        zero_variance_tasks=zero / len(multi) if multi else 0.0,
        pool_chart=plots.bar_chart(
            "tasks per pool now", [(p, float(pools[p])) for p in POOLS], css=[f"pool-{p}" for p in POOLS]
        ),
        pass_rates=plots.histogram("played tasks by pass rate", [task.pass_rate for task in played]),
        versions=versions,
        version_chart=plots.stacked_chart(
            "played tasks by pool at each policy version",
            [
                (str(row.version), [(p, float(row.pools[p])) for p in PLAYED_POOLS])
                for row in versions[-VERSIONS_DRAWN:]
            ],
        ),
        history_note=history_note,
        moved=moved[:MOVED_SHOWN],
        moved_total=len(moved),
    )


async def run_history(client: AsyncRuntimeClient, run_id: str) -> tuple[list[rt.RunHistoryPoint], str]:
    """The run's history, or none and the runtime's reason (a run it has not recorded yet, or a
    runtime started with --no-record: both are `InvalidRequest`, and the page shows which)."""
    try:
        return await client.run_history(run_id), ""
    except InvalidRequest as exc:
        return [], exc.details() or ""


def moved_from_prior(task: rt.TaskStats) -> Moved | None:
    """The task if the run's episodes put it in another pool than its published prior did."""
    if not task.HasField("prior_pass_rate") or task.pool not in PLAYED_POOLS:
        return None
    before = pool_of(task.prior_pass_rate)
    if before == task.pool:
        return None
    return Moved(task.ability, task.env_id, before, task.pool, task.pass_rate, task.episodes)


def version_rows(history: list[rt.RunHistoryPoint], total: int) -> list[VersionRow]:
    """`RunHistory`'s points as table rows, oldest first, unseen being the library less the played."""
    rows: list[VersionRow] = []
    for point in history:
        pools = {
            "unseen": max(0, total - int(point.played)),
            "learnable": int(point.learnable),
            "mastered": int(point.mastered),
            "unsolved": int(point.unsolved),
        }
        before = rows[-1].pools if rows else dict.fromkeys(POOLS, 0)
        change = {p: pools[p] - before[p] for p in PLAYED_POOLS}
        rows.append(VersionRow(int(point.policy_version), float(point.at), pools, change))
    return rows

"""The Curriculum page's figures for one run, from what the runtime's API serves cheaply:

- `RunHistory`: the run's played tasks by pool (learnable, mastered, unsolved) as they stood at
  each policy version it reached (the record's bounded history, 1,000 versions per run), and as
  they stand now with their recent pass rates in bands: counts the record keeps as it is written,
  so the page costs the same for a run of ten played tasks or of eighty thousand; unseen is the
  library's size less the played tasks. Per version too, counted the same way:
  - its (task, policy version) groups, open ones included, and of those with two episodes or more
    the share whose rewards are all equal (zero variance: no GRPO advantage). A version's groups
    are counted as their episodes reach the record, so the newest versions' shares may still move;
  - its tasks that moved pools during the version (each task once: its pool when the version
    began against its pool at the version's end, or now), as from -> to counts;
- `Stats` of the run with `played_only` and `tasks_only` (indexed: it reads the played tasks'
  rows, not the library's), for a run of at most `PER_TASK_MAX` played tasks only: its episodes
  and, by name, the played tasks whose own episodes placed them away from their published prior;
  a larger run's page says how to list them;
- the library's size, from `RunHistory` too (a runtime that predates it: one `SampleTasks`, its
  pools' sum, kept for 5 minutes).

A runtime that predates `RunHistory`'s counts now is read as before: the pools and the pass-rate
histogram from every played task's `Stats` line; one that predates its groups and moves gives
none (the tables say "none"). Groups are a run's: the record keeps none for every run together.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import grpc

from codegym_client.api.runtime.v1 import runtime_service_pb2 as rt
from codegym_client.async_client import AsyncRuntimeClient
from services.console import plots
from services.console.plays import CONSOLE_RUN

POOLS = ("unseen", "learnable", "mastered", "unsolved")
PLAYED_POOLS = POOLS[1:]
LOW, HIGH = 0.0, 1.0  # the sampler's default learnable band
VERSIONS_DRAWN = 20  # the by-version charts draw the last this many versions
VERSIONS_LISTED = 100  # and their tables list the last this many (`?versions=all`: every one kept)
MOVED_SHOWN = 200  # rows of the moved-from-prior table
# Played tasks up to which the page reads each one's Stats line (a page's bounded work): past it,
# the per-task figures are left to `codegym library stats --run R --played-only`.
PER_TASK_MAX = 1_000
# RunHistory's recent pass-rate bands, lowest first (the codegym_record_tasks gauge's).
RECENT_BANDS = ("0", "0.00-0.25", "0.25-0.50", "0.50-0.75", "0.75-1.00", "1")


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
    """One policy version: pools then and each played pool's net change from the version before;
    its groups; its tasks that moved pools ((from, to, tasks), the largest first)."""

    version: int
    at: float
    pools: dict[str, int]
    change: dict[str, int]
    groups: int = 0
    multi: int = 0  # groups of two episodes or more
    zero: int = 0  # of those, rewards all equal
    moves: list[tuple[str, str, int]] = field(default_factory=list)

    @property
    def zero_share(self) -> float | None:
        """The share of its groups of two episodes or more whose rewards are all equal (None: none)."""
        return self.zero / self.multi if self.multi else None

    @property
    def moved(self) -> int:
        return sum(n for _, _, n in self.moves)


@dataclass
class Groups:
    """The by-version figures of groups and moves, drawn (the last `VERSIONS_DRAWN` versions)."""

    zero_chart: plots.BarChart  # the zero-variance share of each drawn version that has one
    zero_share: float | None  # over every version kept: zero-variance groups of all multi-episode ones
    groups: int  # over every version kept
    multi: int  # of those, of two episodes or more
    moves_chart: plots.StackedChart  # tasks that moved into each played pool, per drawn version


def moved_into(row: VersionRow, pool: str) -> int:
    return sum(n for _, to, n in row.moves if to == pool)


def groups_of(versions: list[VersionRow]) -> Groups:
    drawn = versions[-VERSIONS_DRAWN:]
    multi = sum(row.multi for row in versions)
    return Groups(
        zero_chart=plots.bar_chart(
            "zero-variance share of the groups of 2+ episodes at each policy version",
            [(str(row.version), row.zero_share) for row in drawn if row.zero_share is not None],
            percent=True,
            scale=1.0,
        ),
        zero_share=sum(row.zero for row in versions) / multi if multi else None,
        groups=sum(row.groups for row in versions),
        multi=multi,
        moves_chart=plots.stacked_chart(
            "tasks that moved into each pool during each policy version",
            [(str(row.version), [(p, float(moved_into(row, p))) for p in PLAYED_POOLS]) for row in drawn],
        ),
    )


@dataclass
class PerTask:
    """What the run's played tasks' Stats lines give (a run of at most `PER_TASK_MAX` of them)."""

    episodes: int
    moved: list[Moved]  # away from their published prior
    moved_total: int


@dataclass
class CurriculumView:
    pools: dict[str, int]
    played: int
    pool_chart: plots.BarChart
    pass_rates: plots.BarChart
    versions: list[VersionRow]
    listed: list[VersionRow]  # the table's rows: the last `VERSIONS_LISTED`, or every one
    version_chart: plots.StackedChart
    groups: Groups
    history_note: str  # why there is no history, from the runtime ("" when there is)
    per_task: PerTask | None  # None: the run has played more than PER_TASK_MAX tasks
    per_task_max: int = PER_TASK_MAX


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


async def curriculum_view(
    client: AsyncRuntimeClient, run_id: str, versions_listed: int = VERSIONS_LISTED
) -> CurriculumView:
    """The run's page; its pools-by-version table lists the last `versions_listed` versions (0:
    every one the record keeps)."""
    history, now, bands, library_tasks, history_note = await run_history(client, run_id)
    total = library_tasks or await LIBRARY_SIZE.tasks(client)
    played_tasks = None
    if now is None or now.played <= PER_TASK_MAX:  # none played (or unrecorded): nothing to read
        played_tasks = await played_stats(client, run_id) if now is None or now.played else []
    if now is not None:
        counted = {
            "learnable": int(now.learnable),
            "mastered": int(now.mastered),
            "unsolved": int(now.unsolved),
        }
        played = int(now.played)
        pass_rates = plots.bar_chart(
            "played tasks by the pass rate of their last 32 episodes",
            [(band, float(bands.get(band, 0))) for band in RECENT_BANDS],
        )
    else:  # a runtime that predates the counts now: every played task's line
        assert played_tasks is not None
        counted = {pool: sum(1 for task in played_tasks if task.pool == pool) for pool in PLAYED_POOLS}
        played = len(played_tasks)
        pass_rates = plots.histogram("played tasks by pass rate", [task.pass_rate for task in played_tasks])
    pools = {"unseen": max(0, total - played), **counted}
    versions = version_rows(history, total)
    return CurriculumView(
        listed=versions[-versions_listed:] if versions_listed else versions,
        pools=pools,
        played=played,
        pool_chart=plots.bar_chart(
            "tasks per pool now", [(p, float(pools[p])) for p in POOLS], css=[f"pool-{p}" for p in POOLS]
        ),
        pass_rates=pass_rates,
        versions=versions,
        version_chart=plots.stacked_chart(
            "played tasks by pool at each policy version",
            [
                (str(row.version), [(p, float(row.pools[p])) for p in PLAYED_POOLS])
                for row in versions[-VERSIONS_DRAWN:]
            ],
        ),
        groups=groups_of(versions),
        history_note=history_note,
        per_task=per_task(played_tasks) if played_tasks is not None else None,
    )


def per_task(played: list[rt.TaskStats]) -> PerTask:
    moved = [m for m in (moved_from_prior(task) for task in played) if m is not None]
    return PerTask(
        episodes=sum(task.episodes for task in played),
        moved=moved[:MOVED_SHOWN],
        moved_total=len(moved),
    )


async def played_stats(client: AsyncRuntimeClient, run_id: str) -> list[rt.TaskStats]:
    """The run's played tasks' Stats lines (tasks only: no environment's line is read)."""
    request = rt.StatsRequest(run_id=run_id, played_only=True, tasks_only=True)
    entries = client.stub.Stats(request, timeout=max(client.timeout_s, 60.0))
    return [entry.task async for entry in entries if entry.HasField("task") and entry.task.episodes]


History = tuple[list[rt.RunHistoryPoint], rt.RunHistoryPoint | None, dict[str, int], int, str]


async def run_history(client: AsyncRuntimeClient, run_id: str) -> History:
    """The run's history, its pools now (None from a runtime that predates them), its recent
    pass-rate bands and the library's tasks (0: not said); or none and the runtime's reason (a
    run it has not recorded yet, or a runtime started with --no-record: both refused as invalid,
    and the page shows which)."""
    try:
        answer = await client.stub.RunHistory(rt.RunHistoryRequest(run_id=run_id), timeout=client.timeout_s)
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.INVALID_ARGUMENT:
            raise
        return [], rt.RunHistoryPoint(), {}, 0, exc.details() or ""
    now = answer.now if answer.HasField("now") else None
    return list(answer.points), now, dict(answer.recent_pass_rates), int(answer.library_tasks), ""


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
        moves = sorted(
            ((m.from_pool, m.to_pool, int(m.tasks)) for m in point.moves), key=lambda m: (-m[2], m[0], m[1])
        )
        rows.append(
            VersionRow(
                int(point.policy_version),
                float(point.at),
                pools,
                change,
                int(point.groups),
                int(point.multi_episode_groups),
                int(point.zero_variance_groups),
                moves,
            )
        )
    return rows

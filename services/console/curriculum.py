"""The Curriculum page's figures for one run, from the runtime's record (`Stats` of the run's
played tasks, the library's size from `SampleTasks`, and the run's bounded history `RunHistory` where the runtime has it):

- the size of each pool (unseen, learnable, mastered, unsolved), now (the played tasks' pools, the
  rest unseen) and per policy version;
- the distribution of the played tasks' pass rates;
- the share of zero-variance groups: a task's episodes under one policy version whose rewards are
  all equal teach a group-relative method nothing (from the record: a task whose played episodes
  all passed or all failed);
- the tasks that moved pools: a task the published prior put in one pool that the run's own
  episodes have put in another.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from codegym_client.api.runtime.v1 import runtime_service_pb2 as rt
from codegym_client.async_client import AsyncRuntimeClient
from services.console import plots
from services.console.plays import CONSOLE_RUN

POOLS = ("unseen", "learnable", "mastered", "unsolved")
LOW, HIGH = 0.0, 1.0  # the sampler's default learnable band


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
class CurriculumView:
    pools: dict[str, int]
    played: int
    episodes: int
    zero_variance: float
    pool_chart: plots.BarChart
    pass_rates: plots.BarChart
    by_version: list[tuple[int, int, float]]  # policy version, tasks last played there, their mean pass rate
    version_chart: plots.BarChart
    moved: list[Moved]
    history: list[Any]


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
    total, stats = await asyncio.gather(LIBRARY_SIZE.tasks(client), client.stats(run_id, played_only=True))
    tasks = [entry.task for entry in stats if entry.HasField("task")]
    played = [task for task in tasks if task.episodes]
    pools = {pool: sum(1 for task in played if task.pool == pool) for pool in POOLS}
    pools["unseen"] = max(0, total - sum(n for pool, n in pools.items() if pool != "unseen"))
    zero = sum(1 for task in played if task.episodes >= 2 and task.passes in (0, task.episodes))
    multi = sum(1 for task in played if task.episodes >= 2)
    versions: dict[int, list[float]] = {}
    for task in played:
        versions.setdefault(task.last_policy_version, []).append(task.pass_rate)
    by_version = sorted((v, len(r), sum(r) / len(r)) for v, r in versions.items())
    moved = []
    for task in played:
        if not task.HasField("prior_pass_rate") or task.pool not in POOLS:
            continue
        before = pool_of(task.prior_pass_rate)
        if before != task.pool and task.pool != "unseen":
            moved.append(Moved(task.ability, task.env_id, before, task.pool, task.pass_rate, task.episodes))
    history: list[Any] = []
    if hasattr(client.stub, "RunHistory"):
        answer = await client.stub.RunHistory(
            rt.RunHistoryRequest(run_id=run_id),  # type: ignore[attr-defined,unused-ignore]
            timeout=client.timeout_s,
        )
        history = list(getattr(answer, "versions", []) or getattr(answer, "points", []))
    return CurriculumView(
        pools=pools,
        played=len(played),
        episodes=sum(task.episodes for task in played),
        zero_variance=zero / multi if multi else 0.0,
        pool_chart=plots.bar_chart(
            "tasks per pool", [(p, float(pools[p])) for p in POOLS], css=[f"pool-{p}" for p in POOLS]
        ),
        pass_rates=plots.histogram("played tasks by pass rate", [task.pass_rate for task in played]),
        by_version=by_version,
        version_chart=plots.bar_chart(
            "mean pass rate by the policy version that last played a task",
            [(str(v), mean) for v, _, mean in by_version[-20:]],
            percent=True,
        ),
        moved=moved[:200],
        history=history,
    )

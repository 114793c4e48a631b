"""A run's (task, policy version) groups and its tasks that moved pools, per policy version
(services/runtime/tallies.py, `account`): what the Curriculum page's zero-variance share and pool
moves are read from.

Episodes go through the real `Recorder` into the SQLite store and a real redis-server, GRPO-like:
groups of 8 per task across 3 policy versions, some with every reward equal. The history both
stores give must be the same, and equal to what the episodes say when counted by hand; episodes
of one group split between two recorders (two replicas on one Redis) count as from one; a late
episode of an old version counts as its version's group (or, past the kept versions, as a group
of its own); the bodies stay bounded.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest

from codegym_client.curriculum import DEFAULT_MIN_EPISODES, Band
from services.runtime.episode_record import EpisodeOutcome, Recorder, RecordStore, task_key, task_scope
from services.runtime.record_store import RedisRecordStore, SqliteRecordStore
from services.runtime.tallies import GROUP_VERSIONS, POOL_WINDOW, HistoryPoint, TaskTally
from tests.helpers.servers import Redis

RUN = "grpo"
GROUP = 8
# Per task, the rewards of its group at policy versions 1, 2 and 3 (None: not played at that
# version; a single reward: a group of one).
PLAN: dict[str, list[list[float] | None]] = {
    "A": [[0.0] * GROUP, [0.0] * 4 + [1.0] * 4, [1.0] * GROUP],  # unsolved, learnable, mastered
    "B": [[1.0] * GROUP, [1.0] * GROUP, [1.0] * 7 + [0.0]],  # mastered twice, then one failure
    "C": [[0.5] * GROUP, None, [0.5] * GROUP],  # a partial reward, every one equal: zero variance
    "D": [[0.25, 0.75] * 4, [0.0] * GROUP, None],
    "E": [None, [1.0], [0.0, 0.0]],  # a group of one, then of two
    "F": [[0.0] * 3 + [1.0] * 5, [0.1] * 3 + [0.30000000000000004] * 5, [0.0] * GROUP],
}
VERSIONS = (1, 2, 3)


def key(task: str) -> str:
    return task_key(f"Env{task}", "{}")


def outcome(task: str, version: int, reward: float, n: int, run: str = RUN) -> EpisodeOutcome:
    return EpisodeOutcome(f"{task}-{version}-{n}", f"Env{task}", "{}", run, version, reward, 3, "done")


def episodes(plan: dict[str, list[list[float] | None]]) -> Iterator[tuple[int, list[EpisodeOutcome]]]:
    """Each version's episodes, interleaved across tasks the way a batch of groups ends."""
    for i, version in enumerate(VERSIONS):
        batch = [
            outcome(task, version, reward, n)
            for task, groups in plan.items()
            if groups[i] is not None
            for n, reward in enumerate(groups[i] or [])
        ]
        random.Random(version).shuffle(batch)
        yield version, batch


def pool_after(outcomes: list[bool]) -> str:
    """The band rule of codegym_client/curriculum.py over the task's last `POOL_WINDOW` episodes."""
    if not outcomes:
        return "unseen"
    window = outcomes[-POOL_WINDOW:]
    if len(window) < DEFAULT_MIN_EPISODES:
        return "learnable"
    return Band().place(sum(window) / len(window))


def by_hand(plan: dict[str, list[list[float] | None]]) -> dict[int, tuple[int, int, int, dict[str, int]]]:
    """Per version: groups, groups of two episodes or more, zero-variance groups, and the tasks
    that moved (their pool when the version began -> when it ended)."""
    out: dict[int, tuple[int, int, int, dict[str, int]]] = {}
    played: dict[str, list[bool]] = {task: [] for task in plan}
    for i, version in enumerate(VERSIONS):
        groups = [g for g in (plan[task][i] for task in plan) if g is not None]
        multi = [g for g in groups if len(g) >= 2]
        moves: Counter[str] = Counter()
        for task, rewards in plan.items():
            if rewards[i] is None:
                continue
            before = pool_after(played[task])
            played[task] += [r > 0 for r in rewards[i] or []]
            after = pool_after(played[task])
            if before != after:
                moves[f"{before}>{after}"] += 1
        zero = sum(1 for g in multi if len(set(g)) == 1)
        out[version] = (len(groups), len(multi), zero, dict(sorted(moves.items())))
    return out


def counts(points: list[HistoryPoint]) -> dict[int, tuple[int, int, int, dict[str, int]]]:
    return {
        p.version: (p.groups, p.multi_episode_groups, p.zero_variance_groups, p.moves)
        for p in points
        if p.groups or p.moves
    }


def run(coro: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    return asyncio.run(coro())


@pytest.fixture
def redis_url() -> Iterator[str]:
    server = Redis()
    try:
        yield server.url
    finally:
        server.stop()


def recorder(store: RecordStore) -> Recorder:
    return Recorder(store, lambda env_id, config: 0)


async def play(store: RecordStore, plan: dict[str, list[list[float] | None]], seed: int) -> None:
    """The plan's episodes through one recorder, flushed at random points within a version and
    at each version's end (the runtime flushes about once a second)."""
    rng = random.Random(seed)
    one = recorder(store)
    for _, batch in episodes(plan):
        for ended in batch:
            one.episode(ended)
            if rng.random() < 0.15:
                await one.flush()
        await one.flush()


def test_both_stores_count_grpo_groups_and_pool_moves_per_version_as_the_episodes_say(
    tmp_path: Path, redis_url: str
) -> None:
    expected = by_hand(PLAN)
    # What the plan holds, so the comparison cannot pass empty: zero-variance groups at each
    # version, a group of one, and tasks moving into every pool.
    assert [expected[v][2] for v in VERSIONS] == [3, 2, 4] and expected[2][:2] == (5, 4)
    moved_to = {name.split(">")[1] for v in VERSIONS for name in expected[v][3]}
    assert moved_to == {"learnable", "mastered", "unsolved"}

    async def scenario() -> None:
        for seed in range(3):
            sqlite = SqliteRecordStore(tmp_path / f"record-{seed}.sqlite")
            redis = RedisRecordStore(redis_url)
            try:
                await redis.redis.flushall()
                for store in (sqlite, redis):
                    await play(store, PLAN, seed)
                from_sqlite, from_redis = await sqlite.history(RUN), await redis.history(RUN)
                assert counts(from_sqlite) == expected, seed
                assert [(p.version, p.played, p.learnable, p.mastered, p.unsolved) for p in from_sqlite] == [
                    (p.version, p.played, p.learnable, p.mastered, p.unsolved) for p in from_redis
                ]
                assert counts(from_redis) == expected, seed
                # Every run's history has its pools but no groups: a version is one run's.
                assert counts(await sqlite.history("")) == {} and counts(await redis.history("")) == {}
                # Bounded: a body keeps its groups of the latest versions only.
                for store in (sqlite, redis):
                    for body in (await store.read(task_scope(RUN))).values():
                        assert len(TaskTally.of(body).groups) <= GROUP_VERSIONS
            finally:
                await sqlite.close()
                await redis.close()

    run(scenario)


def test_one_groups_episodes_from_two_replicas_count_as_from_one(redis_url: str) -> None:
    """Two recorders on one Redis (two runtime replicas), each holding half of every group, their
    flushes interleaved either way round: the history the one recorder gives."""

    async def scenario() -> None:
        alone = RedisRecordStore(redis_url, prefix="alone:")
        await play(alone, PLAN, seed=0)
        want = counts(await alone.history(RUN))
        assert want == by_hand(PLAN)
        await alone.close()
        for first in (0, 1):
            stores = [RedisRecordStore(redis_url, prefix=f"pair{first}:") for _ in range(2)]
            replicas = [recorder(store) for store in stores]
            for _, batch in episodes(PLAN):
                for n, ended in enumerate(batch):
                    replicas[n % 2].episode(ended)
                await replicas[first].flush()
                await replicas[1 - first].flush()
            assert counts(await stores[0].history(RUN)) == want, first
            for store in stores:
                await store.close()

    run(scenario)


def test_a_late_episode_joins_its_versions_group_and_past_the_kept_versions_counts_alone(
    tmp_path: Path, redis_url: str
) -> None:
    async def scenario() -> None:
        sqlite, redis = SqliteRecordStore(tmp_path / "r.sqlite"), RedisRecordStore(redis_url)
        try:
            for store in (sqlite, redis):
                one = recorder(store)
                for version in range(1, 7):  # two equal rewards per version: zero variance each
                    for n in range(2):
                        one.episode(outcome("A", version, 1.0, n))
                    await one.flush()
                history = {p.version: p for p in await store.history(RUN)}
                assert [(history[v].groups, history[v].zero_variance_groups) for v in range(1, 7)] == [
                    (1, 1)
                ] * 6
                one.episode(outcome("A", 4, 0.0, 9))  # version 4 is among the 4 kept (3..6): it joins
                one.episode(outcome("A", 1, 1.0, 9))  # version 1 is not: a group of its own
                await one.flush()
                history = {p.version: p for p in await store.history(RUN)}
                got = {
                    v: (history[v].groups, history[v].multi_episode_groups, history[v].zero_variance_groups)
                    for v in (1, 4)
                }
                assert got == {4: (1, 1, 0), 1: (2, 1, 1)}, store
                kept = TaskTally.of(await store.read_one(task_scope(RUN), key("A"))).groups
                assert [(g.version, g.episodes) for g in kept] == [(3, 2), (4, 3), (5, 2), (6, 2)]
        finally:
            await sqlite.close()
            await redis.close()

    run(scenario)


def test_an_episode_without_a_policy_version_or_a_finite_reward_makes_no_group(tmp_path: Path) -> None:
    async def scenario() -> None:
        store = SqliteRecordStore(tmp_path / "r.sqlite")
        try:
            one = recorder(store)
            one.episode(EpisodeOutcome("s1", "EnvA", "{}", RUN, None, 1.0, 3, "done"))
            one.episode(outcome("A", 2, float("nan"), 0))
            one.episode(outcome("A", 2, 1.0, 1))
            await one.flush()
            body = TaskTally.of(await store.read_one(task_scope(RUN), key("A")))
            assert body.episodes == 3 and [(g.version, g.episodes) for g in body.groups] == [(2, 1)]
            assert counts(await store.history(RUN)) == {2: (1, 0, 0, {"unseen>learnable": 1})}
        finally:
            await store.close()

    run(scenario)

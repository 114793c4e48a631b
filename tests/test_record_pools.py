"""The sampler's pools, kept incrementally and drawn from a summary of the library, against a full
recomputation: every task of the library placed from the whole record by the rules of
services/runtime/curriculum.py's docstring, as the sampler did before it kept indexes.

Random histories (seeded: a failing seed replays) of episodes and failed steps over a library of
a few hundred tasks, written by the runtime's `Recorder` into SQLite and into a real redis-server;
random bands, prefixes and seeds; the library's draw made smaller than the library, so the drawn
path is what is checked. No jail: the sampler reads the record and the library only.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from codegym.library.records import TaskRecord
from codegym.library.store import Library
from codegym_client.api.runtime.v1 import runtime_service_pb2 as rt
from codegym_client.curriculum import Band
from services.runtime import curriculum
from services.runtime.catalog import Catalog
from services.runtime.episode_record import (
    ENV_SCOPE,
    EpisodeOutcome,
    Recorder,
    RecordStore,
    task_key,
    task_scope,
)
from services.runtime.record_desk import RecordDesk
from services.runtime.record_store import RedisRecordStore, SqliteRecordStore
from services.runtime.tallies import POOL_WINDOW, EnvTally, TaskTally
from services.runtime.task_draws import prior_of
from tests.helpers.libraries import SAMPLE_LIBRARY, build_library
from tests.helpers.servers import Redis

CONFIGS_PER_ENV = 30


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sample environments, each with `CONFIGS_PER_ENV` more configs, a third without a prior."""
    path = build_library(tmp_path_factory.mktemp("pools") / "library.db", SAMPLE_LIBRARY)
    rng = random.Random("library")
    with Library(path) as lib:
        env_ids = [record.env_id for record in lib.iter_envs(tasks=False)]
        for env_id in env_ids:
            extra = []
            for i in range(CONFIGS_PER_ENV):
                scores = (
                    {} if rng.random() < 0.33 else {"qwen32b_Bo4_score": rng.choice((0.0, 0.25, 0.5, 1.0))}
                )
                extra.append(TaskRecord(env_id, json.dumps({"bench": i}), scores=scores))
            lib.add_tasks(extra)
    return path


def all_tasks(library: Path) -> list[TaskRecord]:
    with Library(library, read_only=True) as lib:
        return list(lib.iter_tasks())


def full_pools(
    tasks: list[TaskRecord], bodies: dict[str, dict[str, dict[str, Any]]], run: str, band: Band, prefix: str
) -> dict[str, str]:
    """Every task's pool (ability → pool), from the whole record, by the documented rules."""
    run_bodies, everyone, envs = (
        bodies.get(task_scope(run), {}),
        bodies.get(task_scope(""), {}),
        bodies.get(ENV_SCOPE, {}),
    )
    out = {}
    for task in tasks:
        if not task.env_id.startswith(prefix):
            continue
        key = task_key(task.env_id, task.config_json)
        mine, all_runs = TaskTally.of(run_bodies.get(key)), TaskTally.of(everyone.get(key))
        if EnvTally.of(envs.get(task.env_id)).quarantine_reason():
            pool = "quarantined"
        elif mine.episodes > 0:
            seen, rate = mine.recent_rate(POOL_WINDOW)
            pool = band.place(rate) if seen >= band.min_episodes else "learnable"
        elif (
            all_runs.episodes >= band.min_episodes
            and all_runs.recent_rate(POOL_WINDOW)[0] >= band.min_episodes
            and all_runs.recent_rate(POOL_WINDOW)[1] <= band.low
        ):
            pool = "unsolved"
        elif (prior := prior_of(task.scores)) is not None:
            pool = band.place(prior)
        else:
            pool = "unseen"
        out[task.ability] = pool
    return out


async def play_history(store: RecordStore, tasks: list[TaskRecord], seed: int) -> None:
    rng = random.Random(seed)
    recorder = Recorder(store, lambda env_id, config: 0)
    skill = {t.ability: rng.choice((0.0, 0.0, 0.5, 1.0)) for t in tasks}
    for n in range(rng.randrange(20, 90)):
        task = rng.choice(tasks)
        run = rng.choice(("a", "b", "c"))
        for _ in range(rng.randrange(1, 9)):
            passed = rng.random() < skill[task.ability]
            recorder.step(task.env_id, task.config_json, run, None)
            outcome = EpisodeOutcome(f"s{n}", task.env_id, task.config_json, run, n, float(passed), 1, "done")
            recorder.episode(outcome)
        if rng.random() < 0.05:  # an environment failing its steps: quarantined past 20 steps at 50 %
            for _ in range(rng.randrange(10, 30)):
                recorder.step(task.env_id, task.config_json, run, "env_error", "boom")
        if rng.random() < 0.3:
            await recorder.flush()
    await recorder.flush()


@pytest.fixture(params=["sqlite", "redis"])
def store_kind(request: pytest.FixtureRequest) -> Iterator[str]:
    yield request.param


def test_pools_and_choices_equal_a_full_recomputation_on_random_histories(
    library: Path, tmp_path: Path, store_kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(curriculum, "MIN_DRAW", 40)  # draw fewer than the library holds
    monkeypatch.setattr(curriculum, "DRAW_PER_TASK", 2)
    tasks = all_tasks(library)
    assert len(tasks) > 300
    env_prefixes = sorted({t.env_id[:12] for t in tasks})
    redis = Redis() if store_kind == "redis" else None

    async def scenario() -> None:
        for seed in range(6):
            store: RecordStore
            if redis is not None:
                await RedisRecordStore(redis.url).redis.flushall()
                store = RedisRecordStore(redis.url)
            else:
                store = SqliteRecordStore(tmp_path / f"record-{seed}.sqlite")
            try:
                await play_history(store, tasks, seed)
                desk = RecordDesk(Catalog(library), Recorder(store, lambda env_id, config: 0), max_batch=64)
                bodies = {
                    scope: await store.read(scope) for scope in [task_scope(r) for r in ("a", "b", "c", "")]
                }
                bodies[ENV_SCOPE] = await store.read(ENV_SCOPE)
                rng = random.Random(seed)
                for call in range(8):
                    low = rng.choice((0.0, 0.0, 0.2))
                    high = rng.choice((1.0, 1.0, 0.8))
                    min_episodes = rng.choice((0, 1, 2, 4, 6))
                    prefix = rng.choice(["", "", *env_prefixes])
                    run = rng.choice(("a", "b", "c", "nobody"))
                    n = rng.choice((1, 8, 30))
                    request = rt.SampleTasksRequest(
                        run_id=run,
                        n=n,
                        seed=call,
                        low=low,
                        high=high,
                        min_episodes=min_episodes,
                        env_prefix=prefix,
                    )
                    answer = await desk.sample(request)
                    expected = full_pools(tasks, bodies, run, Band.of(low, high, min_episodes), prefix)
                    what = (seed, call, request)
                    assert dict(answer.pools) == {k: v for k, v in Counter(expected.values()).items() if v}, (
                        what
                    )
                    chosen = [t.ability for t in answer.tasks]
                    assert len(set(chosen)) == len(chosen), what
                    for task in answer.tasks:
                        assert expected[task.ability] == task.pool != "quarantined", what
                    open_envs = Counter(
                        t.env_id for t in tasks if expected.get(t.ability, "quarantined") != "quarantined"
                    )
                    cap = max(2, -(-n // max(1, len(open_envs))))
                    assert len(chosen) == min(n, sum(min(cap, k) for k in open_envs.values())), what
                    again = await desk.sample(request)
                    assert [t.ability for t in again.tasks] == chosen, what  # the same seed, the same choice
            finally:
                await store.close()

    try:
        asyncio.run(scenario())
    finally:
        if redis is not None:
            redis.stop()


def test_stats_of_played_tasks_equal_the_walk_of_the_library(library: Path, tmp_path: Path) -> None:
    """`played_only` reads the played tasks by key; the walk of the whole library, filtered, must
    give the same lines in the same order."""
    tasks = all_tasks(library)

    async def scenario() -> tuple[list[rt.StatsResponse], list[rt.StatsResponse]]:
        store = SqliteRecordStore(tmp_path / "record.sqlite")
        try:
            await play_history(store, tasks, 11)
            desk = RecordDesk(Catalog(library), Recorder(store, lambda env_id, config: 0), max_batch=64)
            played = [e async for e in desk.stats(rt.StatsRequest(run_id="a", played_only=True))]
            walked = [e async for e in desk.stats(rt.StatsRequest(run_id="a"))]
            return played, walked
        finally:
            await store.close()

    played, walked = asyncio.run(scenario())
    keep = [e for e in walked if e.WhichOneof("entry") == "env" or e.task.episodes or e.task.step_errors]
    assert len([e for e in played if e.WhichOneof("entry") == "task"]) > 5
    assert played == keep


def test_stats_of_a_prefix_or_of_envs_only_equal_the_whole_records_lines_filtered(
    library: Path, tmp_path: Path, store_kind: str
) -> None:
    """An `env_prefix` reads only the record's rows under it, and `envs_only` no task's row; the
    lines must be those of the whole record's Stats (which reads every row), filtered."""
    tasks = all_tasks(library)
    envs = sorted({t.env_id for t in tasks})
    prefixes = [*sorted({env[:12] for env in envs}), envs[0], envs[-1], envs[0][:-1], "Nothing_"]
    redis = Redis() if store_kind == "redis" else None

    def entry_env(entry: rt.StatsResponse) -> str:
        return entry.task.env_id if entry.WhichOneof("entry") == "task" else entry.env.env_id

    async def scenario() -> None:
        store: RecordStore = (
            RedisRecordStore(redis.url) if redis is not None else SqliteRecordStore(tmp_path / "r.sqlite")
        )
        try:
            await play_history(store, tasks, 3)
            desk = RecordDesk(Catalog(library), Recorder(store, lambda env_id, config: 0), max_batch=64)
            for run in ("a", "", "nobody"):
                for played_only in (False, True):
                    whole = [
                        e async for e in desk.stats(rt.StatsRequest(run_id=run, played_only=played_only))
                    ]
                    assert any(e.WhichOneof("entry") == "env" for e in whole)
                    for prefix in prefixes:
                        request = rt.StatsRequest(run_id=run, played_only=played_only, env_prefix=prefix)
                        under = [e async for e in desk.stats(request)]
                        assert under == [e for e in whole if entry_env(e).startswith(prefix)], request
                    only = [e async for e in desk.stats(rt.StatsRequest(run_id=run, envs_only=True))]
                    assert only == [e for e in whole if e.WhichOneof("entry") == "env"]
                    request = rt.StatsRequest(run_id=run, played_only=played_only, tasks_only=True)
                    tasks_only = [e async for e in desk.stats(request)]
                    assert tasks_only == [e for e in whole if e.WhichOneof("entry") == "task"]
        finally:
            await store.close()

    try:
        asyncio.run(scenario())
    finally:
        if redis is not None:
            redis.stop()


def share_failed(env: rt.EnvStats) -> float:
    failed = sum(env.step_errors.values())
    return failed / max(env.steps, failed) if failed else 0.0


def test_the_worst_envs_are_the_quarantined_and_the_worst_others_the_worst_first(
    library: Path, tmp_path: Path, store_kind: str
) -> None:
    """`worst_envs` reads the errors index, not every environment: its lines must be the whole
    list's quarantined environments and its `worst_envs` worst by share of failed steps (ties: the
    greater id, as both stores rank them), ordered the worst first."""
    tasks = all_tasks(library)
    redis = Redis() if store_kind == "redis" else None

    async def scenario() -> None:
        store: RecordStore = (
            RedisRecordStore(redis.url) if redis is not None else SqliteRecordStore(tmp_path / "r.sqlite")
        )
        try:
            await play_history(store, tasks, 4)
            recorder = Recorder(store, lambda env_id, config: 0)
            some = list({t.env_id: t for t in tasks}.values())[:8]
            for n, task in enumerate(some):  # one failed step in n + 1 served: 8 distinct shares
                for _ in range(n):
                    recorder.step(task.env_id, task.config_json, "a", None)
                recorder.step(task.env_id, task.config_json, "a", "step_timeout", "slow")
            await recorder.flush()
            desk = RecordDesk(Catalog(library), Recorder(store, lambda env_id, config: 0), max_batch=64)
            every = [e.env async for e in desk.stats(rt.StatsRequest(envs_only=True))]
            ranked = sorted((e for e in every if share_failed(e)), key=lambda e: (share_failed(e), e.env_id))[
                ::-1
            ]
            assert len(ranked) >= 8 and any(e.quarantined for e in every)
            for k in (1, 3, 8, 1000):
                chosen = {e.env_id for e in ranked[:k]} | {e.env_id for e in every if e.quarantined}
                expected = sorted(
                    (e for e in every if e.env_id in chosen), key=lambda e: (-share_failed(e), e.env_id)
                )
                got = [e.env async for e in desk.stats(rt.StatsRequest(envs_only=True, worst_envs=k))]
                assert got == expected, k
        finally:
            await store.close()

    try:
        asyncio.run(scenario())
    finally:
        if redis is not None:
            redis.stop()


def test_run_history_says_the_runs_pools_and_recent_pass_rates_now_from_the_kept_counts(
    library: Path, tmp_path: Path
) -> None:
    from services.runtime.curriculum import gauge_bands
    from services.runtime.tallies import classes, pool_counts

    tasks = all_tasks(library)

    async def scenario() -> None:
        store = SqliteRecordStore(tmp_path / "r.sqlite")
        try:
            await play_history(store, tasks, 6)
            desk = RecordDesk(Catalog(library), Recorder(store, lambda env_id, config: 0), max_batch=64)
            for run in ("a", "b", ""):
                answer = await desk.history(rt.RunHistoryRequest(run_id=run))
                counted = Counter(
                    name for body in (await store.read(task_scope(run))).values() for name in classes(body)
                )
                pools = pool_counts(counted)
                now = (answer.now.played, answer.now.learnable, answer.now.mastered, answer.now.unsolved)
                assert now == (sum(pools.values()), pools["learnable"], pools["mastered"], pools["unsolved"])
                assert now[0] > 0 and dict(answer.recent_pass_rates) == gauge_bands(counted)
                assert answer.library_tasks == len(tasks)
                last = answer.points[-1]  # the last flush carried a policy version: its point is now
                assert (last.played, last.learnable, last.mastered, last.unsolved) == now
        finally:
            await store.close()

    asyncio.run(scenario())


def test_contradictory_stats_requests_are_refused_with_what_is_wrong(library: Path, tmp_path: Path) -> None:
    from codegym.errors import Refusal

    async def scenario() -> None:
        store = SqliteRecordStore(tmp_path / "r.sqlite")
        desk = RecordDesk(Catalog(library), Recorder(store, lambda env_id, config: 0), max_batch=4)
        try:
            for request, said in (
                (rt.StatsRequest(envs_only=True, tasks_only=True), "leave nothing to list"),
                (rt.StatsRequest(worst_envs=3), "give envs_only too"),
                (rt.StatsRequest(envs_only=True, worst_envs=3, env_prefix="Sample"), "give no env_prefix"),
                (rt.StatsRequest(envs_only=True, worst_envs=1001), "exceeds 1000"),
            ):
                with pytest.raises(Refusal, match=said):
                    _ = [e async for e in desk.stats(request)]
        finally:
            await store.close()

    asyncio.run(scenario())


def test_bad_sample_requests_are_refused_with_what_is_wrong(library: Path, tmp_path: Path) -> None:
    from codegym.errors import Refusal

    async def scenario() -> list[str]:
        store = SqliteRecordStore(tmp_path / "record.sqlite")
        desk = RecordDesk(Catalog(library), Recorder(store, lambda env_id, config: 0), max_batch=4)
        said = []
        try:
            for request in (
                rt.SampleTasksRequest(run_id="r", n=4, low=0.6, high=0.4),
                rt.SampleTasksRequest(run_id="r", n=4, explore=1.5),
                rt.SampleTasksRequest(run_id="r", n=4 * 64 + 1),
            ):
                with pytest.raises(Refusal) as refused:
                    await desk.sample(request)
                said.append(str(refused.value))
            assert await store.read(task_scope("r")) == {}
        finally:
            await store.close()
        return said

    said = asyncio.run(scenario())
    assert (
        "0 <= low < high <= 1" in said[0]
        and "explore must be between 0 and 1" in said[1]
        and "exceeds" in said[2]
    )


def test_the_gauges_count_what_a_walk_of_every_runs_record_gives(library: Path, tmp_path: Path) -> None:
    """`codegym_record_tasks{band}` and the quarantined gauge, refreshed from the kept counts, equal
    the bands of every run's tasks and the quarantined environments recomputed from the bodies."""
    from codegym.server.metrics import RECORD_QUARANTINED, RECORD_TASKS
    from services.runtime.tallies import BANDS

    tasks = all_tasks(library)

    async def scenario() -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
        store = SqliteRecordStore(tmp_path / "record.sqlite")
        try:
            await play_history(store, tasks, 5)
            desk = RecordDesk(Catalog(library), Recorder(store, lambda env_id, config: 0), max_batch=64)
            refresh = asyncio.get_running_loop().create_task(desk.gauges(every_s=3600))
            try:
                while RECORD_QUARANTINED._value.get() == -1:  # set last by the first refresh
                    await asyncio.sleep(0.01)
            finally:
                refresh.cancel()
            return await store.read(task_scope("")), await store.read(ENV_SCOPE)
        finally:
            await store.close()

    for band in BANDS:
        RECORD_TASKS.labels(band).set(-1)
    RECORD_QUARANTINED.set(-1)
    everyone, envs = asyncio.run(scenario())
    walked: Counter[str] = Counter()
    for body in everyone.values():
        seen, rate = TaskTally.of(body).recent_rate()
        if seen:
            quarter = min(3, int(rate * 4))
            walked[
                "0" if rate == 0 else "1" if rate == 1 else f"{quarter / 4:.2f}-{quarter / 4 + 0.25:.2f}"
            ] += 1
    assert {band: RECORD_TASKS.labels(band)._value.get() for band in BANDS} == {
        band: walked[band] for band in BANDS
    }
    assert sum(walked.values()) > 10
    quarantined = sum(1 for body in envs.values() if EnvTally.of(body).quarantine_reason())
    assert RECORD_QUARANTINED._value.get() == quarantined

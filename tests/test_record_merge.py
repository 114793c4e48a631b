"""The episode record's declaration drives both merges (Python for SQLite, generated Lua for Redis),
and the indexes kept beside the bodies always equal what a full recomputation gives.

Random histories of deltas, seeded (each seed names a history that can be replayed), are applied
to the SQLite store and to a real redis-server; the bodies, the pool index, the counts, the
quarantined environments and the history (with each version's group and move counts) must agree
with each other and with the bodies and counts recomputed from scratch by the declaration.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest

from services.runtime.episode_record import ALL_RUNS, ENV_SCOPE, task_scope
from services.runtime.record_store import RedisRecordStore, SqliteRecordStore
from services.runtime.tallies import (
    DECLARED,
    HISTORY_KEEP,
    MEASURING,
    EnvTally,
    Merge,
    TaskTally,
    UnknownField,
    account,
    classes,
    error_score,
    merge,
    pool_score,
    quarantined,
)
from tests.helpers.servers import Redis

Deltas = dict[tuple[str, str], dict[str, Any]]
RUNS = ("a", "b", "c")
TASKS = [f'E{n}@{{"k": {m}}}' for n in range(4) for m in range(3)]
ENVS = [f"E{n}" for n in range(4)]


def random_delta(rng: random.Random, schema: str) -> dict[str, Any]:
    """Some of a tally's fields, each with a value of its kind (windows and lists past their bound
    now and then; a reset of the environment's window now and then)."""
    delta: dict[str, Any] = {}
    for name, (kind, keep) in DECLARED[schema].items():
        if rng.random() < 0.5:
            continue
        if kind is Merge.COUNTER:
            delta[name] = rng.randrange(0, 4)
        elif kind is Merge.MAXIMUM:
            delta[name] = rng.randrange(0, 50)
        elif kind is Merge.WINDOW:
            marks = rng.choice(("0", "1", "01")) if schema == "task" else ".xxl"  # pools move now and then
            delta[name] = "".join(rng.choice(marks) for _ in range(rng.randrange(1, keep + 8)))
        elif kind is Merge.GROUPS:  # a few versions, past the kept ones now and then
            delta[name] = []
            for version in sorted(rng.sample(range(12), rng.randrange(0, keep + 2))):
                low, high = sorted(rng.choice((0.0, 0.25, 1.0, -1.5)) for _ in range(2))
                delta[name].append([version, rng.randrange(1, 9), low, high, ""])
        else:
            delta[name] = [f"m{rng.randrange(100)}" for _ in range(rng.randrange(0, keep + 3))]
    if schema == "env" and rng.random() < 0.1:
        delta["reset"] = ["window"]
    return delta


def random_history(seed: int, flushes: int = 12) -> list[Deltas]:
    rng = random.Random(seed)
    history = []
    for _ in range(flushes):
        deltas: Deltas = {}
        for _ in range(rng.randrange(1, 12)):
            if rng.random() < 0.3:
                deltas[(ENV_SCOPE, rng.choice(ENVS))] = random_delta(rng, "env")
            else:
                deltas[(task_scope(rng.choice([*RUNS, ""])), rng.choice(TASKS))] = random_delta(rng, "task")
        history.append(deltas)
    return history


def recomputed(
    history: list[Deltas],
) -> tuple[dict[str, dict[str, dict[str, Any]]], dict[str, dict[int, Counter[str]]]]:
    """Every scope's bodies from scratch, by the declaration, and each run's counts per version
    (the sum of what each merge changed)."""
    bodies: dict[str, dict[str, dict[str, Any]]] = {}
    counts: dict[str, dict[int, Counter[str]]] = {}
    for deltas in history:
        for (scope, key), delta in deltas.items():
            schema = "env" if scope == ENV_SCOPE else "task"
            held = bodies.setdefault(scope, {})
            old = held.get(key)
            body = held[key] = merge(schema, json.loads(json.dumps(old or {})), delta)
            if schema == "task":
                for version, names in account(old, body, delta).items():
                    counts.setdefault(scope.removeprefix("task:"), {}).setdefault(version, Counter()).update(
                        names
                    )
    return bodies, counts


def counts_of(bodies: dict[str, dict[str, Any]]) -> dict[str, int]:
    found: Counter[str] = Counter()
    for body in bodies.values():
        found.update(classes(body))
    return dict(found)


async def read_everything(store: Any) -> dict[str, Any]:
    scopes = [task_scope(run) for run in [*RUNS, ""]]
    return {
        "bodies": {scope: await store.read(scope) for scope in [*scopes, ENV_SCOPE]},
        "counts": {scope: await store.counts(scope) for scope in scopes},
        "learnable": {scope: sorted(await store.scored(scope, 0.01, 0.99)) for scope in scopes},
        "measuring": {scope: sorted(await store.scored(scope, MEASURING, MEASURING)) for scope in scopes},
        "quarantined": await store.quarantined(),
        "worst": await store.worst_envs(len(ENVS) + 1),
        "history": {
            run: [
                (p.version, p.played, p.learnable, p.mastered, p.unsolved, *counts_of_point(p))
                for p in await store.history(run)
            ]
            for run in [*RUNS, ""]
        },
    }


@pytest.fixture
def redis_url() -> AsyncIterator[str]:
    server = Redis()
    try:
        yield server.url
    finally:
        server.stop()


def counts_of_point(p: Any) -> tuple[Any, ...]:
    return (p.groups, p.multi_episode_groups, p.zero_variance_groups, p.moves)


def run(coro: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    return asyncio.run(coro())


def test_both_stores_merge_random_histories_by_the_declaration_and_index_them_exactly(
    tmp_path: Path, redis_url: str
) -> None:
    async def scenario() -> None:
        redis = RedisRecordStore(redis_url)
        try:
            for seed in range(25):
                await redis.redis.flushall()
                redis._indexed = False
                sqlite = SqliteRecordStore(tmp_path / f"record-{seed}.sqlite")
                history = random_history(seed)
                for deltas in history:
                    await sqlite.apply(deltas, {})
                    await redis.apply(deltas, {})
                from_sqlite, from_redis = await read_everything(sqlite), await read_everything(redis)
                await sqlite.close()
                expected, counted = recomputed(history)
                for got in (from_sqlite, from_redis):
                    for scope, bodies in got["bodies"].items():
                        assert bodies == expected.get(scope, {}), (seed, scope)
                    for scope, counts in got["counts"].items():
                        assert counts == counts_of(expected.get(scope, {})), (seed, scope)
                    for scope, keys in got["measuring"].items():
                        bodies = expected.get(scope, {})
                        assert keys == sorted(k for k, b in bodies.items() if pool_score(b) == MEASURING)
                    envs = expected.get(ENV_SCOPE, {})
                    assert got["quarantined"] == {env for env, body in envs.items() if quarantined(body)}, (
                        seed
                    )
                    scores = {env: error_score(body) for env, body in envs.items()}
                    worst = sorted(((r, env) for env, r in scores.items() if r is not None), reverse=True)
                    assert got["worst"] == [env for _, env in worst], (seed, scores)
                assert from_sqlite["learnable"] == from_redis["learnable"], seed
                for name, points in from_sqlite["history"].items():  # every counted version has a point
                    want = {
                        version: (
                            c["groups"],
                            c["multi"],
                            c["zero"],
                            {k: n for k, n in sorted(c.items()) if ">" in k},
                        )
                        for version, c in ((v, +c) for v, c in counted.get(name or ALL_RUNS, {}).items())
                        if c
                    }
                    assert {p[0]: p[5:] for p in points if p[5] or p[8]} == want, (seed, name)
                assert from_sqlite["history"].keys() == from_redis["history"].keys()
                for name in from_sqlite["history"]:  # the same points (`at` aside)
                    assert from_sqlite["history"][name] == from_redis["history"][name], (seed, name)
        finally:
            await redis.close()

    run(scenario)


def test_a_tally_is_read_by_its_declared_fields() -> None:
    task = TaskTally.of({"episodes": 3, "passes": 2, "recent": "011", "version": 9})
    assert (task.episodes, task.passes, task.version, task.recent_rate()) == (3, 2, 9, (3, 2 / 3))
    env = EnvTally.of({"window": "x" * 20, "env_error": 20, "steps": 20, "recent_errors": ["boom"]})
    assert env.recent_errors == ("boom",) and "20 of its last 20 steps failed" in env.quarantine_reason()
    assert EnvTally.of({"window": "x" * 19}).quarantine_reason() == ""


def test_a_field_the_declaration_lacks_is_refused_by_both_merges_and_nothing_is_written(
    tmp_path: Path, redis_url: str
) -> None:
    with pytest.raises(UnknownField, match="no field 'bogus'"):
        merge("task", {}, {"bogus": 1})
    with pytest.raises(UnknownField, match="no field 'window'"):
        merge("task", {}, {"window": "."})  # an environment's field on a task

    async def scenario() -> None:
        sqlite, redis = SqliteRecordStore(tmp_path / "r.sqlite"), RedisRecordStore(redis_url)
        good = {(task_scope("r"), "E@{}"): {"episodes": 1}}
        try:
            for store in (sqlite, redis):
                with pytest.raises(Exception, match="no field 'bogus'"):
                    await store.apply({**good, (task_scope("r"), "F@{}"): {"bogus": 1}}, {"r": 1.0})
                assert await store.read(task_scope("r")) == {}, store
        finally:
            await sqlite.close()
            await redis.close()

    run(scenario)


def test_a_runs_history_keeps_its_last_versions_only(tmp_path: Path, redis_url: str) -> None:
    extra = 7

    async def scenario() -> None:
        sqlite, redis = SqliteRecordStore(tmp_path / "r.sqlite"), RedisRecordStore(redis_url)
        try:
            for store in (sqlite, redis):
                for version in range(HISTORY_KEEP + extra):
                    recent = "1" if version % 2 else "0"
                    group = [version, 2, 1.0, 1.0, ""]
                    delta = {"episodes": 1, "recent": recent, "version": version, "groups": [group]}
                    await store.apply({(task_scope("r"), "E@{}"): delta}, {})
                points = await store.history("r")
                assert [p.version for p in points] == list(range(extra, HISTORY_KEEP + extra)), store
                assert points[-1].played == 1 and points[-1].learnable == 1
                assert {(p.groups, p.zero_variance_groups) for p in points} == {(1, 1)}
                assert await store.history("nobody") == []
            # The counts of versions the history no longer keeps went with them.
            assert sqlite.db.execute("SELECT COUNT(DISTINCT version) FROM version_counts").fetchone() == (
                HISTORY_KEEP,
            )
            assert await redis.redis.hlen(redis.versions_key(task_scope("r"))) == HISTORY_KEEP
        finally:
            await sqlite.close()
            await redis.close()

    run(scenario)


def test_a_record_indexed_before_the_errors_index_gets_it_when_opened(tmp_path: Path, redis_url: str) -> None:
    """A record whose indexes predate the environments' errors index (marked "1") is indexed again
    when opened: an environment with failed steps is then among the worst."""
    failing = {"steps": 10, "env_error": 3, "window": ".......xxx"}

    async def scenario() -> None:
        sqlite = SqliteRecordStore(tmp_path / "old.sqlite")
        await sqlite.apply({(ENV_SCOPE, "Bad"): failing, (ENV_SCOPE, "Good"): {"steps": 4}}, {})
        sqlite.db.execute("DELETE FROM env_errors")
        sqlite.db.execute("UPDATE record_meta SET value = '1' WHERE name = 'indexed'")
        await sqlite.close()
        reopened = SqliteRecordStore(tmp_path / "old.sqlite")
        redis = RedisRecordStore(redis_url)
        await redis.redis.flushall()
        await redis.redis.hset(
            redis.hash(ENV_SCOPE), mapping={"Bad": json.dumps(failing), "Good": '{"steps":4}'}
        )
        await redis.redis.set(redis.indexed_key, "1")
        try:
            for store in (reopened, redis):
                assert await store.worst_envs(5) == ["Bad"], store
        finally:
            await reopened.close()
            await redis.close()

    run(scenario)


def test_a_record_written_before_the_indexes_is_indexed_when_opened(tmp_path: Path, redis_url: str) -> None:
    """A record file or Redis from the release before: bodies only. Opening it builds the indexes."""
    body = {"episodes": 5, "recent": "11111"}

    async def scenario() -> None:
        sqlite = SqliteRecordStore(tmp_path / "old.sqlite")
        sqlite.db.execute("DELETE FROM record_meta")
        sqlite.db.execute(
            "INSERT INTO tallies (scope, key, body) VALUES (?, ?, ?)",
            (task_scope(ALL_RUNS), "E@{}", '{"episodes":5,"recent":"11111"}'),
        )
        await sqlite.close()
        reopened = SqliteRecordStore(tmp_path / "old.sqlite")
        redis = RedisRecordStore(redis_url)
        await redis.redis.hset(redis.hash(task_scope("")), "E@{}", '{"episodes":5,"recent":"11111"}')
        try:
            for store in (reopened, redis):
                assert await store.counts(task_scope("")) == counts_of({"E@{}": body}), store
                assert await store.read(task_scope("")) == {"E@{}": body}
        finally:
            await reopened.close()
            await redis.close()

    run(scenario)


def test_a_prefix_reads_exactly_the_keys_under_it_in_both_stores(tmp_path: Path, redis_url: str) -> None:
    """`read_prefix` (an environment's page: its own rows, not the scope's) gives what filtering the
    whole scope gives, for prefixes with glob and range edge characters: a neighbour whose id only
    continues the prefix's last character is left out, and a key holding `*` or `[` is matched as
    text."""
    envs = [
        "Env_1",
        "Env_10",
        "Env_1x",
        "Env_2",
        "Env_*",
        "Env_[a]",
        "Env_?",
        "Env_\\",
        "Env_\U0010ffff",
        "Env_\ud7ff",
    ]
    keys = [f'{env}@{{"k": {m}}}' for env in envs for m in range(2)]
    prefixes = [
        "",
        "Env_1",
        "Env_1@",
        "Env_",
        "Env_*",
        "Env_[",
        "Env_?",
        "Env_\\",
        "Env_\U0010ffff",
        "Env_\ud7ff",
        "Nope",
    ]

    async def scenario() -> None:
        sqlite, redis = SqliteRecordStore(tmp_path / "r.sqlite"), RedisRecordStore(redis_url)
        try:
            for store in (sqlite, redis):
                await store.apply({(task_scope("r"), key): {"episodes": 1} for key in keys}, {"r": 1.0})
                await store.apply({(ENV_SCOPE, env): {"steps": 2} for env in envs}, {})
                for scope in (task_scope("r"), ENV_SCOPE):
                    whole = await store.read(scope)
                    for prefix in prefixes:
                        wanted = {k: v for k, v in whole.items() if k.startswith(prefix)}
                        assert await store.read_prefix(scope, prefix) == wanted, (store, scope, prefix)
                assert set(await store.read_prefix(task_scope("r"), "Env_1@")) == {
                    'Env_1@{"k": 0}',
                    'Env_1@{"k": 1}',
                }
        finally:
            await sqlite.close()
            await redis.close()

    run(scenario)

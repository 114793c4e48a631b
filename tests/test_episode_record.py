"""The runtime's record of served episodes, and the curriculum it serves (issue: a curriculum from
served episodes).

Real parts throughout: sandbox workers and runtimes as processes on port 0, the record in the SQLite
file beside the library or in a real redis-server, episodes played with the samples' recorded
oracle actions (a success) or the same actions with a wrong final answer (a failure).
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from codegym.library.records import TaskRecord
from codegym.library.store import Library
from codegym.procs import codegym_command
from codegym_client import RuntimeClient
from codegym_client.api.runtime.v1 import runtime_service_pb2 as rt
from codegym_client.errors import CodeGymError
from services.runtime.curriculum import Record, sample
from services.runtime.episode_record import ENV_SCOPE, EpisodeOutcome, Recorder, task_key, task_scope
from services.runtime.record_store import RedisRecordStore, SqliteRecordStore, record_path_for
from services.runtime.tallies import TaskTally, merge
from tests.conftest import ENV_DIR, SAMPLES
from tests.helpers.libraries import SAMPLE_LIBRARY, build_library
from tests.helpers.processes import wait_until
from tests.helpers.servers import CodegymServer, Redis, require_redis_server, start_runtime, workers_fixture

pytestmark = pytest.mark.jail  # the tests play episodes on a real sandbox worker

MAX = "Sample_0001_I__MaxSubarraySumEnv"
# MaxSubarraySum with a `step` that raises on an action naming 'boom': an environment error.
BROKEN = "Broken_0001__MaxSubarraySumEnv"
PREFIX = "Sample_0010_I__CommonPrefixEnv"
ONE = {"nums": [1]}
OBSERVE = '{"name": "Observe", "parameters": {}}'


def oracle(env_id: str, config: dict[str, Any]) -> list[str]:
    for line in (SAMPLES / "trajectories.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["env_id"] == env_id and row["config"] == config and row["reward"] == 1.0:
            return [action for action, _ in row["steps"]]
    raise LookupError((env_id, config))


def wrong_answer(actions: list[str]) -> list[str]:
    """The oracle's actions with a final answer the environment rewards 0."""
    last = json.loads(actions[-1])
    assert last["name"] == "Done"
    last["parameters"]["answer"] = 12345
    return [*actions[:-1], json.dumps(last)]


def ability(env_id: str, config: dict[str, Any]) -> str:
    return f"codegym_v1@{env_id}@{json.dumps(config)}"


def play(
    client: RuntimeClient, env_id: str, config: dict[str, Any], actions: list[str], **create: Any
) -> tuple[str, float]:
    created = client.create_session(ability=ability(env_id, config), **create)
    reply = None
    for action in actions:
        reply = client.step(created.session_id, action)
    assert reply is not None
    return created.session_id, reply.reward


def tasks_of(client: RuntimeClient, run: str = "", **options: Any) -> dict[str, rt.TaskStats]:
    return {e.task.ability: e.task for e in client.stats(run, **options) if e.WhichOneof("entry") == "task"}


def counts(stats: rt.TaskStats) -> tuple[int, int]:
    return stats.episodes, stats.passes


def envs_of(client: RuntimeClient, run: str = "") -> dict[str, rt.EnvStats]:
    return {e.env.env_id: e.env for e in client.stats(run, envs_only=True)}


@pytest.fixture
def library(tmp_path: Path) -> Path:
    path = build_library(tmp_path / "library.db", SAMPLE_LIBRARY)
    with Library(path) as lib:
        source = (ENV_DIR / f"{MAX}.py").read_text()
        broken = source.replace(
            "        self.step_count += 1\n",
            "        self.step_count += 1\n        if 'boom' in action:\n            raise RuntimeError('broken tool')\n",
            1,
        )
        assert broken != source
        report = lib.put_environment(
            BROKEN, broken, task_text="", metadata={}, tasks=[TaskRecord(BROKEN, json.dumps(ONE))]
        )
        assert not report.skipped, report.skipped
    db = sqlite3.connect(path)
    with db:  # what a published row carries as `solve_fc_round`: the oracle's step count
        db.execute(
            "UPDATE tasks SET solve_fc_round = ? WHERE env_id = ? AND config_json = ?",
            (len(oracle(MAX, ONE)), MAX, json.dumps(ONE)),
        )
    db.close()
    return path


workers = workers_fixture(1, clean_stop=False)


@pytest.fixture
def runtime(library: Path, workers: list[CodegymServer]) -> Iterator[CodegymServer]:
    server = start_runtime(library, workers)
    try:
        yield server
    finally:
        server.stop()


def test_merge_rules_add_counts_keep_windows_and_reset_fields() -> None:
    body = merge("task", {}, {"episodes": 1, "version": 7, "recent": "1"})
    env = merge("env", {}, {"recent_errors": ["a"]})
    for n in range(40):
        merge("task", body, {"episodes": 1, "version": 3, "recent": "0"})
        merge("env", env, {"recent_errors": [f"e{n}"]})
    assert body["episodes"] == 41 and body["version"] == 7
    assert body["recent"] == "0" * 32 and env["recent_errors"] == [f"e{n}" for n in range(35, 40)]
    merge("task", body, {"reset": ["recent"], "recent": "1"})
    assert body["recent"] == "1"


def test_redis_merges_deltas_exactly_as_the_sqlite_file_does(tmp_path: Path) -> None:
    require_redis_server()
    deltas = [
        {(task_scope("r"), "E@{}"): {"episodes": 1, "passes": 1, "recent": "1", "version": 4, "done": 1}},
        {(task_scope("r"), "E@{}"): {"episodes": 1, "recent": "0" * 40, "version": 2, "truncated": 1}},
        {(ENV_SCOPE, "E"): {"steps": 3, "window": "x" * 70, "recent_errors": [str(n) for n in range(9)]}},
        {(ENV_SCOPE, "E"): {"reset": ["window"], "window": ".", "lifts": 1}},
    ]

    async def both(url: str) -> tuple[dict[str, Any], dict[str, Any]]:
        sqlite_store = SqliteRecordStore(tmp_path / "record.sqlite")
        redis_store = RedisRecordStore(url)
        try:
            for delta in deltas:
                await sqlite_store.apply(delta, {"r": 1.0})
                await redis_store.apply(delta, {"r": 1.0})
            got = [
                {**await s.read(task_scope("r")), **await s.read(ENV_SCOPE)}
                for s in (sqlite_store, redis_store)
            ]
        finally:
            await redis_store.close()
            await sqlite_store.close()
        return got[0], got[1]

    redis = Redis()
    try:
        from_sqlite, from_redis = asyncio.run(both(redis.url))
    finally:
        redis.stop()
    assert from_sqlite == from_redis
    assert from_sqlite["E@{}"]["recent"] == ("1" + "0" * 40)[-32:] and from_sqlite["E@{}"]["version"] == 4
    assert from_sqlite["E"]["window"] == "." and from_sqlite["E"]["recent_errors"] == [
        "4",
        "5",
        "6",
        "7",
        "8",
    ]


def test_finished_episodes_are_recorded_per_task_and_run_and_early_closes_are_not(
    runtime: CodegymServer, library: Path
) -> None:
    with RuntimeClient(runtime.address) as client:
        actions = oracle(MAX, ONE)
        _, won = play(client, MAX, ONE, actions, run_id="run-a", policy_version=7)
        _, lost = play(client, MAX, ONE, wrong_answer(actions), run_id="run-a", policy_version=9)
        assert (won, lost) == (1.0, 0.0)
        play(client, MAX, ONE, actions, run_id="run-b")
        # Closed before its end: no outcome for anyone.
        early = client.create_session(ability=ability(MAX, ONE), run_id="run-a")
        client.step(early.session_id, OBSERVE)
        client.close_session(early.session_id)

        run_a = tasks_of(client, "run-a")[ability(MAX, ONE)]
        assert (run_a.episodes, run_a.passes, run_a.pass_rate) == (2, 1, 0.5)
        assert dict(run_a.endings) == {"done": 2} and run_a.last_policy_version == 9
        assert run_a.recent_episodes == 2 and run_a.mean_steps == len(actions)
        assert run_a.oracle_steps == len(actions) and run_a.pool == "learnable"
        everyone = tasks_of(client)[ability(MAX, ONE)]
        assert (everyone.episodes, everyone.passes) == (3, 2)
        untouched = tasks_of(client, "run-a")[ability(MAX, {"nums": [-3, -1, -2]})]
        assert untouched.episodes == 0
        played = tasks_of(client, "run-a", played_only=True)
        assert list(played) == [ability(MAX, ONE)]
        env = envs_of(client)[MAX]
        assert (env.episodes, env.passes) == (3, 2) and env.steps == 3 * len(actions) + 1
        assert not env.quarantined
    assert record_path_for(library).exists()


def test_the_record_survives_a_restart_of_the_runtime(library: Path, workers: list[CodegymServer]) -> None:
    server = start_runtime(library, workers)
    try:
        with RuntimeClient(server.address) as client:
            play(client, MAX, ONE, oracle(MAX, ONE), run_id="durable")
    finally:
        server.stop()  # SIGTERM: the recorder writes what it holds as the runtime stops
    again = start_runtime(library, workers)
    try:
        with RuntimeClient(again.address) as client:
            assert tasks_of(client, "durable")[ability(MAX, ONE)].passes == 1
    finally:
        again.stop()


def test_a_truncated_episode_is_recorded_as_truncated(runtime: CodegymServer) -> None:
    with RuntimeClient(runtime.address) as client:
        created = client.create_session(ability=ability(MAX, ONE), run_id="t", max_steps=2)
        client.step(created.session_id, OBSERVE)
        last = client.step(created.session_id, OBSERVE)
        assert last.truncated
        stats = tasks_of(client, "t")[ability(MAX, ONE)]
        assert dict(stats.endings) == {"truncated": 1} and stats.passes == 0


def test_sampling_is_deterministic_capped_per_env_and_follows_the_run(runtime: CodegymServer) -> None:
    with RuntimeClient(runtime.address) as client:
        first = client.sample_tasks("fresh", 8, seed=3)
        again = client.sample_tasks("fresh", 8, seed=3)
        assert [t.ability for t in first.tasks] == [t.ability for t in again.tasks]
        assert len(first.tasks) == 8 and len({t.ability for t in first.tasks}) == 8
        per_env: dict[str, int] = {}
        for task in first.tasks:
            per_env[task.env_id] = per_env.get(task.env_id, 0) + 1
        assert max(per_env.values()) <= 2
        assert {t.pool for t in first.tasks} == {"unseen"}  # the samples carry no published prior

        # Mastered by this run: retired from the learnable band; mixed: learnable.
        actions = oracle(MAX, ONE)
        for _ in range(4):
            play(client, MAX, ONE, actions, run_id="learner")
        prefix_config = {"words": ["a"]}
        prefix_actions = oracle(PREFIX, prefix_config)
        for n in range(4):
            play(
                client,
                PREFIX,
                prefix_config,
                prefix_actions if n % 2 else wrong_answer(prefix_actions),
                run_id="learner",
            )
        chosen = client.sample_tasks("learner", 6, seed=1, explore=0.0, per_env_cap=6)
        pools = {t.ability: t.pool for t in chosen.tasks}
        assert pools[ability(PREFIX, prefix_config)] == "learnable"
        assert chosen.tasks[0].ability == ability(PREFIX, prefix_config)  # the only learnable one
        assert chosen.pools["mastered"] == 1 and chosen.pools["learnable"] == 1
        assert ability(MAX, ONE) not in pools or pools[ability(MAX, ONE)] == "mastered"
        # Another run has not played them: for it they are unseen.
        other = tasks_of(client, "someone-else")
        assert other[ability(MAX, ONE)].pool == "unseen"


def test_bad_requests_get_a_clear_error_and_change_nothing(runtime: CodegymServer) -> None:
    with RuntimeClient(runtime.address) as client:
        with pytest.raises(CodeGymError, match="run_id is 300 characters long"):
            client.create_session(ability=ability(MAX, ONE), run_id="r" * 300)
        with pytest.raises(CodeGymError, match="low < high"):
            client.sample_tasks("r", 4, low=0.8, high=0.2)
        with pytest.raises(CodeGymError, match="explore"):
            client.sample_tasks("r", 4, explore=1.5)
        with pytest.raises(CodeGymError, match="not in the library"):
            client.lift_quarantine("Nope__NoSuchEnv")
        assert client.lift_quarantine(MAX) is False
        assert tasks_of(client, "r", played_only=True) == {}


def test_a_runtime_without_a_record_says_so(library: Path, workers: list[CodegymServer]) -> None:
    server = start_runtime(library, workers, "--no-record")
    try:
        with RuntimeClient(server.address) as client:
            play(client, MAX, ONE, oracle(MAX, ONE), run_id="x")
            with pytest.raises(CodeGymError, match="--no-record"):
                client.sample_tasks("x", 2)
            channel = grpc.insecure_channel(server.address)
            with pytest.raises(grpc.RpcError) as raised:
                list(rt_stub(channel).Stats(rt.StatsRequest(run_id="x"), timeout=10))
            assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            channel.close()
    finally:
        server.stop()
    assert not record_path_for(library).exists()


def rt_stub(channel: grpc.Channel) -> Any:
    from codegym_client.api.runtime.v1 import runtime_service_pb2_grpc

    return runtime_service_pb2_grpc.RuntimeServiceStub(channel)


def test_an_env_whose_steps_keep_failing_is_quarantined_then_lifted(runtime: CodegymServer) -> None:
    evil = '{"name": "Observe", "parameters": {"boom": 1}}'
    broken = ability(BROKEN, ONE)
    with RuntimeClient(runtime.address) as client:
        created = client.create_session(ability=broken, run_id="q")
        for _ in range(25):
            reply = client.step(created.session_id, evil)
            assert reply.error.code == rt.STEP_ERROR_CODE_ENV_ERROR, reply
        env = envs_of(client)[BROKEN]
        assert env.quarantined and "25 of its last 25 steps failed" in env.quarantine_reason
        assert env.step_errors["env_error"] == 25 and "broken tool" in env.recent_errors[-1]
        assert tasks_of(client, "q")[broken].step_errors["env_error"] == 25
        assert tasks_of(client, "q")[broken].pool == "quarantined"
        chosen = client.sample_tasks("q", 200, seed=0, per_env_cap=200)
        assert BROKEN not in {t.env_id for t in chosen.tasks} and chosen.pools["quarantined"] == 1
        assert not envs_of(client)[MAX].quarantined if MAX in envs_of(client) else True

        assert client.lift_quarantine(BROKEN) is True
        assert client.lift_quarantine(BROKEN) is False
        assert not envs_of(client)[BROKEN].quarantined
        assert BROKEN in {t.env_id for t in client.sample_tasks("q", 200, seed=0, per_env_cap=200).tasks}
        assert envs_of(client)[BROKEN].step_errors["env_error"] == 25  # nothing deleted


def test_a_reward_in_far_fewer_steps_than_the_oracle_is_flagged(
    library: Path, workers: list[CodegymServer]
) -> None:
    db = sqlite3.connect(library)
    with db:
        db.execute("UPDATE tasks SET solve_fc_round = 40 WHERE env_id = ?", (MAX,))
    db.close()
    server = start_runtime(library, workers)
    try:
        with RuntimeClient(server.address) as client:
            session_id, reward = play(client, MAX, ONE, oracle(MAX, ONE), run_id="s")
            assert reward == 1.0
            env = envs_of(client)[MAX]
            assert env.shortcut_episodes == 1 and list(env.shortcut_sessions) == [session_id]
            play(client, MAX, ONE, wrong_answer(oracle(MAX, ONE)), run_id="s")
            assert envs_of(client)[MAX].shortcut_episodes == 1  # an unrewarded one is no shortcut
    finally:
        server.stop()


def test_replicas_share_one_record_in_redis_and_it_survives_restarting_everything(
    library: Path, workers: list[CodegymServer], tmp_path: Path
) -> None:
    require_redis_server()
    folder = tmp_path / "redis"
    folder.mkdir()
    redis = Redis(folder)
    try:
        url, port = redis.url, redis.port
        first = start_runtime(library, workers, "--sessions", url)
        second = start_runtime(library, workers, "--sessions", url)
        try:
            with RuntimeClient(first.address) as a, RuntimeClient(second.address) as b:
                play(a, MAX, ONE, oracle(MAX, ONE), run_id="shared")
                play(b, MAX, ONE, wrong_answer(oracle(MAX, ONE)), run_id="shared")
                for client in (a, b):
                    # Each replica writes what it holds about once a second: the other's episode
                    # shows up within that.
                    def both_seen(c: RuntimeClient = client) -> bool:
                        return counts(tasks_of(c, "shared")[ability(MAX, ONE)]) == (2, 1)

                    wait_until(both_seen, 10.0, "both replicas' episodes in the shared record")
        finally:
            first.stop()
            second.stop()
        assert not record_path_for(library).exists()  # in Redis, beside the sessions
    finally:
        redis.stop()
    redis = Redis(folder, port=port)
    try:
        again = start_runtime(library, workers, "--sessions", redis.url)
        try:
            with RuntimeClient(again.address) as client:
                assert counts(tasks_of(client, "shared")[ability(MAX, ONE)]) == (2, 1)
        finally:
            again.stop()
    finally:
        redis.stop()


def test_the_sampler_prefers_tasks_whose_groups_are_likelier_to_teach(library: Path) -> None:
    """Two learnable tasks, one at a pass rate of one half, one at 15 of 16: a group of 8 on the
    first has rewards that differ almost surely, on the second about half the time. Drawn one at a
    time over many seeds, the first comes first clearly more often, and the second still comes."""
    half = TaskTally(recent="01" * 8, episodes=16)
    nearly = TaskTally(recent="0" + "1" * 15, episodes=16)
    a, b = task_key(MAX, json.dumps(ONE)), task_key(PREFIX, json.dumps({"words": ["a"]}))
    record = Record(run={a: half, b: nearly}, failing=frozenset(), quarantined=frozenset())
    firsts = Counter(
        sample(library, record, rt.SampleTasksRequest(run_id="w", n=1, seed=seed, explore=0.0))
        .tasks[0]
        .env_id
        for seed in range(400)
    )
    assert firsts[MAX] + firsts[PREFIX] == 400
    assert firsts[MAX] > 1.4 * firsts[PREFIX] and firsts[PREFIX] > 50, firsts


def test_a_record_that_cannot_be_written_stops_the_runtime_with_the_fix(library: Path) -> None:
    args = ["serve", "runtime", "--port", "0", "--library", str(library), "--sandbox", "127.0.0.1:9"]
    run = subprocess.run(
        codegym_command([*args, "--record", str(library.parent / "no" / "such" / "record.sqlite")]),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode != 0
    assert "cannot keep the episode record" in run.stderr and "--no-record" in run.stderr, run.stderr


def test_what_the_store_did_not_take_while_down_goes_with_the_next_flush(tmp_path: Path) -> None:
    """Redis restarts (as `codegym up` restarts its own): the outcomes recorded meanwhile are held,
    in order, and written once it is back; nothing is counted twice."""
    require_redis_server()
    folder = tmp_path / "redis"
    folder.mkdir()

    def outcome(n: int, passed: bool) -> EpisodeOutcome:
        return EpisodeOutcome(f"s{n}", MAX, json.dumps(ONE), "r", n, 1.0 if passed else 0.0, 3, "done")

    async def scenario() -> dict[str, Any]:
        redis = Redis(folder)
        store = RedisRecordStore(redis.url)
        recorder = Recorder(store, lambda env_id, config: 0)
        try:
            recorder.episode(outcome(1, True))
            await recorder.flush()
            redis.stop()
            recorder.episode(outcome(2, False))
            await recorder.flush()  # refused: held
            assert recorder.deltas
            recorder.episode(outcome(3, True))
            redis = Redis(folder, port=redis.port)
            await recorder.flush()
            assert not recorder.deltas
            body = await store.read_one(task_scope("r"), task_key(MAX, json.dumps(ONE)))
        finally:
            await store.close()
            redis.stop()
        assert body is not None
        return body

    body = asyncio.run(scenario())
    assert (body["episodes"], body["passes"], body["recent"], body["version"]) == (3, 2, "101", 3)

"""The runtime API the console reads (issue #40): SearchEnvs over a library of thousands, captured
episodes (ListEpisodes, GetEpisode) from real episodes through real jails, and the operator-only
calls (GetEnvCode, LiftQuarantine), against real runtimes and a real redis-server.

Captures are checked by their effect: what a runtime at `--capture 1` keeps and one at `--capture 0`
does not, a flagged episode kept whole at rate 0, the byte bound's oldest-first eviction, another
tenant's captures answered as unknown, and captures read back after the runtime restarts on Redis.
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from codegym.library import search
from codegym.library.store import Library, canonical_config
from codegym_cli.cli import main
from codegym_client.api.runtime.v1 import runtime_service_pb2 as rt
from codegym_client.api.runtime.v1 import runtime_service_pb2_grpc as rt_grpc
from codegym_client.channels import TLS_CA_ENV, TOKEN_ENV
from codegym_client.errors import REASON_TRAILER
from tests.helpers.libraries import SAMPLE_LIBRARY, build_library
from tests.helpers.servers import CodegymServer, Redis, require_redis_server, workers_fixture

pytestmark = pytest.mark.jail  # episodes step through a real sandbox worker

ENV = {k: v for k, v in os.environ.items() if k not in (TOKEN_ENV, TLS_CA_ENV)}
MAXSUB = "Sample_0001_I__MaxSubarraySumEnv"
SHORT_TASK = {"nums": [1]}  # solved in 2 steps; its solve_fc_round is set to 40 below: a shortcut
LONG_TASK = {"nums": [-3, -1, -2]}  # solve_fc_round 0: never flagged
OBSERVE = '{"name": "Observe", "parameters": {}}'
ANSWER_1 = '{"name": "Done", "parameters": {"answer": 1}}'
WRONG = '{"name": "Done", "parameters": {"answer": 99}}'
TOKENS = {
    "tokens": {
        "a-token": {"tenant": "team-a", "role": "trainer"},
        "b-token": {"tenant": "team-b", "role": "trainer"},
        "ops-token": {"tenant": "ops", "role": "operator"},
        "service-token": {"tenant": "services", "role": "service"},
    }
}
GENERATED = 3000  # environments added to the search library

workers = workers_fixture(1, addresses=True)


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The samples, with the short task's oracle at 40 steps (so 2 steps is a shortcut)."""
    path = build_library(tmp_path_factory.mktemp("library") / "library.db", *SAMPLE_LIBRARY_IMPORTS)
    with sqlite3.connect(path) as db:
        db.execute(
            "UPDATE tasks SET solve_fc_round = 40 WHERE env_id = ? AND config_json = ?",
            (MAXSUB, canonical_config(SHORT_TASK)),
        )
        assert db.execute("SELECT changes()").fetchone()[0] == 1
    return path


SAMPLE_LIBRARY_IMPORTS = [list(SAMPLE_LIBRARY)]


class Caller:
    """Raw RuntimeService calls as one token (None: no token)."""

    def __init__(self, address: str, token: str | None = None) -> None:
        self.address = address
        self.channel = grpc.insecure_channel(address)
        self.stub = rt_grpc.RuntimeServiceStub(self.channel)
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()

    def __getattr__(self, rpc: str) -> Any:
        method = getattr(self.stub, rpc)
        return lambda request: method(request, metadata=self.metadata, timeout=30)

    def play(self, task: dict[str, Any], actions: list[str], run_id: str = "run-1") -> str:
        made = self.CreateSession(
            rt.CreateSessionRequest(
                env_task=rt.EnvTask(env_id=MAXSUB, config_json=json.dumps(task)),
                run_id=run_id,
                policy_version=3,
            )
        )
        for action in actions:
            self.Step(rt.StepRequest(session_id=made.session_id, action_json=action))
        return str(made.session_id)

    def episodes(self, **filters: Any) -> list[rt.EpisodeSummary]:
        return list(self.ListEpisodes(rt.ListEpisodesRequest(page_size=500, **filters)).episodes)

    def close(self) -> None:
        self.channel.close()


def refusal(call: Any) -> tuple[grpc.StatusCode, str, str]:
    """The status, reason trailer and message of a call that must be refused."""
    with pytest.raises(grpc.RpcError) as refused:
        call()
    error: Any = refused.value
    reason = dict(error.trailing_metadata() or ()).get(REASON_TRAILER, "")
    return error.code(), reason, error.details()


def runtime(library: Path, workers: str, *extra: str, env: dict[str, str] | None = None) -> CodegymServer:
    args = ["serve", "runtime", "--port", "0", "--library", str(library), "--sandbox", workers, *extra]
    return CodegymServer(args, env=env or ENV)


@pytest.fixture(scope="module")
def capturing(library: Path, workers: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Caller]:
    """A runtime capturing every episode, its record and captures in a file."""
    record = tmp_path_factory.mktemp("record") / "record.sqlite"
    server = runtime(library, workers, "--capture", "1", "--record", str(record))
    caller = Caller(server.address)
    try:
        yield caller
    finally:
        caller.close()
        server.stop()


@pytest.fixture(scope="module")
def sampling_none(library: Path, workers: str) -> Iterator[Caller]:
    """A runtime capturing no sampled episode (flagged ones only)."""
    server = runtime(library, workers, "--capture", "0", "--no-record")
    caller = Caller(server.address)
    try:
        yield caller
    finally:
        caller.close()
        server.stop()


# ---- captures: rate, content, flags ---------------------------------------------------------------


def test_at_rate_one_every_episode_is_captured_whole_and_reads_back_as_played(capturing: Caller) -> None:
    played = capturing.play(LONG_TASK, [OBSERVE, WRONG])
    kept = {e.episode_id: e for e in capturing.episodes(run_id="run-1")}
    assert played in kept
    summary = kept[played]
    assert (summary.env_id, summary.run_id, summary.policy_version) == (MAXSUB, "run-1", 3)
    assert (summary.steps, summary.done, summary.whole, summary.flagged) == (2, True, True, False)
    assert summary.end_reason == "failed" and summary.reward == 0.0
    episode = capturing.GetEpisode(rt.GetEpisodeRequest(episode_id=played))
    assert episode.summary == summary
    assert json.loads(episode.config_json) == LONG_TASK
    assert episode.first_observation  # the reset message
    assert [(s.index, s.action) for s in episode.steps] == [(0, OBSERVE), (1, WRONG)]
    assert episode.steps[0].observation == "3"  # Observe answers the array's length
    assert episode.steps[1].done and "Incorrect" in episode.steps[1].observation


def test_at_rate_zero_an_unflagged_episode_is_not_captured(sampling_none: Caller) -> None:
    played = sampling_none.play(LONG_TASK, [OBSERVE, WRONG])
    assert played not in {e.episode_id for e in sampling_none.episodes()}
    assert refusal(lambda: sampling_none.GetEpisode(rt.GetEpisodeRequest(episode_id=played)))[:2] == (
        grpc.StatusCode.NOT_FOUND,
        "EPISODE_NOT_FOUND",
    )


def test_at_rate_zero_a_flagged_episode_is_captured_whole(sampling_none: Caller) -> None:
    """Rewarded in 2 of its oracle's 40 steps: the sentinel's shortcut, kept although not sampled."""
    played = sampling_none.play(SHORT_TASK, [OBSERVE, ANSWER_1])
    flagged = {e.episode_id: e for e in sampling_none.episodes(flagged_only=True)}
    assert played in flagged
    assert (flagged[played].whole, flagged[played].reward, flagged[played].end_reason) == (
        True,
        1.0,
        "solved",
    )
    episode = sampling_none.GetEpisode(rt.GetEpisodeRequest(episode_id=played))
    assert [s.action for s in episode.steps] == [OBSERVE, ANSWER_1]
    assert episode.steps[-1].reward == 1.0 and episode.steps[-1].done


def test_a_step_that_failed_is_in_the_capture_and_a_sampled_episode_closed_after_it_ended_by_error(
    capturing: Caller,
) -> None:
    made = capturing.CreateSession(
        rt.CreateSessionRequest(
            env_task=rt.EnvTask(env_id=MAXSUB, config_json=json.dumps(LONG_TASK)), run_id="errs"
        )
    )
    capturing.Step(rt.StepRequest(session_id=made.session_id, action_json=OBSERVE))
    failed = capturing.Step(rt.StepRequest(session_id=made.session_id, action_json="not json"))
    assert failed.HasField("error")
    capturing.CloseSession(rt.CloseSessionRequest(session_id=made.session_id))
    errors = {e.episode_id: e for e in capturing.episodes(errors_only=True)}
    assert made.session_id in errors and errors[made.session_id].end_reason == "error"
    episode = capturing.GetEpisode(rt.GetEpisodeRequest(episode_id=made.session_id))
    assert [(s.index, s.error) for s in episode.steps] == [(0, ""), (1, "STEP_ERROR_CODE_INVALID_ACTION")]
    assert episode.steps[1].action == "not json"


def test_episodes_filter_and_page_newest_first(capturing: Caller) -> None:
    ids = [
        capturing.play(LONG_TASK if i % 2 else SHORT_TASK, [OBSERVE, ANSWER_1], run_id="paged")
        for i in range(5)
    ]
    rewarded = {e.episode_id for e in capturing.episodes(run_id="paged", rewarded=True)}
    unrewarded = {e.episode_id for e in capturing.episodes(run_id="paged", rewarded=False)}
    assert rewarded == set(ids[0::2]) and unrewarded == set(ids[1::2])
    assert {e.episode_id for e in capturing.episodes(run_id="paged", env_id="nope__Env")} == set()
    seen: list[str] = []
    token = ""
    while True:
        page = capturing.ListEpisodes(rt.ListEpisodesRequest(run_id="paged", page_size=2, page_token=token))
        assert len(page.episodes) <= 2
        seen += [e.episode_id for e in page.episodes]
        token = page.next_page_token
        if not token:
            break
    assert seen == ids[::-1]


def test_bad_episode_requests_get_typed_refusals(capturing: Caller) -> None:
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    cases = [
        (lambda: capturing.GetEpisode(rt.GetEpisodeRequest(episode_id="no-such")), grpc.StatusCode.NOT_FOUND),
        (lambda: capturing.GetEpisode(rt.GetEpisodeRequest()), invalid),
        (lambda: capturing.ListEpisodes(rt.ListEpisodesRequest(page_token="garbage!")), invalid),
        (lambda: capturing.ListEpisodes(rt.ListEpisodesRequest(page_token="YzE6LTU=")), invalid),  # c1:-5
        (lambda: capturing.ListEpisodes(rt.ListEpisodesRequest(page_size=100_000)), invalid),
    ]
    for call, code in cases:
        got, reason, message = refusal(call)
        assert got == code and reason and "\n" not in message, (got, reason, message)
    # page_size 0 is proto3's unset: the default page (50), like ListEnvs'.
    assert capturing.ListEpisodes(rt.ListEpisodesRequest(page_size=0)) is not None


def test_contradictory_stats_requests_get_a_typed_refusal_over_the_stream(capturing: Caller) -> None:
    for request in (
        rt.StatsRequest(envs_only=True, tasks_only=True),
        rt.StatsRequest(worst_envs=5),
        rt.StatsRequest(envs_only=True, worst_envs=5000),
    ):
        got, reason, message = refusal(lambda request=request: list(capturing.Stats(request)))
        assert got == grpc.StatusCode.INVALID_ARGUMENT and reason and message, (request, got, message)


def test_console_episodes_stay_out_of_the_all_runs_record(capturing: Caller) -> None:
    """A console session is captured whole and recorded for the run `console` only."""
    played = capturing.play(LONG_TASK, [OBSERVE, WRONG], run_id="console")
    assert played in {e.episode_id for e in capturing.episodes(run_id="console")}

    def episodes_of(run_id: str) -> int:
        total = 0
        request = rt.StatsRequest(run_id=run_id, env_prefix=MAXSUB, played_only=True)
        for entry in capturing.stub.Stats(request, timeout=30):
            if entry.HasField("task") and json.loads(entry.task.ability.split("@", 2)[2]) == LONG_TASK:
                total += entry.task.episodes
        return total

    assert episodes_of("console") == 1
    before = episodes_of("")
    capturing.play(LONG_TASK, [OBSERVE, WRONG], run_id="console")
    assert episodes_of("console") == 2 and episodes_of("") == before


# ---- the byte bound, and Redis across a restart -----------------------------------------------------


def test_captures_stay_within_their_byte_bound_the_oldest_going_first(library: Path, workers: str) -> None:
    server = runtime(library, workers, "--capture", "1", "--no-record", "--capture-bytes", "4000")
    caller = Caller(server.address)
    try:
        ids = [caller.play(LONG_TASK, [OBSERVE, WRONG]) for _ in range(12)]
        kept = [e.episode_id for e in caller.episodes()]
        assert 0 < len(kept) < len(ids)
        assert kept == ids[::-1][: len(kept)]  # the newest, in order: the oldest went
        code = refusal(lambda: caller.GetEpisode(rt.GetEpisodeRequest(episode_id=ids[0])))[0]
        assert code == grpc.StatusCode.NOT_FOUND
    finally:
        caller.close()
        server.stop()


def test_captures_in_redis_survive_a_runtime_restart(library: Path, workers: str, tmp_path: Path) -> None:
    require_redis_server()
    redis = Redis(tmp_path)
    url = f"redis://127.0.0.1:{redis.port}/0"
    try:
        first = runtime(library, workers, "--sessions", url, "--capture", "1")
        caller = Caller(first.address)
        played = caller.play(LONG_TASK, [OBSERVE, WRONG])
        flagged = caller.play(SHORT_TASK, [OBSERVE, ANSWER_1])
        caller.close()
        first.stop()
        second = runtime(library, workers, "--sessions", url, "--capture", "1")
        caller = Caller(second.address)
        try:
            assert [s.action for s in caller.GetEpisode(rt.GetEpisodeRequest(episode_id=played)).steps] == [
                OBSERVE,
                WRONG,
            ]
            assert [e.episode_id for e in caller.episodes(flagged_only=True)] == [flagged]
            assert [e.episode_id for e in caller.episodes()] == [flagged, played]
        finally:
            caller.close()
            second.stop()
    finally:
        redis.stop()


def test_redis_captures_stay_within_their_byte_bound(tmp_path: Path) -> None:
    """The store itself, in-process, against a real redis-server: bytes held never pass the bound,
    and every index loses what was evicted."""
    import asyncio

    from services.runtime.captures import Capture, Filters
    from services.runtime.redis_captures import RedisCaptureStore

    require_redis_server()
    redis = Redis(tmp_path)

    async def fill() -> tuple[list[int], list[str], list[str]]:
        store = RedisCaptureStore(f"redis://127.0.0.1:{redis.port}/0", 5_000)
        held = []
        for i in range(40):
            summary = rt.EpisodeSummary(episode_id=f"e{i}", tenant="t", run_id="r", flagged=i % 2 == 0)
            body = rt.GetEpisodeResponse(summary=summary, config_json="x" * 300).SerializeToString()
            await store.put(Capture(summary, body))
            held.append(await store.held_bytes())
        everything, _ = await store.page(Filters(), 500, None)
        flagged, _ = await store.page(Filters(tenant="t", flagged_only=True), 500, None)
        await store.close()
        return held, [e.episode_id for e in everything], [e.episode_id for e in flagged]

    try:
        held, everything, flagged = asyncio.run(fill())
        assert max(held) <= 5_000 and held[-1] > 4_000
        assert everything == [f"e{i}" for i in range(39, 39 - len(everything), -1)]
        assert flagged == [e for e in everything if int(e[1:]) % 2 == 0]
        assert redis.client.zcard("codegym:captures:run:r") == len(everything)
    finally:
        redis.stop()


# ---- tenants and operators ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def guarded(library: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("tokens")
    tokens = folder / "tokens.json"
    tokens.write_text(json.dumps(TOKENS))
    worker = CodegymServer(
        ["serve", "sandbox", "--port", "0", "--jails", "1", "--tokens", str(tokens)], env=ENV
    )
    server = runtime(
        library,
        worker.address,
        "--tokens",
        str(tokens),
        "--capture",
        "1",
        "--record",
        str(folder / "record.sqlite"),
        env={**ENV, TOKEN_ENV: "service-token"},
    )
    try:
        yield server.address
    finally:
        server.stop()
        worker.stop()


def test_captures_are_seen_by_their_tenant_and_operators_only(guarded: str) -> None:
    a, b, ops = Caller(guarded, "a-token"), Caller(guarded, "b-token"), Caller(guarded, "ops-token")
    try:
        mine = a.play(LONG_TASK, [OBSERVE, WRONG])
        assert mine in {e.episode_id for e in a.episodes()}
        assert {e.tenant for e in a.episodes()} == {"team-a"}
        assert mine not in {e.episode_id for e in b.episodes()}
        assert refusal(lambda: b.GetEpisode(rt.GetEpisodeRequest(episode_id=mine)))[:2] == (
            grpc.StatusCode.NOT_FOUND,
            "EPISODE_NOT_FOUND",
        )
        assert ops.GetEpisode(rt.GetEpisodeRequest(episode_id=mine)).summary.tenant == "team-a"
        assert mine in {e.episode_id for e in ops.episodes()}
    finally:
        for caller in (a, b, ops):
            caller.close()


def test_env_code_and_lifting_a_quarantine_take_an_operator(guarded: str) -> None:
    trainer, ops = Caller(guarded, "a-token"), Caller(guarded, "ops-token")
    try:
        for call in (
            lambda: trainer.GetEnvCode(rt.GetEnvCodeRequest(env_id=MAXSUB)),
            lambda: trainer.LiftQuarantine(rt.LiftQuarantineRequest(env_id=MAXSUB)),
        ):
            code, reason, message = refusal(call)
            assert (code, reason) == (grpc.StatusCode.PERMISSION_DENIED, "PERMISSION_DENIED")
            assert "operator" in message
        code_reply = ops.GetEnvCode(rt.GetEnvCodeRequest(env_id=MAXSUB))
        source = (
            Path(__file__).resolve().parent.parent / "codegym/samples/envs" / f"{MAXSUB}.py"
        ).read_text()
        assert code_reply.code == source
        import hashlib

        assert code_reply.code_sha256 == hashlib.sha256(source.encode()).hexdigest()
        assert ops.LiftQuarantine(rt.LiftQuarantineRequest(env_id=MAXSUB)).lifted is False
        assert refusal(lambda: ops.GetEnvCode(rt.GetEnvCodeRequest(env_id="No_0001_I__SuchEnv")))[0] == (
            grpc.StatusCode.NOT_FOUND
        )
    finally:
        trainer.close()
        ops.close()


# ---- search ------------------------------------------------------------------------------------------


def generated(index: int) -> tuple[str, str, str, float | None, str]:
    """The generated environment `index`: id, source, description, its tasks' Bo4, their label."""
    source = f"Gen{index % 7}"
    rate = None if index % 5 == 0 else (index % 10) / 10
    label = ("learnable", "mastered", "unsolved", "")[index % 4]
    description = f"Generated environment number {index}." + (" A zebra crossing." if index == 1234 else "")
    return f"{source}__GenEnv{index:05d}", source, description, rate, label


@pytest.fixture(scope="module")
def search_library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The samples and GENERATED environments more (copies of a sample's row, two tasks each)."""
    path = build_library(tmp_path_factory.mktemp("search") / "library.db", list(SAMPLE_LIBRARY))
    with Library(path) as lib, lib.db:
        template = lib.db.execute(
            "SELECT sha256, source, tools_json, tools_text FROM envs WHERE env_id = ?", (MAXSUB,)
        ).fetchone()
        for index in range(GENERATED):
            env_id, _source, description, rate, label = generated(index)
            lib.db.execute(
                "INSERT INTO envs (env_id, code_id, env_class, source, sha256, tools_json, tools_text, task_text,"
                " metadata, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, '{}', 0)",
                (
                    env_id,
                    env_id.split("__")[0],
                    f"GenEnv{index}",
                    template[1],
                    template[0],
                    template[2],
                    template[3],
                    description,
                ),
            )
            scores = json.dumps({} if rate is None else {"m_Bo4_score": rate})
            for n in range(2):
                lib.db.execute(
                    "INSERT INTO tasks (env_id, config_json, scores, learnability) VALUES (?, ?, ?, ?)",
                    (env_id, json.dumps({"n": n}), scores, label),
                )
        search.refresh(lib.db)
    return path


@pytest.fixture(scope="module")
def searching(search_library: Path, workers: str) -> Iterator[Caller]:
    server = runtime(search_library, workers, "--no-record")
    caller = Caller(server.address)
    try:
        yield caller
    finally:
        caller.close()
        server.stop()


def search_all(caller: Caller, size: int = 500, **filters: Any) -> tuple[list[rt.EnvSearchHit], int]:
    hits: list[rt.EnvSearchHit] = []
    token, total = "", -1
    while True:
        page = caller.SearchEnvs(rt.SearchEnvsRequest(page_size=size, page_token=token, **filters))
        assert len(page.envs) <= size
        hits += page.envs
        total = page.total if total < 0 else total
        assert page.total == total
        token = page.next_page_token
        if not token:
            return hits, total


def test_search_pages_through_every_environment_once(searching: Caller) -> None:
    hits, total = search_all(searching)
    ids = [h.env_id for h in hits]
    assert total == len(ids) == GENERATED + 12 and ids == sorted(set(ids))
    first = next(h for h in hits if h.env_id == generated(3)[0])
    assert (first.source, first.task_count, dict(first.learnability)) == ("Gen3", 2, {"unlabelled": 2})
    assert first.bo4_pass_rate == pytest.approx(0.3) and not first.HasField("bo8_pass_rate")


def test_search_filters_by_text_source_learnability_and_pass_rate(searching: Caller) -> None:
    rows = [generated(i) for i in range(GENERATED)]
    assert [h.env_id for h in search_all(searching, text="ZEBRA")[0]] == [rows[1234][0]]
    assert [h.env_id for h in search_all(searching, text="number 1234.")[0]] == [rows[1234][0]]
    assert [h.env_id for h in search_all(searching, text="MaxSubarray")[0]] == [MAXSUB]
    by_source, total = search_all(searching, size=37, source="Gen4")
    assert {h.env_id for h in by_source} == {r[0] for r in rows if r[1] == "Gen4"} and total == len(by_source)
    mastered = {h.env_id for h in search_all(searching, learnability=["mastered", "unsolved"])[0]}
    assert mastered == {r[0] for r in rows if r[4] in ("mastered", "unsolved")}
    ranged = {h.env_id for h in search_all(searching, min_pass_rate=0.25, max_pass_rate=0.55)[0]}
    assert ranged == {r[0] for r in rows if r[3] is not None and 0.25 <= r[3] <= 0.55}
    both = search_all(
        searching, source="Gen2", min_pass_rate=0.8, learnability=["learnable"], text="Generated"
    )[0]
    assert {h.env_id for h in both} == {
        r[0] for r in rows if r[1] == "Gen2" and r[3] is not None and r[3] >= 0.8 and r[4] == "learnable"
    }
    assert search_all(searching, text="no-such-word-anywhere")[1] == 0


def test_bad_searches_get_typed_refusals(searching: Caller) -> None:
    for request in (
        rt.SearchEnvsRequest(page_size=501),
        rt.SearchEnvsRequest(page_token="not-a-token"),
        rt.SearchEnvsRequest(learnability=["bogus"]),
        rt.SearchEnvsRequest(min_pass_rate=1.5),
        rt.SearchEnvsRequest(text="x" * 300),
    ):
        code, reason, message = refusal(lambda request=request: searching.SearchEnvs(request))
        assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST") and "\n" not in message
    assert len(searching.SearchEnvs(rt.SearchEnvsRequest(page_size=0)).envs) == search.DEFAULT_PAGE


def test_a_read_only_library_without_the_index_is_searched_from_memory(
    search_library: Path, tmp_path: Path
) -> None:
    """A library written before the index existed: a runtime (read-only) indexes it at first search."""
    old = tmp_path / "old.db"
    old.write_bytes(search_library.read_bytes())
    with sqlite3.connect(old) as db:
        db.executescript("DROP TABLE env_search_text; DROP TABLE env_search;")
    with Library(old, read_only=True) as lib:
        hits, _, total = lib.search(search.Query(text="zebra"))
        assert [h.env_id for h in hits] == [generated(1234)[0]] and total == 1
    with Library(search_library, read_only=True) as lib:
        assert lib.search(search.Query(size=3))[2] == GENERATED + 12


def test_library_writes_keep_the_index_current(tmp_path: Path) -> None:
    path = build_library(tmp_path / "library.db", list(SAMPLE_LIBRARY))
    with Library(path) as lib:
        assert lib.search(search.Query(labels=["mastered"]))[2] == 0
        task = lib.tasks_of(MAXSUB)[0]
        assert lib.set_learnability([(MAXSUB, task.config_json, "mastered")]) == 1
        assert lib.set_scores([(MAXSUB, task.config_json, "m_Bo8_score", 0.5)]) == 1
        hits, _, total = lib.search(search.Query(labels=["mastered"]))
        assert total == 1 and hits[0].env_id == MAXSUB and hits[0].bo8 == pytest.approx(0.5)


def test_library_episodes_prints_captures_as_json_lines(
    capturing: Caller, capsys: pytest.CaptureFixture[str]
) -> None:
    played = capturing.play(LONG_TASK, [OBSERVE, WRONG], run_id="cli")
    flagged = capturing.play(SHORT_TASK, [OBSERVE, ANSWER_1], run_id="cli")
    target = capturing.address
    assert main(["library", "episodes", "--target", target, "--run", "cli"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["episode_id"] for line in lines] == [flagged, played]
    assert main(["library", "episodes", "--target", target, "--run", "cli", "--unrewarded"]) == 0
    assert [json.loads(x)["episode_id"] for x in capsys.readouterr().out.splitlines()] == [played]
    assert main(["library", "episodes", "--target", target, "--run", "cli", "--flagged"]) == 0
    assert [json.loads(x)["episode_id"] for x in capsys.readouterr().out.splitlines()] == [flagged]
    assert main(["library", "episodes", "--target", target, "--id", played]) == 0
    whole = json.loads(capsys.readouterr().out)
    assert [step["action"] for step in whole["steps"]] == [OBSERVE, WRONG] and whole["run_id"] == "cli"
    assert main(["library", "episodes", "--target", target, "--id", "no-such"]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err


def test_a_search_total_is_counted_up_to_its_cap(
    search_library: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from services.runtime.catalog import Catalog

    monkeypatch.setattr(search, "COUNT_CAP", 100)
    catalog = Catalog(search_library)
    try:
        capped = catalog.search(rt.SearchEnvsRequest(page_size=10))
        assert (capped.total, capped.total_capped, len(capped.envs)) == (100, True, 10)
        exact = catalog.search(rt.SearchEnvsRequest(source="Gen4", min_pass_rate=0.9, page_size=10))
        rows = [generated(i) for i in range(GENERATED)]
        matching = sum(r[1] == "Gen4" and r[3] is not None and r[3] >= 0.9 for r in rows)
        assert 10 < matching < 100 and (exact.total, exact.total_capped) == (matching, False)
        few = catalog.search(rt.SearchEnvsRequest(text="zebra"))
        assert (few.total, few.total_capped) == (1, False)
    finally:
        catalog.close()


# ---- the Curriculum page's reads over a run of many played tasks -------------------------------------


def test_curriculum_of_a_run_past_the_per_task_bound_reads_the_kept_counts_only(
    library: Path, workers: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past `PER_TASK_MAX` played tasks the page reads RunHistory's counts (pools now, recent pass
    rates, each version's groups and moves) and no task's Stats line; within it, the same pools
    with the per-task figures."""
    import asyncio

    from codegym_client.async_client import AsyncRuntimeClient
    from services.console import curriculum
    from services.console.access import Logins
    from services.console.app import Console
    from services.console.config import ConsoleConfig
    from services.runtime.episode_record import EpisodeOutcome, Recorder
    from services.runtime.record_store import SqliteRecordStore

    with Library(library, read_only=True) as lib:
        tasks = [(task.env_id, task.config_json) for task in lib.iter_tasks()][:12]
    record = tmp_path / "record.sqlite"

    async def write() -> None:
        store = SqliteRecordStore(record)
        recorder = Recorder(store, lambda env_id, config: 0)
        for n, (env_id, config) in enumerate(tasks):  # 4 episodes each: pools decided
            for episode in range(4):
                passed = float(n % 3 == 0 or (n % 3 == 1 and episode % 2 == 0))
                outcome = EpisodeOutcome(f"s{n}-{episode}", env_id, config, "big", n // 4, passed, 2, "done")
                recorder.episode(outcome)
            if n % 4 == 3:
                await recorder.flush()  # a history point per policy version: 3 of them
        await recorder.flush()
        await store.close()

    asyncio.run(write())
    server = runtime(library, workers, "--record", str(record))
    stats_calls: list[rt.StatsRequest] = []

    async def view(bound: int, listed: int = curriculum.VERSIONS_LISTED) -> curriculum.CurriculumView:
        monkeypatch.setattr(curriculum, "PER_TASK_MAX", bound)
        async with AsyncRuntimeClient(server.address) as client:
            asked = client.stub.Stats

            def counted(request: rt.StatsRequest, **kwargs: Any) -> Any:
                stats_calls.append(request)
                return asked(request, **kwargs)

            client.stub.Stats = counted  # type: ignore[method-assign]
            return await curriculum.curriculum_view(client, "big", listed)

    try:
        big = asyncio.run(view(len(tasks) - 1))
        assert big.per_task is None and stats_calls == []
        assert big.played == len(tasks)
        assert (big.pools["learnable"], big.pools["mastered"], big.pools["unsolved"]) == (4, 4, 4)
        assert {bar.label: bar.value for bar in big.pass_rates.bars} == {
            "0": "4",
            "0.00-0.25": "0",
            "0.25-0.50": "0",
            "0.50-0.75": "4",
            "0.75-1.00": "0",
            "1": "4",
        }
        small = asyncio.run(view(len(tasks)))
        assert small.per_task is not None and small.per_task.episodes == 4 * len(tasks)
        assert small.pools == big.pools
        assert len(stats_calls) == 1 and stats_calls[0].tasks_only and stats_calls[0].played_only
        with Library(library, read_only=True) as lib:
            assert big.pools["unseen"] == lib.counts()[1] - len(tasks)  # the library's size from RunHistory
        # The pools-by-version table lists the last versions, with a link to every one.
        assert [row.version for row in big.versions] == [0, 1, 2] and big.listed == big.versions
        # Each version's 4 groups of 4 episodes: all passed (n % 3 == 0) or all failed (2) are
        # zero-variance; each task moved out of the unseen by its group's pass rate.
        assert [(row.groups, row.multi, row.zero) for row in big.versions] == [
            (4, 4, 3),
            (4, 4, 2),
            (4, 4, 3),
        ]
        assert big.versions[0].moves == [
            ("unseen", "mastered", 2),
            ("unseen", "learnable", 1),
            ("unseen", "unsolved", 1),
        ]
        assert big.groups.zero_share == pytest.approx(8 / 12) and small.groups == big.groups
        short = asyncio.run(view(len(tasks), listed=2))
        assert [row.version for row in short.listed] == [1, 2]
        console = Console(ConsoleConfig(runtime=server.address))
        _, login = Logins({}).sign_in("")
        html = console.templates.get_template("curriculum.html").render(
            view=short, run_id="big", login=login, page="curriculum", signin=False, grafana_url="", path="/"
        )
        assert 'data-version="0"' not in html and 'data-version="2"' in html
        assert "The last 2 of 3 versions" in html and "versions=all" in html
        assert 'id="zero-variance">67%</b> of 12 groups of two episodes or more' in html
        assert '<tr data-version="1"><td>1</td><td>4</td><td>4</td><td>2</td><td>50%</td></tr>' in html
    finally:
        server.stop()

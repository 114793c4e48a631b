"""Clients resend what a replica's death lost, and raise the exception the runtime's reason names.

Real processes throughout: redis-server, sandbox workers (nsjail), runtime replicas sharing their
sessions in Redis, and the project's clients over gRPC on loopback. A replica is killed with
SIGKILL at a moment chosen by a condition (steps observed, a step's lease held in Redis), never
after a sleep; every episode must then play exactly as recorded.
"""

from __future__ import annotations

import asyncio
import functools
import json
import pickle
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest

from codegym import errors
from codegym.contract import split_env_id
from codegym_client import (
    AsyncRuntimeClient,
    CapacityExceeded,
    CodeGymError,
    EnvFailed,
    EnvNotFound,
    InvalidRequest,
    RuntimeClient,
    RuntimeUnavailable,
    SessionDone,
    SessionNotFound,
    StepConflict,
)
from codegym_client.abilities import make_ability
from codegym_client.api.runtime.v1 import runtime_service_pb2 as rt
from codegym_client.errors import REASON_TRAILER, REASONS, RETRY_AFTER_TRAILER, reason_sent, typed_error
from codegym_client.gym_env import RemoteEnv
from codegym_client.online import OnlineGymEnv
from tests.conftest import ENV_DIR, ROOT, SAMPLES
from tests.helpers.libraries import SAMPLE_LIBRARY, library_fixture
from tests.helpers.processes import wait_until
from tests.helpers.raw_errors import RawError
from tests.helpers.servers import CodegymServer, Redis, workers_fixture
from tests.helpers.trajectories import record

# No skip when redis-server is missing: the `redis` fixture fails the tests that need it then,
# unless the run opted out with CODEGYM_TESTS_WITHOUT_REDIS=1 (tests/helpers/servers.py).

COUNTER = "Test_0001_I__CounterEnv"
RUNTIME_ENVS = ROOT / "tests" / "fixtures" / "runtime_envs"
PUBLISHED = [json.loads(x) for x in (SAMPLES / "trajectories.jsonl").read_text().splitlines() if x.strip()]
# A short lease: a replica killed mid-step blocks its session for at most this long.
LEASE_S = "2"
OBSERVE = '{"name": "Observe", "parameters": {}}'


def add(amount: int) -> str:
    return json.dumps({"name": "Add", "parameters": {"amount": amount}})


def slow(ms: int) -> str:
    return json.dumps({"name": "Slow", "parameters": {"ms": ms}})


# ---- servers --------------------------------------------------------------------------------------


library = library_fixture(SAMPLE_LIBRARY, [RUNTIME_ENVS / f"{COUNTER}.py"])
workers = workers_fixture(addresses=True, clean_stop=False)


@pytest.fixture
def redis() -> Iterator[Redis]:
    server = Redis()  # nothing persisted: the tests restart replicas, never Redis
    try:
        yield server
    finally:
        server.stop()


def replica(library: Path, workers: str, redis: Redis, *extra: str, port: int = 0) -> CodegymServer:
    return CodegymServer(
        [
            "serve",
            "runtime",
            "--port",
            str(port),
            "--library",
            str(library),
            "--sandbox",
            workers,
            "--sessions",
            redis.url,
            "--step-lease-s",
            LEASE_S,
            *extra,
        ]
    )


# ---- a replica killed under the drop-in client -----------------------------------------------------


@pytest.fixture(scope="module")
def recorded() -> list[dict[str, Any]]:
    """Each published task's oracle trajectory, recorded by running the env in a child interpreter."""
    jobs = [
        {
            "path": str(ENV_DIR / f"{t['env_id']}.py"),
            "class": split_env_id(t["env_id"])[1],
            "config": t["config"],
        }
        for t in PUBLISHED
    ]
    return [
        {"env_id": t["env_id"], "config": t["config"], **played}
        for t, played in zip(PUBLISHED, record(jobs), strict=True)
    ]


@pytest.mark.jail
def test_a_replica_killed_mid_replay_costs_no_episode(
    library: Path, workers: str, redis: Redis, recorded: list[dict[str, Any]]
) -> None:
    """The issue's scenario: the drop-in client, given both replicas, replays recorded trajectories
    while one replica is SIGKILLed; every episode plays to its recorded end, none dies."""
    a, b = replica(library, workers, redis), replica(library, workers, redis)
    episodes = [t for t in recorded if len(t["steps"]) >= 10][:96]
    kill_after = 400
    observed = [0]
    lock = threading.Lock()
    killed = threading.Event()

    def before_step() -> None:
        with lock:
            observed[0] += 1
            if observed[0] == kill_after:
                a.proc.send_signal(signal.SIGKILL)
                killed.set()

    def play(trajectory: dict[str, Any]) -> list[str] | str:
        try:
            env = OnlineGymEnv.from_env_str(
                make_ability(trajectory["env_id"], trajectory["config"]),
                target=[a.address, b.address],
            )
        except CodeGymError as exc:
            return f"died at create: {exc}"
        try:
            seen = [env.observation]
            for action, _ in trajectory["steps"]:
                before_step()
                seen.append(env.step(action))
            if not env.finished or env.reward != trajectory["reward"]:
                return f"ended with finished={env.finished} reward={env.reward}"
            return seen
        except CodeGymError as exc:
            return f"died after {len(seen) - 1} steps: {exc}"
        finally:
            env.release()

    try:
        with ThreadPoolExecutor(24) as pool:
            outcomes = list(pool.map(play, episodes))
        assert killed.is_set() and a.proc.wait(10) == -signal.SIGKILL
        assert observed[0] > kill_after + 1000  # most of the replay ran after the kill
        lost = [(t["env_id"], o) for t, o in zip(episodes, outcomes, strict=True) if isinstance(o, str)]
        assert lost == []
        for trajectory, seen in zip(episodes, outcomes, strict=True):
            assert seen == [trajectory["first"], *(o for _, o in trajectory["steps"])], trajectory["env_id"]
    finally:
        a.stop()
        b.stop()


# ---- one lost step, for every client --------------------------------------------------------------

DRIVERS = [
    "RuntimeClient.step",
    "AsyncRuntimeClient.step",
    "AsyncRuntimeClient.step (unary)",
    "RuntimeClient.batch_step",
    "OnlineGymEnv",
    "RemoteEnv",
]


def drive(driver: str, target: str, reached_slow: threading.Event) -> tuple[str, list[str]]:
    """Create a counter session, add 1, then a slow step (the one the kill catches), then observe.

    Every client gets a generous send budget: the replica comes back on its address after the
    kill, and the client must keep resending until it does."""
    config = {"target": 5}
    if driver.startswith("AsyncRuntimeClient.step"):
        transport = "unary" if driver.endswith("(unary)") else "stream"

        async def run() -> tuple[str, list[str]]:
            async with AsyncRuntimeClient(target, attempts=30, step_transport=transport) as client:
                created = await client.create_session(env_id=COUNTER, config=config)
                sid = created.session_id
                seen = [created.observation, (await client.step(sid, add(1))).observation]
                reached_slow.set()
                seen.append((await client.step(sid, slow(1500))).observation)
                # Over the shared streams, the kill broke the stream holding the slow step (and
                # each resend's new stream failed until the replica was back).
                assert (client.streams.broken >= 1) == (transport == "stream")
                seen.append((await client.step(sid, OBSERVE)).observation)
                return sid, seen

        return asyncio.run(run())
    with RuntimeClient(target, attempts=30) as client:
        if driver == "RuntimeClient.step":
            created = client.create_session(env_id=COUNTER, config=config)
            sid = created.session_id
            seen = [created.observation, client.step(sid, add(1)).observation]
            reached_slow.set()
            seen.append(client.step(sid, slow(1500)).observation)
            seen.append(client.step(sid, OBSERVE).observation)
            return sid, seen
        if driver == "RuntimeClient.batch_step":
            created, other = (client.create_session(env_id=COUNTER, config=config) for _ in range(2))
            sid, oid = created.session_id, other.session_id
            seen = [created.observation]
            for action in (add(1), slow(1500), OBSERVE):
                if action != add(1):
                    reached_slow.set()
                results = client.batch_step([(sid, action), (oid, action)])
                assert [r.code for r in results] == [0, 0], results
                assert results[0].response.observation == results[1].response.observation
                seen.append(results[0].response.observation)
            return sid, seen
        if driver == "OnlineGymEnv":
            env = OnlineGymEnv.from_env_str(make_ability(COUNTER, config), client=client)
            seen = [env.observation, env.step(add(1))]
            reached_slow.set()
            seen += [env.step(slow(1500)), env.step(OBSERVE)]
            assert env.step_count == 3
            return env.session_id, seen
        remote = RemoteEnv(client, env_id=COUNTER, config=config)
        observation, _ = remote.reset()
        seen = [observation, remote.step(add(1))[0]]
        reached_slow.set()
        seen.append(remote.step(slow(1500))[0])
        observation, _, _, _, info = remote.step(OBSERVE)
        assert info["step_index"] == 3
        return remote.session_id, [*seen, observation]


@pytest.mark.jail
@pytest.mark.parametrize("driver", DRIVERS)
def test_a_step_lost_with_its_replica_is_sent_again_and_applied_once(
    driver: str, library: Path, workers: str, redis: Redis
) -> None:
    """The replica running a step is SIGKILLed while the step holds its lease; the client sends the
    step again with its index until the replica is back on its address (from the same Redis), and
    the step is applied exactly once: the counter reads 2, not 3, and the episode goes on."""
    first = replica(library, workers, redis)
    port = int(first.address.rsplit(":", 1)[1])
    reached_slow = threading.Event()
    sessions: list[str] = []
    second: CodegymServer | None = None

    def lease_of_the_slow_step() -> bool:
        keys = [k.decode() for k in redis.client.scan_iter("codegym:lock:*")]
        sessions[:] = [k.split(":", 2)[2] for k in keys]
        return reached_slow.is_set() and bool(keys)

    try:
        with ThreadPoolExecutor(1) as pool:
            played: Future[tuple[str, list[str]]] = pool.submit(drive, driver, first.address, reached_slow)
            wait_until(lambda: lease_of_the_slow_step() or played.done(), 60, "slow step running")
            assert not played.done(), played.result()
            first.proc.send_signal(signal.SIGKILL)
            assert first.proc.wait(10) == -signal.SIGKILL
            second = replica(library, workers, redis, port=port)
            session_id, seen = played.result(timeout=120)
        assert seen == ["Counter at 0; reach 5.", "1", "2", "2"]
        assert session_id in sessions
        with RuntimeClient(second.address) as client:
            view = client.get_session(session_id)
        assert (view.step_index, view.status) == (3, rt.SESSION_STATUS_ACTIVE)
    finally:
        first.stop()
        if second is not None:
            second.stop()


# ---- resending with an index, deadlines -----------------------------------------------------------


@pytest.fixture
def runtime(library: Path, workers: str, redis: Redis) -> Iterator[CodegymServer]:
    proc = replica(library, workers, redis, "--max-sessions", "8")
    try:
        yield proc
    finally:
        proc.stop()


@pytest.mark.jail
def test_a_step_sent_again_with_its_index_is_answered_from_the_record(runtime: CodegymServer) -> None:
    with RuntimeClient(runtime.address) as client:
        sid = client.create_session(env_id=COUNTER, config={"target": 5}).session_id
        applied = client.step(sid, add(2), step_index=0)
        again = client.step(sid, add(2), step_index=0)  # as a client that lost the reply sends it
        assert (applied.observation, applied.step_index) == ("2", 1)
        assert again == applied
        # The client learnt the index from the reply: its next step needs none given.
        assert client.step(sid, OBSERVE).observation == "2"
        assert client.get_session(sid).step_index == 2


@pytest.mark.jail
def test_a_deadline_is_resent_once_then_raised(runtime: CodegymServer) -> None:
    """A step slower than the client's deadline: sent twice (the second time with its index), then
    `RuntimeUnavailable`; a hung runtime costs twice `timeout_s`, not `attempts` times. The step is
    applied at most once. (The session is another client's, so this one does not know its step
    timeout and `timeout_s` is the deadline: a session's own client waits for what its step timeout
    allows, tests/test_outcomes.py.)"""
    with RuntimeClient(runtime.address, timeout_s=30) as owner:
        sid = owner.create_session(env_id=COUNTER, config={"target": 5}).session_id
    with RuntimeClient(runtime.address, timeout_s=1.0) as client:
        started = time.monotonic()
        with pytest.raises(RuntimeUnavailable) as info:
            client.step(sid, slow(2500), step_index=0)
        elapsed = time.monotonic() - started
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and info.value.retryable
        assert 2.0 <= elapsed < 3.5, elapsed
    with RuntimeClient(runtime.address, timeout_s=30) as client:
        applied = client.get_session(sid).step_index
        assert applied in (0, 1)
        assert client.step(sid, OBSERVE).observation == str(applied)


# ---- the error table --------------------------------------------------------------------------------


def test_the_clients_table_is_the_servers() -> None:
    """The client cannot import codegym/errors.py (a trainer installs the client alone; the servers
    import the client, never the reverse): its rows must stay the servers' rows."""
    assert (REASON_TRAILER, RETRY_AFTER_TRAILER) == (errors.REASON_TRAILER, errors.RETRY_AFTER_TRAILER)
    assert {name: (code, kind.__name__) for name, (code, kind) in REASONS.items()} == {
        reason.name: (reason.value.code, reason.value.client_error) for reason in errors.Reason
    }
    for reason in errors.Reason:
        error = REASONS[reason.name][1](reason.code, "x", "Step", ((REASON_TRAILER, reason.name),))
        assert error.reason == reason.name
        assert error.retryable == reason.value.retry.startswith(("yes", "after retry-after"))


def table_rows(text: str, header: str) -> dict[str, list[str]]:
    """The rows of the markdown table under `header`, by their first cell's name."""
    lines = text[text.index(header) :].splitlines()
    rows: dict[str, list[str]] = {}
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip().strip("`") for c in line.strip("|").split("|")]
        rows[cells[0]] = cells
    return rows


def test_the_written_tables_are_the_table() -> None:
    """The client's docstring and the docs' error table (docs/errors.md) list every reason, with
    the same infrastructure answer the errors give."""
    documented = {
        "client": {
            name: cells[4] for name, cells in table_rows(errors_doc(), "| reason              |").items()
        },
        "docs/errors.md": {
            name: cells[4]
            for name, cells in table_rows(
                (ROOT / "docs" / "errors.md").read_text(), "| reason (`codegym-reason`) |"
            ).items()
        },
    }
    for where, rows in documented.items():
        assert set(rows) == set(REASONS), where
        for name, (code, kind) in REASONS.items():
            error = kind(code, "x", "Step", ((REASON_TRAILER, name),))
            assert rows[name] == ("yes" if error.infrastructure else "no"), (where, name)


def errors_doc() -> str:
    import codegym_client.errors as client_errors

    return client_errors.__doc__ or ""


def refused(call: Callable[[], Any]) -> CodeGymError:
    with pytest.raises(CodeGymError) as info:
        call()
    return info.value


def assert_reason(
    error: CodeGymError, kind: type[CodeGymError], reason: str, retryable: bool = False
) -> None:
    """The exception, chosen by the reason the runtime sent (not by the status-code fallback)."""
    assert type(error) is kind, error
    assert reason_sent(error.trailing_metadata()) == reason == error.reason
    assert error.code() == REASONS[reason][0] and error.retryable is retryable
    assert isinstance(error, grpc.RpcError) and isinstance(error.__cause__, grpc.RpcError)


@pytest.mark.jail
def test_every_refusal_raises_the_exception_of_its_reason(runtime: CodegymServer, redis: Redis) -> None:
    with RuntimeClient(runtime.address) as client:
        assert_reason(refused(lambda: client.get_env("Nope_1_I__NoSuchEnv")), EnvNotFound, "ENV_NOT_FOUND")
        err = refused(lambda: client.create_session(env_id="Nope_1_I__NoSuchEnv", config={}))
        assert_reason(err, EnvNotFound, "ENV_NOT_FOUND")
        err = refused(lambda: client.create_session(env_id=COUNTER, config="{oops"))
        assert_reason(err, InvalidRequest, "INVALID_REQUEST")
        # The environment's own failure at create: the same call fails again, never retried.
        err = refused(lambda: client.create_session(env_id=COUNTER, config={"target": 1, "fail": "raise"}))
        assert_reason(err, EnvFailed, "ENV_FAILED")
        assert isinstance(err, InvalidRequest) and "cannot start" in err.details()

        closed = client.create_session(env_id=COUNTER, config={"target": 1}).session_id
        assert client.close_session(closed)
        for call in (
            lambda: client.step(closed, OBSERVE),
            lambda: client.reset(closed),
            lambda: client.get_session(closed),
        ):
            assert_reason(refused(call), SessionNotFound, "SESSION_NOT_FOUND")

        done = client.create_session(env_id=COUNTER, config={"target": 1}).session_id
        client.step(done, add(1))
        assert client.step(done, json.dumps({"name": "Done", "parameters": {"answer": 1}})).done
        err = refused(lambda: client.step(done, OBSERVE))
        assert_reason(err, SessionDone, "SESSION_DONE")
        assert err.method == "Step" and "Reset" in err.details()
        copy = pickle.loads(pickle.dumps(err))
        assert (type(copy), copy.reason, copy.retryable, copy.details()) == (
            SessionDone,
            "SESSION_DONE",
            False,
            err.details(),
        )

        moved = client.create_session(env_id=COUNTER, config={"target": 1}).session_id
        client.step(moved, OBSERVE)
        client.step(moved, OBSERVE)

        def step_at(index: int) -> rt.StepResponse:
            return client.step(moved, add(1), step_index=index)

        # Behind the session by more than one step, or ahead of it: neither applied nor answered
        # from the record (one behind is the last step's resend, answered from the record).
        for wrong in (0, 3, 7):
            assert_reason(refused(functools.partial(step_at, wrong)), StepConflict, "STEP_CONFLICT")
        assert client.get_session(moved).step_index == 2
        # One behind with the last step's own action is its resend: the recorded reply of the second
        # Observe; with another action, a conflict (that caller missed the step).
        assert client.step(moved, OBSERVE, step_index=1).observation == "0"
        assert_reason(refused(functools.partial(step_at, 1)), StepConflict, "STEP_CONFLICT")
        assert client.step(moved, OBSERVE).observation == "0"

        while True:  # --max-sessions 8
            try:
                client.create_session(env_id=COUNTER, config={"target": 1})
            except CapacityExceeded as exc:
                assert_reason(exc, CapacityExceeded, "CAPACITY", retryable=True)
                assert exc.retry_after_s == 1.0
                break

        redis.stop()  # the store is gone: an infrastructure fault the runtime names
        started = time.monotonic()
        err = refused(lambda: client.get_session(moved))
        assert_reason(err, RuntimeUnavailable, "UNAVAILABLE", retryable=True)
        assert time.monotonic() - started < 15


S = grpc.StatusCode


@pytest.mark.parametrize(
    ("code", "method", "kind", "reason"),
    [
        (S.INVALID_ARGUMENT, "CreateSession", InvalidRequest, "INVALID_REQUEST"),
        (S.NOT_FOUND, "CreateSession", EnvNotFound, "ENV_NOT_FOUND"),
        (S.NOT_FOUND, "GetEnv", EnvNotFound, "ENV_NOT_FOUND"),
        (S.NOT_FOUND, "Step", SessionNotFound, "SESSION_NOT_FOUND"),
        (S.FAILED_PRECONDITION, "Step", SessionDone, "SESSION_DONE"),
        (S.FAILED_PRECONDITION, "CreateSession", EnvFailed, "ENV_FAILED"),
        (S.FAILED_PRECONDITION, "Reset", EnvFailed, "ENV_FAILED"),
        (S.ABORTED, "Step", StepConflict, "STEP_CONFLICT"),
        (S.RESOURCE_EXHAUSTED, "CreateSession", CapacityExceeded, "CAPACITY"),
        (S.UNAVAILABLE, "Step", RuntimeUnavailable, "UNAVAILABLE"),
        (S.DEADLINE_EXCEEDED, "Step", RuntimeUnavailable, "UNAVAILABLE"),
        (S.INTERNAL, "Step", CodeGymError, "INTERNAL"),
        (S.UNKNOWN, "Step", CodeGymError, ""),
    ],
)
def test_without_a_reason_the_status_code_decides(
    code: grpc.StatusCode, method: str, kind: type[CodeGymError], reason: str
) -> None:
    error = typed_error(RawError(code), method)
    assert (type(error), error.reason, error.method, error.code()) == (kind, reason, method, code)
    assert error.retryable == (reason in ("UNAVAILABLE", "CAPACITY"))


def test_a_reason_decides_only_with_its_own_status() -> None:
    # FAILED_PRECONDITION from Step is SessionDone by status, EnvFailed by the reason.
    error = typed_error(RawError(S.FAILED_PRECONDITION, ((REASON_TRAILER, "ENV_FAILED"),)), "Step")
    assert type(error) is EnvFailed and error.reason == "ENV_FAILED"
    # A reason under another status did not cause that status (e.g. the connection dropped).
    error = typed_error(RawError(S.UNAVAILABLE, ((REASON_TRAILER, "STEP_CONFLICT"),)), "Step")
    assert type(error) is RuntimeUnavailable and error.reason == "UNAVAILABLE" and error.retryable
    error = typed_error(RawError(S.NOT_FOUND, ((REASON_TRAILER, "NO_SUCH_REASON"),)), "Step")
    assert type(error) is SessionNotFound and error.reason == "SESSION_NOT_FOUND"

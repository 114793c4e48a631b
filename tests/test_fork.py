"""Forks, rewinds, checkpoints and restores (issue #39) against real runtimes, jails and redis-server.

Fidelity is checked two ways: on the sample trajectories (the oracle's recorded observations),
where a fork, a rewind or a restore must play the recorded rest identically; and on DiceEnv
(tests/fixtures/runtime_envs), which draws from the module's `random`, an RNG kept in its state
and a set's iteration order, so that a fork which did not carry the state and the seed sequence
exactly would read differently (and `reseed=True` forks must).

Every refusal is typed, one line, and leaves the sessions as they were.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest

from codegym.checkpoint.v1 import checkpoint_pb2 as cp
from codegym_client import RuntimeClient
from codegym_client.api.runtime.v1 import runtime_service_pb2 as rt
from codegym_client.api.runtime.v1 import runtime_service_pb2_grpc as rt_grpc
from codegym_client.channels import TLS_CA_ENV, TOKEN_ENV
from codegym_client.errors import (
    BadCheckpoint,
    CapacityExceeded,
    CheckpointsOff,
    CodeGone,
    InvalidRequest,
    NoHistory,
    SessionNotFound,
)
from codegym_testkit.waiting import wait_until
from services.runtime.checkpoints import write_key_file
from tests.conftest import ROOT, SAMPLES
from tests.helpers.libraries import SAMPLE_LIBRARY, build_library, library_fixture
from tests.helpers.servers import CodegymServer, Redis, require_redis_server, workers_fixture

pytestmark = pytest.mark.jail  # every test steps through real sandbox workers

FIXTURES = ROOT / "tests" / "fixtures" / "runtime_envs"
DICE = "Test_0003_I__DiceEnv"
COUNTER = "Test_0001_I__CounterEnv"
TRAJECTORIES = [json.loads(x) for x in (SAMPLES / "trajectories.jsonl").read_text().splitlines()]
ROLL = '{"name": "Roll", "parameters": {}}'
DRAW = '{"name": "Draw", "parameters": {}}'
PICK = '{"name": "Pick", "parameters": {}}'
DICE_PLAY = [ROLL, DRAW, PICK, ROLL, PICK, DRAW, ROLL, ROLL, PICK, DRAW, ROLL, PICK]
ENV = {k: v for k, v in os.environ.items() if k not in (TOKEN_ENV, TLS_CA_ENV)}
HISTORY_STEPS = 10
MAX_FORKS = 8

library = library_fixture(SAMPLE_LIBRARY, [FIXTURES / f"{DICE}.py", FIXTURES / f"{COUNTER}.py"])
workers = workers_fixture(2, addresses=True)


@pytest.fixture(scope="module")
def key_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_key_file(tmp_path_factory.mktemp("keys") / "checkpoint.key")


def runtime_args(library: Path, workers: str, *extra: str) -> list[str]:
    return [
        "serve", "runtime", "--port", "0", "--library", str(library), "--sandbox", workers,
        "--history-steps", str(HISTORY_STEPS), "--max-forks", str(MAX_FORKS), *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def runtime(library: Path, workers: str, key_file: Path) -> Iterator[CodegymServer]:
    server = CodegymServer(runtime_args(library, workers, "--checkpoint-key", str(key_file)), env=ENV)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def client(runtime: CodegymServer) -> Iterator[RuntimeClient]:
    with RuntimeClient(runtime.address, attempts=1) as made:
        yield made


def dice(client: RuntimeClient, **options: Any) -> str:
    return client.create_session(env_id=DICE, config={"sides": 1000}, seed=7, **options).session_id


def play(client: RuntimeClient, session_id: str, actions: list[str]) -> list[str]:
    seen = []
    for action in actions:
        response = client.step(session_id, action)
        assert not response.HasField("error"), response.error
        seen.append(response.observation)
    return seen


def held(client: RuntimeClient, session_id: str) -> tuple[int, float, int]:
    """Where a session stands (not how long it has left)."""
    view = client.get_session(session_id)
    return view.step_index, view.reward, view.status


# ---- forks and rewinds: fidelity -----------------------------------------------------------------


def test_a_default_fork_replays_its_source_exactly(client: RuntimeClient) -> None:
    """The module's random, the state's RNG and a set's order all come out the same on every fork."""
    source = dice(client)
    play(client, source, DICE_PLAY[:4])
    forks = client.fork_session(source, count=3)
    assert [f.step_index for f in forks] == [4, 4, 4]
    assert len({f.session_id for f in forks} | {source}) == 4
    rest = play(client, source, DICE_PLAY[4:])
    for fork in forks:
        assert play(client, fork.session_id, DICE_PLAY[4:]) == rest


def test_reseeded_forks_diverge(client: RuntimeClient) -> None:
    source = dice(client)
    play(client, source, DICE_PLAY[:2])
    forks = client.fork_session(source, count=4, reseed=True)
    rolls = [ROLL] * 6
    runs = {tuple(play(client, f.session_id, rolls)) for f in forks}
    runs.add(tuple(play(client, source, rolls)))
    assert len(runs) == 5  # a 1000-sided die six times: five sequences all different


def test_a_rewind_replays_each_step_exactly_and_reaches_finished_episodes(client: RuntimeClient) -> None:
    source = dice(client, keep_history=True)
    played = play(client, source, DICE_PLAY[:8])
    done = client.step(source, '{"name": "Done", "parameters": {"guess": 0}}')
    assert done.done
    for k in range(0, 9):
        (fork,) = client.fork_session(source, at_step=k)
        assert fork.step_index == k and not fork.done
        assert play(client, fork.session_id, DICE_PLAY[k:8]) == played[k:]
        client.close_session(fork.session_id)
    (ended,) = client.fork_session(source, at_step=9)
    assert ended.done and ended.step_index == 9


def test_a_fork_inherits_the_history_up_to_its_step(client: RuntimeClient) -> None:
    source = dice(client, keep_history=True)
    played = play(client, source, DICE_PLAY[:6])
    (fork,) = client.fork_session(source, at_step=4)
    play(client, fork.session_id, [ROLL, ROLL])
    (grandchild,) = client.fork_session(fork.session_id, at_step=2)  # from the source's prefix
    assert play(client, grandchild.session_id, DICE_PLAY[2:6]) == played[2:6]


def test_a_reset_clears_the_history(client: RuntimeClient) -> None:
    source = dice(client, keep_history=True)
    play(client, source, DICE_PLAY[:5])
    client.reset(source)
    with pytest.raises(InvalidRequest, match="past"):
        client.fork_session(source, at_step=3)
    again = play(client, source, DICE_PLAY[:3])
    (fork,) = client.fork_session(source, at_step=1)
    assert play(client, fork.session_id, DICE_PLAY[1:3]) == again[1:]


def fidelity_cases(count: int) -> list[dict[str, Any]]:
    """The shortest `count` sample trajectories of distinct environments (all of them: `count` 0)."""
    if not count:
        return TRAJECTORIES
    chosen: dict[str, dict[str, Any]] = {}
    for trajectory in sorted(TRAJECTORIES, key=lambda t: len(t["steps"])):
        chosen.setdefault(trajectory["env_id"], trajectory)
    return list(chosen.values())[:count]


def check_fork_fidelity(client: RuntimeClient, trajectory: dict[str, Any], *, whole: bool = True) -> None:
    """Fork at every step and play the recorded rest on the fork; rewind to every step and play
    it again: the oracle's observations each time. Without `whole`, a fork or rewind plays its
    first step only (the step that runs cold from the copied state, where a copy that differs shows)
    except at the first, middle and last step, which play the whole rest: linear in the episode's
    length instead of quadratic (214 steps: 214 forks of one step, not 23,000 steps)."""
    actions = [a for a, _ in trajectory["steps"]]
    expected = [o for _, o in trajectory["steps"]]
    created = client.create_session(
        env_id=trajectory["env_id"], config=trajectory["config"], keep_history=True, max_steps=4096
    )
    source = created.session_id
    assert created.observation == trajectory["first"]
    forks = []
    for k, action in enumerate(actions):
        (fork,) = client.fork_session(source)
        forks.append((k, fork.session_id))
        response = client.step(source, action)
        assert response.observation == expected[k]
    last = len(actions) - 1
    played = {0, last // 2, last}

    def rest(k: int) -> slice:
        return slice(k, None) if whole or k in played else slice(k, k + 1)

    for k, fork_id in forks:
        assert play(client, fork_id, actions[rest(k)]) == expected[rest(k)]
        client.close_session(fork_id)
    start = max(0, len(actions) - HISTORY_STEPS + 1)
    for k in range(start, len(actions)):
        (rewound,) = client.fork_session(source, at_step=k)
        assert play(client, rewound.session_id, actions[rest(k)]) == expected[rest(k)]
        client.close_session(rewound.session_id)
    client.close_session(source)


def test_forks_and_rewinds_play_sample_trajectories_as_recorded(client: RuntimeClient) -> None:
    """Eight environments' shortest trajectories (the whole set: the slow test below)."""
    for trajectory in fidelity_cases(8):
        check_fork_fidelity(client, trajectory)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_forks_and_rewinds_play_every_sample_trajectory_as_recorded(client: RuntimeClient) -> None:
    """All 108 trajectories, every step forked and rewound (each playing its cold first step; the
    whole rest from three of them: see check_fork_fidelity)."""
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda t: check_fork_fidelity(client, t, whole=False), fidelity_cases(0)))


# ---- bad input: typed refusals, nothing changed ------------------------------------------------------


def test_bad_forks_are_refused_with_a_typed_line_and_nothing_made(client: RuntimeClient) -> None:
    plain = dice(client)
    kept = dice(client, keep_history=True)
    play(client, plain, DICE_PLAY[:3])
    play(client, kept, DICE_PLAY[:3])
    channel = grpc.insecure_channel(client.target)
    stub = rt_grpc.RuntimeServiceStub(channel)
    fork, invalid, precondition = (
        rt.ForkSessionRequest,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
    )
    cases: list[tuple[rt.ForkSessionRequest, grpc.StatusCode, str, str]] = [
        (fork(session_id=kept, count=0), invalid, "INVALID_REQUEST", "count 0"),
        (fork(session_id=kept, count=MAX_FORKS + 1), invalid, "INVALID_REQUEST", f"1 to {MAX_FORKS}"),
        (fork(session_id=kept, count=1, at_step=-1), invalid, "INVALID_REQUEST", "negative"),
        (fork(session_id=kept, count=1, at_step=4), invalid, "INVALID_REQUEST", "past"),
        (fork(session_id=plain, count=1, at_step=1), precondition, "NO_HISTORY", "keep_history"),
        (fork(session_id="nope", count=1), grpc.StatusCode.NOT_FOUND, "SESSION_NOT_FOUND", "no session"),
        (
            fork(session_id="x" * 100_000, count=1),
            grpc.StatusCode.NOT_FOUND,
            "SESSION_NOT_FOUND",
            "characters",
        ),
        (fork(session_id=kept, count=1, request_id="r" * 129), invalid, "INVALID_REQUEST", "request_id"),
    ]
    before = (held(client, plain), held(client, kept))
    for request, code, reason, words in cases:
        with pytest.raises(grpc.RpcError) as refused:
            stub.ForkSession(request, timeout=30)
        assert refused.value.code() == code, request
        assert dict(refused.value.trailing_metadata() or ())["codegym-reason"] == reason
        assert words in refused.value.details() and "\n" not in refused.value.details()
    assert (held(client, plain), held(client, kept)) == before
    client.close_session(plain)
    with pytest.raises(SessionNotFound):
        client.fork_session(plain)
    channel.close()


def test_the_history_is_bounded_per_session_and_the_oldest_steps_go(client: RuntimeClient) -> None:
    source = dice(client, keep_history=True)
    played = play(client, source, (DICE_PLAY * 2)[: HISTORY_STEPS + 4])
    with pytest.raises(NoHistory, match="no longer holds step 2"):
        client.fork_session(source, at_step=2)
    k = 5  # kept: the last HISTORY_STEPS entries (steps 5..14)
    (fork,) = client.fork_session(source, at_step=k)
    assert play(client, fork.session_id, (DICE_PLAY * 2)[k : HISTORY_STEPS + 4]) == played[k:]


# ---- checkpoints and restores ----------------------------------------------------------------------


def test_a_checkpoint_restores_as_often_as_asked_each_an_episode_of_its_own(client: RuntimeClient) -> None:
    source = dice(client)
    play(client, source, DICE_PLAY[:5])
    blob = client.checkpoint_session(source)
    assert DICE.encode() not in blob and b"card-" not in blob  # sealed: nothing readable
    first, second = client.restore_session(blob), client.restore_session(blob)
    assert first.session_id != second.session_id and first.step_index == second.step_index == 5
    rest = play(client, source, DICE_PLAY[5:])
    assert play(client, first.session_id, DICE_PLAY[5:]) == rest
    assert play(client, second.session_id, DICE_PLAY[5:]) == rest


def test_a_closing_checkpoint_suspends_the_episode(client: RuntimeClient) -> None:
    source = dice(client)
    play(client, source, DICE_PLAY[:3])
    twin = client.fork_session(source)[0].session_id
    blob = client.checkpoint_session(source, close=True)
    with pytest.raises(SessionNotFound):
        client.get_session(source)
    restored = client.restore_session(blob)
    assert play(client, restored.session_id, DICE_PLAY[3:]) == play(client, twin, DICE_PLAY[3:])


def test_bad_blobs_are_refused_and_nothing_is_restored(
    client: RuntimeClient, library: Path, workers: str, tmp_path: Path
) -> None:
    source = dice(client)
    play(client, source, DICE_PLAY[:2])
    blob = client.checkpoint_session(source)
    envelope = cp.SealedCheckpoint.FromString(blob)
    tampered = bytearray(blob)
    tampered[-5] ^= 1
    retenanted = cp.SealedCheckpoint()
    retenanted.CopyFrom(envelope)
    retenanted.tenant = "someone-else"
    rekeyed = cp.SealedCheckpoint()
    rekeyed.CopyFrom(envelope)
    rekeyed.key_id = "another-key"
    cases = {
        b"": "empty",
        blob[: len(blob) // 2]: "truncated or corrupt",
        bytes(tampered): "does not authenticate",
        retenanted.SerializeToString(): "does not authenticate",
        rekeyed.SerializeToString(): "does not hold",
        b"\x00" * (2 * 1024 * 1024 + 1): r"bytes \(max",
    }
    for bad, words in cases.items():
        with pytest.raises(BadCheckpoint, match=words) as refused:
            client.restore_session(bad)
        assert "\n" not in refused.value.details()
    # Another deployment's key: the same envelope does not open.
    other_key = write_key_file(tmp_path / "other.key")
    other = CodegymServer(runtime_args(library, workers, "--checkpoint-key", f"main={other_key}"), env=ENV)
    try:
        with RuntimeClient(other.address, attempts=1) as there:
            with pytest.raises(BadCheckpoint, match="does not hold"):
                there.restore_session(blob)
            foreign = there.checkpoint_session(dice(there))
        with pytest.raises(BadCheckpoint, match="'main'"):
            client.restore_session(foreign)
    finally:
        other.stop()


def test_without_a_key_checkpoints_are_refused_naming_the_flag(library: Path, workers: str) -> None:
    bare = CodegymServer(runtime_args(library, workers), env=ENV)
    try:
        with RuntimeClient(bare.address, attempts=1) as there:
            session = dice(there)
            with pytest.raises(CheckpointsOff, match="--checkpoint-key"):
                there.checkpoint_session(session)
            with pytest.raises(CheckpointsOff, match="--checkpoint-key"):
                there.checkpoint_session(session, close=True)
            with pytest.raises(CheckpointsOff, match="--checkpoint-key"):
                there.restore_session(b"anything")
            assert there.get_session(session).step_index == 0  # still there
    finally:
        bare.stop()


def test_a_blob_whose_code_the_library_no_longer_holds_names_it(
    client: RuntimeClient, workers: str, key_file: Path, tmp_path: Path
) -> None:
    source = dice(client)
    blob = client.checkpoint_session(source)
    without = build_library(tmp_path / "without.db", SAMPLE_LIBRARY)
    other = CodegymServer(runtime_args(without, workers, "--checkpoint-key", str(key_file)), env=ENV)
    try:
        with RuntimeClient(other.address, attempts=1) as there:
            with pytest.raises(CodeGone, match=DICE) as refused:
                there.restore_session(blob)
            assert len(refused.value.details().split("sha256 ")[1].split()[0]) == 64
    finally:
        other.stop()


def test_a_checkpoint_restores_after_the_runtime_restarts(
    library: Path, workers: str, key_file: Path
) -> None:
    cases = fidelity_cases(6)
    first = CodegymServer(runtime_args(library, workers, "--checkpoint-key", str(key_file)), env=ENV)
    blobs = []
    try:
        with RuntimeClient(first.address, attempts=1) as there:
            for trajectory in cases:
                session = there.create_session(env_id=trajectory["env_id"], config=trajectory["config"])
                half = len(trajectory["steps"]) // 2
                play(there, session.session_id, [a for a, _ in trajectory["steps"][:half]])
                blobs.append((half, there.checkpoint_session(session.session_id, close=True)))
    finally:
        first.stop()
    second = CodegymServer(runtime_args(library, workers, "--checkpoint-key", str(key_file)), env=ENV)
    try:
        with RuntimeClient(second.address, attempts=1) as there:
            for trajectory, (half, blob) in zip(cases, blobs, strict=True):
                restored = there.restore_session(blob)
                assert restored.step_index == half
                rest = trajectory["steps"][half:]
                assert play(there, restored.session_id, [a for a, _ in rest]) == [o for _, o in rest]
    finally:
        second.stop()


# ---- idempotency --------------------------------------------------------------------------------------


def test_resends_with_one_request_id_get_the_first_answer(client: RuntimeClient) -> None:
    source = dice(client)
    play(client, source, DICE_PLAY[:2])
    channel = grpc.insecure_channel(client.target)
    stub = rt_grpc.RuntimeServiceStub(channel)
    fork = rt.ForkSessionRequest(session_id=source, count=3, request_id="fork-1")
    first, again = stub.ForkSession(fork, timeout=30), stub.ForkSession(fork, timeout=30)
    assert first == again and len(first.sessions) == 3
    checkpoint = rt.CheckpointSessionRequest(session_id=source, request_id="cp-1")
    blob = stub.CheckpointSession(checkpoint, timeout=30)
    assert stub.CheckpointSession(checkpoint, timeout=30) == blob
    restore = rt.RestoreSessionRequest(checkpoint=blob.checkpoint, request_id="restore-1")
    restored = stub.RestoreSession(restore, timeout=30)
    assert stub.RestoreSession(restore, timeout=30) == restored
    other = stub.RestoreSession(rt.RestoreSessionRequest(checkpoint=blob.checkpoint, request_id="restore-2"))
    assert other.session.session_id != restored.session.session_id
    # A suspension resent: the same blob, though the session is gone by then.
    suspend = rt.CheckpointSessionRequest(
        session_id=restored.session.session_id, close=True, request_id="cp-2"
    )
    sealed = stub.CheckpointSession(suspend, timeout=30)
    assert stub.CheckpointSession(suspend, timeout=30) == sealed
    # Sent at once, the resends wait for the first and get its answer: never a second fork.
    twice = rt.ForkSessionRequest(session_id=source, count=2, request_id="fork-2")
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: stub.ForkSession(twice, timeout=30), range(4)))
    assert all(a == answers[0] for a in answers)
    channel.close()


def test_a_caller_resending_through_the_client_names_its_own_request_id(client: RuntimeClient) -> None:
    """A trainer riding out an outage calls the client again after the client's own resends gave
    up: with one request id of its own, the runtime answers the fork it made, not a second one."""
    source = dice(client)
    play(client, source, DICE_PLAY[:2])
    first = client.fork_session(source, count=2, request_id="ride-out-1")
    again = client.fork_session(source, count=2, request_id="ride-out-1")
    assert [f.session_id for f in again] == [f.session_id for f in first]
    fresh = client.fork_session(source, count=2)
    assert {f.session_id for f in fresh}.isdisjoint(f.session_id for f in first)
    blob = client.checkpoint_session(source, request_id="ride-out-2")
    assert client.checkpoint_session(source, request_id="ride-out-2") == blob
    restored = client.restore_session(blob, request_id="ride-out-3")
    assert client.restore_session(blob, request_id="ride-out-3").session_id == restored.session_id


# ---- tenants and quotas ----------------------------------------------------------------------------

TOKENS = {
    "tokens": {
        "tight-token": {"tenant": "tight", "role": "trainer"},
        "roomy-token": {"tenant": "roomy", "role": "trainer"},
        "ops-token": {"tenant": "ops", "role": "operator"},
        "service-token": {"tenant": "services", "role": "service"},
    },
    "tenants": {"tight": {"sessions": 4, "creates_per_s": 100}},
}


@pytest.fixture(scope="module")
def tenanted(
    library: Path, key_file: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[CodegymServer, Path]]:
    folder = tmp_path_factory.mktemp("tenants")
    tokens = folder / "tokens.json"
    tokens.write_text(json.dumps(TOKENS))
    worker = CodegymServer(
        ["serve", "sandbox", "--port", "0", "--jails", "1", "--tokens", str(tokens)], env=ENV
    )
    args = runtime_args(library, worker.address, "--checkpoint-key", str(key_file), "--tokens", str(tokens))
    server = CodegymServer([*args, "--no-record"], env={**ENV, TOKEN_ENV: "service-token"})
    try:
        yield server, tokens
    finally:
        server.stop()
        worker.stop()


def as_tenant(address: str, token: str, monkeypatch: pytest.MonkeyPatch) -> RuntimeClient:
    monkeypatch.setenv(TOKEN_ENV, token)
    return RuntimeClient(address, attempts=1)


def test_a_quota_counts_all_forks_or_none(
    tenanted: tuple[CodegymServer, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, _ = tenanted
    tight = as_tenant(server.address, "tight-token", monkeypatch)
    source = dice(tight)
    play(tight, source, DICE_PLAY[:2])
    with pytest.raises(CapacityExceeded, match="4 more would pass it"):
        tight.fork_session(source, count=4)
    forks = tight.fork_session(source, count=3)  # 1 + 3 = the quota of 4
    with pytest.raises(CapacityExceeded):
        tight.fork_session(source, count=1)
    with pytest.raises(CapacityExceeded):
        tight.restore_session(tight.checkpoint_session(source))
    for fork in forks:
        tight.close_session(fork.session_id)
    assert len(tight.fork_session(source, count=3)) == 3
    tight.close()


def test_only_the_owner_forks_or_restores_and_an_operator_restores_for_a_tenant(
    tenanted: tuple[CodegymServer, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, _ = tenanted
    roomy = as_tenant(server.address, "roomy-token", monkeypatch)
    tight = as_tenant(server.address, "tight-token", monkeypatch)
    ops = as_tenant(server.address, "ops-token", monkeypatch)
    source = dice(roomy)
    play(roomy, source, DICE_PLAY[:3])
    with pytest.raises(SessionNotFound):
        tight.fork_session(source)
    blob = roomy.checkpoint_session(source)
    with pytest.raises(BadCheckpoint, match="another tenant"):
        tight.restore_session(blob)
    restored = ops.restore_session(blob)  # for roomy: roomy's session
    assert roomy.get_session(restored.session_id).step_index == 3
    with pytest.raises(SessionNotFound):
        tight.get_session(restored.session_id)
    for made in (roomy, tight, ops):
        made.close()


# ---- replicas over Redis ----------------------------------------------------------------------------


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[Redis]:
    server = Redis(tmp_path)
    try:
        yield server
    finally:
        server.stop()


def test_forks_and_restores_work_across_replicas(
    library: Path, workers: str, key_file: Path, redis: Redis
) -> None:
    shared = ("--checkpoint-key", str(key_file), "--sessions", redis.url)
    a = CodegymServer(runtime_args(library, workers, *shared), env=ENV)
    b = CodegymServer(runtime_args(library, workers, *shared), env=ENV)
    try:
        with RuntimeClient(a.address, attempts=1) as on_a, RuntimeClient(b.address, attempts=1) as on_b:
            source = dice(on_a, keep_history=True)
            played = play(on_a, source, DICE_PLAY[:6])
            (fork,) = on_b.fork_session(source)  # a session B never served
            (rewound,) = on_b.fork_session(source, at_step=2)
            blob = on_a.checkpoint_session(source)
            restored = on_b.restore_session(blob)
            rest = play(on_a, source, DICE_PLAY[6:])
            assert play(on_b, fork.session_id, DICE_PLAY[6:]) == rest
            assert play(on_a, restored.session_id, DICE_PLAY[6:]) == rest
            assert play(on_a, rewound.session_id, DICE_PLAY[2:6]) == played[2:]
            # A resend to the other replica finds the first answer in Redis.
            request = rt.ForkSessionRequest(session_id=source, count=2, request_id="across")
            with grpc.insecure_channel(a.address) as ca, grpc.insecure_channel(b.address) as cb:
                first = rt_grpc.RuntimeServiceStub(ca).ForkSession(request, timeout=30)
                assert rt_grpc.RuntimeServiceStub(cb).ForkSession(request, timeout=30) == first
            # A suspended episode leaves nothing in Redis but its idempotency entry.
            suspended = dice(on_a, keep_history=True)
            play(on_a, suspended, DICE_PLAY[:3])
            on_a.checkpoint_session(suspended, close=True)
            assert redis.client.keys(f"*{suspended}*") == []
    finally:
        a.stop()
        b.stop()


def test_a_fork_does_not_wait_for_a_step_in_flight(library: Path, workers: str, redis: Redis) -> None:
    """It copies what is committed and says at which step; the step in flight goes on."""
    a = CodegymServer(runtime_args(library, workers, "--sessions", redis.url), env=ENV)
    try:
        with RuntimeClient(a.address, attempts=1) as there, ThreadPoolExecutor(1) as pool:
            source = there.create_session(env_id=COUNTER, config={"target": 3}).session_id
            play(there, source, ['{"name": "Add", "parameters": {"amount": 1}}'])
            slow = pool.submit(there.step, source, '{"name": "Slow", "parameters": {"ms": 4000}}')
            wait_until(lambda: redis.lease_held(source), 30, "the slow step to start")
            (fork,) = there.fork_session(source)
            assert not slow.done() and fork.step_index == 1
            assert slow.result(30).step_index == 2
            assert play(there, fork.session_id, ['{"name": "Observe", "parameters": {}}']) == ["1"]
    finally:
        a.stop()


def test_the_history_bound_across_the_runtime_drops_the_oldest_entries(
    library: Path, workers: str, redis: Redis
) -> None:
    a = CodegymServer(
        runtime_args(library, workers, "--sessions", redis.url, "--history-entries", "12"), env=ENV
    )
    try:
        with RuntimeClient(a.address, attempts=1) as there:
            old = dice(there, keep_history=True)
            play(there, old, DICE_PLAY[:5])
            new = dice(there, keep_history=True)
            play(there, new, DICE_PLAY[:8])  # 6 + 9 entries appended: 3 of the oldest gone
            assert redis.client.llen("codegym:history-order") == 12
            assert redis.client.llen(f"codegym:history:{old}") == 3
            with pytest.raises(NoHistory):
                there.fork_session(old, at_step=1)
            there.fork_session(old, at_step=4)
            assert there.step(old, ROLL).step_index == 6  # a step never fails for the bound
    finally:
        a.stop()


# ---- branches are recorded apart from episodes ----------------------------------------------------


def test_branches_are_recorded_apart_from_episodes(
    library: Path, workers: str, tmp_path: Path, key_file: Path
) -> None:
    """Three forks of a passing episode, and a restore of a checkpoint that left it open, each
    passing too: one episode and four branches, so the task's pass rate and pools see the episode
    once."""
    record = tmp_path / "record.sqlite"
    trajectory = fidelity_cases(1)[0]
    actions = [a for a, _ in trajectory["steps"]]
    args = runtime_args(library, workers, "--record", str(record), "--checkpoint-key", str(key_file))
    a = CodegymServer(args, env=ENV)
    try:
        with RuntimeClient(a.address, attempts=1) as there:
            created = there.create_session(
                env_id=trajectory["env_id"], config=trajectory["config"], run_id="r"
            )
            play(there, created.session_id, actions[:-1])
            forks = there.fork_session(created.session_id, count=3)
            restored = there.restore_session(there.checkpoint_session(created.session_id))
            others = [*(f.session_id for f in forks), restored.session_id]
            for session_id in [created.session_id, *others]:
                assert there.step(session_id, actions[-1]).reward == 1.0
            (task,) = [e.task for e in there.stats("r", played_only=True) if e.WhichOneof("entry") == "task"]
            assert (task.episodes, task.passes, task.branches, task.branch_passes) == (1, 1, 4, 4)
            (env,) = [e.env for e in there.stats("r", env_prefix=trajectory["env_id"], envs_only=True)]
            assert (env.episodes, env.branches) == (1, 4)
    finally:
        a.stop()


# ---- the async client and RemoteEnv ------------------------------------------------------------------


async def test_the_async_client_forks_checkpoints_and_restores(runtime: CodegymServer) -> None:
    from codegym_client import AsyncRuntimeClient

    async with AsyncRuntimeClient(runtime.address, attempts=1) as client:
        created = await client.create_session(env_id=DICE, config={"sides": 1000}, seed=3, keep_history=True)
        source = created.session_id
        for action in DICE_PLAY[:4]:
            await client.step(source, action)
        forks = await client.fork_session(source, count=2, at_step=2)
        assert [f.step_index for f in forks] == [2, 2]
        blob = await client.checkpoint_session(source, close=True)
        restored = await client.restore_session(blob)
        assert restored.step_index == 4 and restored.env_id == DICE
        (again,) = await client.fork_session(restored.session_id)
        rest = [(await client.step(restored.session_id, a)).observation for a in DICE_PLAY[4:7]]
        assert [(await client.step(again.session_id, a)).observation for a in DICE_PLAY[4:7]] == rest
        with pytest.raises(SessionNotFound):
            await client.get_session(source)


def test_remote_env_forks_checkpoints_and_restores(runtime: CodegymServer) -> None:
    from codegym_client import RemoteEnv

    env = RemoteEnv(runtime.address, env_id=DICE, config={"sides": 1000}, keep_history=True)
    env.reset(seed=11)
    for action in DICE_PLAY[:3]:
        env.step(action)
    branch = env.fork()
    rewound = env.fork(at_step=1)
    blob = env.checkpoint()
    rest = [env.step(a)[0] for a in DICE_PLAY[3:6]]
    assert [branch.step(a)[0] for a in DICE_PLAY[3:6]] == rest
    assert rewound.step(DICE_PLAY[1])[4]["step_index"] == 2
    restored = RemoteEnv.restore(blob, runtime.address)
    assert "Roll" in restored.created.tools_text  # type: ignore[union-attr]
    assert [restored.step(a)[0] for a in DICE_PLAY[3:6]] == rest
    paused = env.checkpoint(close=True)
    assert env.session_id == "" and paused
    for made in (branch, rewound, restored, env):
        made.close()


# ---- through codegym up ---------------------------------------------------------------------------------


def up_runtimes(folder: Path) -> tuple[CodegymServer, list[str]]:
    require_redis_server()
    args = ["up", "--library", str(folder / "lib.db"), "--port", "0", "--jails", "2", "--runtimes", "2"]
    up = CodegymServer(args, timeout=180)
    wait_until(lambda: "runtime 2 at" in up.text, 60, "codegym up to name its second runtime")
    return up, re.findall(r"runtime \d+ at (\S+) \(pid", up.text)


def check_restores_across_up_restarts(folder: Path, cases: list[dict[str, Any]]) -> None:
    """Checkpoint each episode mid-way (suspended) through `codegym up --runtimes 2`, stop it (and
    its Redis), start it again, restore each on the other runtime and play the recorded rest."""
    up, addresses = up_runtimes(folder)
    key = folder / "lib.checkpoint.key"
    try:
        assert key.stat().st_mode & 0o777 == 0o600
        first_key = key.read_bytes()
        blobs = []
        with RuntimeClient(addresses[0], attempts=3) as there:
            for trajectory in cases:
                session = there.create_session(env_id=trajectory["env_id"], config=trajectory["config"])
                half = len(trajectory["steps"]) // 2
                play(there, session.session_id, [a for a, _ in trajectory["steps"][:half]])
                blobs.append((half, there.checkpoint_session(session.session_id, close=True)))
    finally:
        up.stop()
    up, addresses = up_runtimes(folder)
    try:
        assert key.read_bytes() == first_key  # the same key: made once, reused
        with RuntimeClient(addresses[1], attempts=3) as there:
            for trajectory, (half, blob) in zip(cases, blobs, strict=True):
                restored = there.restore_session(blob)
                assert restored.step_index == half
                rest = trajectory["steps"][half:]
                assert play(there, restored.session_id, [a for a, _ in rest]) == [o for _, o in rest]
    finally:
        up.stop()


def test_checkpoints_restore_after_codegym_up_and_its_redis_restart(tmp_path: Path) -> None:
    check_restores_across_up_restarts(tmp_path, fidelity_cases(8))


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_every_sample_trajectory_restores_after_codegym_up_restarts(tmp_path: Path) -> None:
    check_restores_across_up_restarts(tmp_path, fidelity_cases(0))


# ---- the stores' idempotency entries -------------------------------------------------------------


async def test_a_claimed_request_id_waits_answers_once_and_frees_on_failure(redis: Redis) -> None:
    """In both stores: a claim marks the id pending for the next send, a failed call's unclaim lets
    a resend run it, an answer is what every later send gets, and past the bound the oldest go."""
    from services.runtime.redis_store import RedisSessionStore
    from services.runtime.sessions import PENDING, Answer, InMemorySessionStore

    on_redis = RedisSessionStore(redis.url, 60.0)
    try:
        for store in (InMemorySessionStore(), on_redis):
            assert await store.claim("k", 30) is None
            assert await store.claim("k", 30) == PENDING
            await store.unclaim("k")
            assert await store.claim("k", 30) is None
            await store.remember(Answer("k", b"first", 60, 2))
            await store.unclaim("k")  # a late unclaim never drops an answer
            assert await store.claim("k", 30) == b"first"
            await store.remember(Answer("k2", b"second", 60, 2))
            await store.remember(Answer("k3", b"third", 60, 2))
            assert await store.recall("k") is None and await store.recall("k3") == b"third"
    finally:
        await on_redis.close()

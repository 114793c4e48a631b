"""Sessions in a real redis-server: runtime replicas that share them, and what happens when one dies.

Two runtime replicas over two sandbox workers share sessions in Redis; a trainer reaches them with
round_robin. Killing one replica mid-run loses no episode and applies no step twice (a client that
lost a reply sends the step again with its step index); Redis going away gives a clear
UNAVAILABLE, and the stack serves again when it is back.

The step lease: a step longer than the lease keeps it (renewed), so the other replica's step of
that session waits for it; a replica frozen past its lease loses the session to the other one,
and what its step does when it wakes up (fail or succeed) changes nothing; a killed replica's
lease expires. Replicas there get one sandbox worker each, so a step the other replica serves runs
in another worker (what made a late write-back a rollback), never queued behind the first step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from redis import Redis as RedisClient

from codegym_client.api.runtime.v1 import runtime_service_pb2 as rt
from codegym_client.api.runtime.v1 import runtime_service_pb2_grpc as rt_grpc
from codegym_client.channels import sync_channel
from codegym_client.requests import create_request
from services.runtime.redis_store import RedisSessionStore
from services.runtime.sessions import InMemorySessionStore, Session
from tests.conftest import ROOT, SAMPLES
from tests.helpers.libraries import SAMPLE_LIBRARY, library_fixture
from tests.helpers.processes import wait_until
from tests.helpers.servers import CodegymServer, Redis, require_redis_server, workers_fixture

TRAJECTORIES = [json.loads(x) for x in (SAMPLES / "trajectories.jsonl").read_text().splitlines()]
RUNTIME = rt.DESCRIPTOR.services_by_name["RuntimeService"].full_name
# CounterEnv: Add/Observe/Done, and Slow(ms), a tool that sleeps (a step as long as we want).
COUNTER = "Test_0001_I__CounterEnv"
COUNTER_PATH = ROOT / "tests" / "fixtures" / "runtime_envs" / f"{COUNTER}.py"

# No skip when redis-server is missing: the `redis` fixture fails the test then, unless the run
# opted out with CODEGYM_TESTS_WITHOUT_REDIS=1 (tests/helpers/servers.py, require_redis_server).


library = library_fixture(SAMPLE_LIBRARY, [COUNTER_PATH])


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[Redis]:
    server = Redis(tmp_path)
    try:
        yield server
    finally:
        server.stop()


workers = workers_fixture(addresses=True, clean_stop=False)


def replica(library: Path, workers: str, redis: Redis, lease_s: float = 2.0) -> CodegymServer:
    return CodegymServer(
        [
            "serve",
            "runtime",
            "--port",
            "0",
            "--library",
            str(library),
            "--sandbox",
            workers,
            "--sessions",
            redis.url,
            "--step-lease-s",
            str(lease_s),
        ]
    )


def play(stub: rt_grpc.RuntimeServiceStub, trajectory: dict[str, Any], on_step: Any = None) -> list[str]:
    """One episode; a step whose reply was lost is sent again with its step index."""
    created = stub.CreateSession(
        create_request(env_id=trajectory["env_id"], config=trajectory["config"]),
        timeout=60,
        wait_for_ready=True,
    )
    seen = [created.observation]
    for index, (action, _) in enumerate(trajectory["steps"]):
        if on_step is not None:
            on_step(index)
        request = rt.StepRequest(session_id=created.session_id, action_json=action, step_index=index)
        for attempt in range(20):
            try:
                response = stub.Step(request, timeout=30, wait_for_ready=True)
                break
            except grpc.RpcError as exc:
                if (
                    exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                    or attempt == 19
                ):
                    raise
                time.sleep(0.1)
        assert not response.HasField("error"), response.error
        assert response.step_index == index + 1  # applied once: never twice, never skipped
        seen.append(response.observation)
    assert response.done and response.reward == 1.0
    return seen


@pytest.mark.jail
def test_a_replica_killed_mid_run_loses_no_episode_and_applies_no_step_twice(
    library: Path, workers: str, redis: Redis
) -> None:
    a, b = replica(library, workers, redis), replica(library, workers, redis)
    episodes = [t for t in TRAJECTORIES if len(t["steps"]) >= 12][:64]
    steps_taken = [0]
    killed = threading.Event()
    lock = threading.Lock()

    def on_step(index: int) -> None:
        with lock:
            steps_taken[0] += 1
            if steps_taken[0] == 300 and not killed.is_set():
                killed.set()
                a.proc.send_signal(signal.SIGKILL)

    try:
        with sync_channel([a.address, b.address], [RUNTIME], no_retry=[(RUNTIME, "Step")]) as channel:
            stub = rt_grpc.RuntimeServiceStub(channel)
            with ThreadPoolExecutor(16) as pool:
                results = list(pool.map(lambda t: play(stub, t, on_step), episodes, timeout=300))
        assert killed.is_set()
        for trajectory, seen in zip(episodes, results, strict=True):
            assert seen == [trajectory["first"], *(o for _, o in trajectory["steps"])]
    finally:
        a.stop()
        b.stop()


@pytest.mark.jail
def test_a_worker_killed_and_restarted_under_load_loses_no_session(library: Path, redis: Redis) -> None:
    procs = [CodegymServer(["serve", "sandbox", "--port", "0", "--jails", "1"]) for _ in range(2)]
    sandbox = ",".join(p.address for p in procs)
    a, b = replica(library, sandbox, redis), replica(library, sandbox, redis)
    episodes = [t for t in TRAJECTORIES if len(t["steps"]) >= 12][:32]
    steps_taken = [0]
    lock = threading.Lock()
    port = procs[0].address.rsplit(":", 1)[1]
    went_on = threading.Event()

    def restart() -> None:
        # Back only once the load went on without it: 50 more steps served by the other worker.
        assert went_on.wait(120), "no step after the kill"
        procs[0] = CodegymServer(["serve", "sandbox", "--port", port, "--jails", "1"])

    restarter = threading.Thread(target=restart)

    def on_step(index: int) -> None:
        with lock:
            steps_taken[0] += 1
            if steps_taken[0] == 150:
                procs[0].proc.send_signal(signal.SIGKILL)
                restarter.start()
            elif steps_taken[0] == 200:
                went_on.set()

    try:
        with sync_channel([a.address, b.address], [RUNTIME], no_retry=[(RUNTIME, "Step")]) as channel:
            stub = rt_grpc.RuntimeServiceStub(channel)
            with ThreadPoolExecutor(16) as pool:
                results = list(pool.map(lambda t: play(stub, t, on_step), episodes, timeout=300))
        restarter.join(60)
        for trajectory, seen in zip(episodes, results, strict=True):
            assert seen == [trajectory["first"], *(o for _, o in trajectory["steps"])]
        assert procs[0].proc.poll() is None  # the restarted worker is serving again
    finally:
        a.stop()
        b.stop()
        for proc in procs:
            proc.stop()


@pytest.mark.jail
def test_sigterm_under_load_drains_without_losing_a_step(library: Path, workers: str, redis: Redis) -> None:
    """Every step a client was told succeeded is committed, and every step it was told failed
    (UNAVAILABLE, or CANCELLED for a call that met the server's GOAWAY) was not applied: another
    replica on the same Redis reads exactly the acknowledged step counts."""
    runtime = replica(library, workers, redis)
    episodes = [t for t in TRAJECTORIES if len(t["steps"]) >= 30][:12]
    lock = threading.Lock()
    sent = [0]
    acknowledged: dict[str, int] = {}
    failures: list[str] = []

    def play(trajectory: dict[str, Any]) -> None:
        with grpc.insecure_channel(runtime.address) as channel:
            stub = rt_grpc.RuntimeServiceStub(channel)
            created = stub.CreateSession(
                create_request(env_id=trajectory["env_id"], config=trajectory["config"]), timeout=60
            )
            acknowledged[created.session_id] = 0
            for action, observation in trajectory["steps"]:
                with lock:
                    sent[0] += 1
                    if sent[0] == 120:
                        runtime.proc.send_signal(signal.SIGTERM)
                try:
                    response = stub.Step(
                        rt.StepRequest(session_id=created.session_id, action_json=action), timeout=30
                    )
                except grpc.RpcError as exc:
                    failures.append(exc.code().name)
                    return
                assert response.observation == observation
                acknowledged[created.session_id] += 1

    try:
        with ThreadPoolExecutor(len(episodes)) as pool:
            list(pool.map(play, episodes, timeout=120))
        assert runtime.proc.wait(30) == 0
    finally:
        runtime.stop()
    assert failures and set(failures) <= {"UNAVAILABLE", "CANCELLED"}, failures
    reader = replica(library, workers, redis)
    try:
        with grpc.insecure_channel(reader.address) as channel:
            stub = rt_grpc.RuntimeServiceStub(channel)
            for session_id, count in acknowledged.items():
                stored = stub.GetSession(rt.GetSessionRequest(session_id=session_id), timeout=30)
                assert stored.step_index == count, (session_id, stored.step_index, count)
    finally:
        reader.stop()


@pytest.mark.jail
def test_redis_going_away_is_unavailable_and_the_stack_recovers(
    library: Path, workers: str, redis: Redis, tmp_path: Path
) -> None:
    runtime = replica(library, workers, redis)
    trajectory = next(t for t in TRAJECTORIES if len(t["steps"]) >= 6)
    try:
        with grpc.insecure_channel(runtime.address) as channel:
            stub = rt_grpc.RuntimeServiceStub(channel)
            created = stub.CreateSession(
                create_request(env_id=trajectory["env_id"], config=trajectory["config"]),
                timeout=60,
            )
            first = stub.Step(
                rt.StepRequest(session_id=created.session_id, action_json=trajectory["steps"][0][0]),
                timeout=30,
            )
            assert first.observation == trajectory["steps"][0][1]
            redis.stop()
            with pytest.raises(grpc.RpcError) as info:
                stub.Step(
                    rt.StepRequest(session_id=created.session_id, action_json=trajectory["steps"][1][0]),
                    timeout=30,
                )
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "Redis" in (info.value.details() or "")
            back = Redis(redis.folder, redis.port)  # same port, same append-only file
            try:
                for index, (action, observation) in enumerate(trajectory["steps"][1:], 1):
                    response = stub.Step(
                        rt.StepRequest(session_id=created.session_id, action_json=action, step_index=index),
                        timeout=30,
                    )
                    assert response.observation == observation and response.step_index == index + 1
                assert response.done and response.reward == 1.0
            finally:
                back.stop()
    finally:
        runtime.stop()


@pytest.mark.jail
def test_codegym_up_with_two_runtimes_shares_sessions(tmp_path: Path) -> None:
    require_redis_server()
    up = CodegymServer(
        ["up", "--library", str(tmp_path / "lib.db"), "--port", "0", "--jails", "1", "--runtimes", "2"]
    )
    try:
        wait_until(lambda: "runtime 2 at" in up.text, 30, "codegym up to name its second runtime")
        addresses = [
            line.split(" at ")[1].split()[0]
            for line in up.text.splitlines()
            if re.match(r"runtime \d+ at ", line)
        ]
        assert len(addresses) == 2 and "redis at redis://" in up.text
        trajectory = next(t for t in TRAJECTORIES if len(t["steps"]) >= 4)
        channels = [grpc.insecure_channel(a) for a in addresses]
        try:
            stubs = [rt_grpc.RuntimeServiceStub(c) for c in channels]
            created = stubs[0].CreateSession(
                create_request(env_id=trajectory["env_id"], config=trajectory["config"]),
                timeout=60,
            )
            for index, (action, observation) in enumerate(trajectory["steps"]):
                # Alternate replicas: each step is served by the other one.
                response = stubs[index % 2].Step(
                    rt.StepRequest(session_id=created.session_id, action_json=action), timeout=30
                )
                assert response.observation == observation
        finally:
            for c in channels:
                c.close()
    finally:
        assert up.stop() == 0


# --- The step lease and what a step writes -------------------------------------------------------


def call(
    stub: rt_grpc.RuntimeServiceStub, session_id: str, name: str, index: int | None = None, **parameters: Any
) -> rt.StepResponse:
    action = json.dumps({"name": name, "parameters": parameters})
    request = rt.StepRequest(session_id=session_id, action_json=action)
    if index is not None:
        request.step_index = index
    response: rt.StepResponse = stub.Step(request, timeout=60)
    return response


class Watch:
    """Redis MONITOR in a thread: `seen` is set once commands starting with `prefixes` were run,
    in that order (by anyone). How a test knows where a replica is inside a step without sleeping."""

    def __init__(self, url: str, *prefixes: str) -> None:
        self.client = RedisClient.from_url(url)
        self.seen, self.ready = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._watch, args=(list(prefixes),), daemon=True)
        self.thread.start()
        assert self.ready.wait(10), "MONITOR did not start"

    def _watch(self, prefixes: list[str]) -> None:
        try:
            with self.client.monitor() as monitor:
                self.ready.set()
                while prefixes:
                    if str(monitor.next_command()["command"]).startswith(prefixes[0]):
                        prefixes.pop(0)
                self.seen.set()
        except Exception:  # redis-server stopped under a failed test: nothing left to watch
            self.ready.set()
        finally:
            self.client.close()


class Pair:
    """Two replicas on one Redis, each with its own sandbox worker, and a stub for each."""

    def __init__(self, library: Path, workers: str, redis: Redis, lease_s: float) -> None:
        first, second = workers.split(",")
        self.a = replica(library, first, redis, lease_s)
        try:
            self.b = replica(library, second, redis, lease_s)
        except BaseException:
            self.a.stop()
            raise
        self.channels = [grpc.insecure_channel(self.a.address), grpc.insecure_channel(self.b.address)]
        self.stub_a, self.stub_b = (rt_grpc.RuntimeServiceStub(c) for c in self.channels)
        self.url = redis.url
        self.redis = RedisClient.from_url(redis.url)

    def counter(self, target: int, step_timeout_ms: int = 0) -> str:
        created = self.stub_b.CreateSession(
            create_request(env_id=COUNTER, config={"target": target}, step_timeout_ms=step_timeout_ms),
            timeout=60,
        )
        return str(created.session_id)

    def leased(self, session_id: str) -> bool:
        """Whether some replica holds the session's step lease right now."""
        return bool(self.redis.exists(f"codegym:lock:{session_id}"))

    def close(self) -> None:
        for channel in self.channels:
            channel.close()
        self.redis.close()
        for proc in (self.a, self.b):
            if proc.proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)  # a test that failed with a frozen replica
            proc.stop()


@pytest.fixture
def pair(library: Path, workers: str, redis: Redis) -> Iterator[Pair]:
    replicas = Pair(library, workers, redis, lease_s=1.0)
    try:
        yield replicas
    finally:
        replicas.close()


@pytest.mark.jail
def test_a_step_longer_than_the_lease_keeps_it_and_the_other_replica_waits(pair: Pair) -> None:
    """Lease 1 s, a 3 s step on replica A: the lease is renewed, so B's step of the same session
    starts only after A's step is committed and sees its result. (Unrenewed, the lease would run
    out after 1 s and B would step from the state before A's step, in its own worker.)"""
    session = pair.counter(target=3)
    assert call(pair.stub_b, session, "Add", 0, amount=1).step_index == 1
    with ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        slow = pool.submit(call, pair.stub_a, session, "Slow", ms=3000)
        wait_until(lambda: pair.leased(session), 10, "replica A to take the step lease")
        second = call(pair.stub_b, session, "Observe")
        waited = time.monotonic() - started
        first = slow.result(60)
    assert not first.HasField("error") and (first.step_index, first.observation) == (2, "2")
    assert not second.HasField("error")
    assert (second.step_index, second.observation) == (3, "2")  # after A's step, with its state
    assert waited >= 2.5  # B was held for the whole step, well past the 1 s lease
    stored = pair.stub_a.GetSession(rt.GetSessionRequest(session_id=session), timeout=30)
    assert stored.step_index == 3


@pytest.mark.jail
def test_a_killed_replicas_lease_expires_after_at_most_the_lease(pair: Pair) -> None:
    """SIGKILL of A under a long step: B takes the session once the 1 s lease ran out, and A's
    step, never committed, is not part of the session."""
    session = pair.counter(target=3)
    assert call(pair.stub_b, session, "Add", 0, amount=1).step_index == 1
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(call, pair.stub_a, session, "Slow", ms=5000)
        wait_until(lambda: pair.leased(session), 10, "replica A to take the step lease")
        pair.a.proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        after = call(pair.stub_b, session, "Observe", 1)
        waited = time.monotonic() - killed
        with pytest.raises(grpc.RpcError) as lost:
            slow.result(60)
    assert lost.value.code() == grpc.StatusCode.UNAVAILABLE
    assert (after.step_index, after.observation) == (2, "1")
    assert waited < 1.0 + 1.5, waited  # the lease, plus a cold step in B's worker


@pytest.mark.jail
@pytest.mark.parametrize(
    ("late_tool", "late_parameters"),
    [("Slow", {"ms": 6000}), ("Slow", {"ms": 800})],
    ids=["late-failure", "late-success"],
)
def test_a_replica_frozen_past_its_lease_changes_nothing_when_it_wakes(
    pair: Pair, late_tool: str, late_parameters: dict[str, int]
) -> None:
    """A takes the lease for a step and freezes (SIGSTOP) past the lease; B steps the session on
    and commits; A wakes up and its step ends, failed (timed out) or succeeded. Neither touches
    the session: its step index, state and reward are B's commit's."""
    session = pair.counter(target=3, step_timeout_ms=3000)
    assert call(pair.stub_b, session, "Add", 0, amount=1).observation == "1"
    # A's step has started once Redis served the session to A under A's lease: freeze A then, so it
    # steps from step 1 whatever happens meanwhile.
    reread = Watch(pair.url, f"SET codegym:lock:{session}", f"HGETALL codegym:session:{session}")
    with ThreadPoolExecutor(1) as pool:
        late: Future[rt.StepResponse] = pool.submit(
            call, pair.stub_a, session, late_tool, 1, **late_parameters
        )
        assert reread.seen.wait(10), "replica A did not read the session under its lease"
        os.kill(pair.a.pid, signal.SIGSTOP)
        try:
            frozen = time.monotonic()
            committed = call(pair.stub_b, session, "Add", 1, amount=2)  # waits for A's lease to run out
            waited = time.monotonic() - frozen
            assert not late.done()
        finally:
            os.kill(pair.a.pid, signal.SIGCONT)
        if late_parameters["ms"] > 3000:
            answer = late.result(60)  # the step's own failure, answered to A's caller, not applied
            assert answer.error.code == rt.STEP_ERROR_CODE_STEP_TIMEOUT and answer.step_index == 1
        else:
            with pytest.raises(grpc.RpcError) as refused:
                late.result(60)
            assert refused.value.code() == grpc.StatusCode.ABORTED
    assert not committed.HasField("error") and (committed.step_index, committed.observation) == (2, "3")
    assert waited < 1.0 + 1.5, waited
    for stub in (pair.stub_a, pair.stub_b):
        stored = stub.GetSession(rt.GetSessionRequest(session_id=session), timeout=30)
        assert (stored.step_index, stored.reward, stored.status) == (2, 0.0, rt.SESSION_STATUS_ACTIVE)
    observed = call(pair.stub_a, session, "Observe", 2)
    assert (observed.step_index, observed.observation) == (3, "3")  # B's state, on A too
    done = call(pair.stub_a, session, "Done", 3, answer=3)
    assert (done.step_index, done.reward, done.done) == (4, 1.0, True)


# --- The same properties at the store: what touch, commit and the lease write ------------------


def stored_session(session_id: str, step_index: int, state: bytes) -> Session:
    return Session(
        session_id=session_id,
        env_id=COUNTER,
        config_json='{"target": 3}',
        state=state,
        max_steps=256,
        step_timeout_ms=5000,
        seed=7,
        step_index=step_index,
        reward=0.25 * step_index,
        last_reply=b"reply %d" % step_index,
    )


async def test_a_stale_touch_changes_nothing_in_redis(redis: Redis) -> None:
    """A failed step's touch from step index 1, after another replica committed step 2, is
    refused and leaves the stored session as committed (its TTL too); the current one renews only
    the TTL; a session gone stays gone."""
    store = RedisSessionStore(redis.url, ttl_s=60)
    try:
        await store.put(stored_session("s", 1, b"one"))
        stale = await store.get("s")
        assert stale is not None
        assert await store.commit(stored_session("s", 2, b"two"), 1)
        key = store.key("s")
        await store.redis.pexpire(key, 5000)
        before = await store.redis.hgetall(key)

        assert not await store.touch(stale, 1)
        assert await store.redis.hgetall(key) == before
        assert await store.redis.pttl(key) <= 5000
        now = await store.get("s")
        assert now is not None
        assert (now.step_index, now.state, now.reward, now.last_reply) == (2, b"two", 0.5, b"reply 2")

        assert await store.touch(dataclasses.replace(stale, step_index=2), 2)  # carries stale state
        assert await store.redis.hgetall(key) == before  # ... which is not written
        assert await store.redis.pttl(key) > 5000

        assert await store.delete("s")
        assert not await store.touch(now, 2)
        assert not await store.redis.exists(key)
    finally:
        await store.close()


async def test_a_stale_touch_changes_nothing_in_memory() -> None:
    store = InMemorySessionStore()
    await store.put(stored_session("s", 1, b"one"))
    assert await store.commit(stored_session("s", 2, b"two"), 1)
    await store.put(stored_session("t", 0, b"other"))  # now the most recently used
    stale = stored_session("s", 1, b"one")
    stale.touch(time.monotonic() + 1000)
    assert not await store.touch(stale, 1)
    now = await store.get("s")
    assert now is not None and (now.step_index, now.state) == (2, b"two") and now.last_used < stale.last_used
    assert await store.expire(0) == ["s", "t"]  # oldest used first: the refused touch renewed nothing
    assert not await store.touch(stale, 2)  # gone


async def test_a_lease_is_renewed_and_a_lost_one_refuses_the_commit(
    redis: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """Lease 0.3 s: held for 1.2 s it is still ours and another store (replica) waits for it; taken
    over by another holder, the commit is refused even at the right step index, and neither our
    renewal nor our release touches the new holder's lease."""
    caplog.set_level(logging.WARNING, logger="services.runtime.redis_store")
    mine = RedisSessionStore(redis.url, ttl_s=60, lease_s=0.3)
    other = RedisSessionStore(redis.url, ttl_s=60, lease_s=0.3)
    try:
        await mine.put(stored_session("s", 1, b"one"))
        entered = asyncio.Event()
        order: list[str] = []

        async def second() -> None:
            await entered.wait()
            async with other.lock("s"):
                order.append("other")

        waiting = asyncio.create_task(second())
        async with mine.lock("s"):
            entered.set()
            ends = time.monotonic() + 1.2  # a step four times the lease
            while time.monotonic() < ends:
                assert not waiting.done()
                await asyncio.sleep(0.05)
            assert await mine.commit(stored_session("s", 2, b"two"), 1)
            order.append("mine")
        await asyncio.wait_for(waiting, 10)
        assert order == ["mine", "other"]

        lock = mine.lock_key("s")
        async with mine.lock("s"):
            await mine.redis.set(lock, "taken-over", px=60_000)  # as if ours expired and B took it
            assert not await mine.commit(stored_session("s", 3, b"three"), 2)  # the token check
            deadline = time.monotonic() + 5
            while "lease codegym:lock:s lost" not in caplog.text:  # the next renewal tick finds out
                assert time.monotonic() < deadline, "renewal did not notice the lost lease"
                await asyncio.sleep(0.01)
            assert not await mine.commit(stored_session("s", 3, b"three"), 2)  # refused before Redis
            assert await mine.redis.pttl(lock) > 58_000  # renewal did not shorten the new holder's
        assert await mine.redis.get(lock) == b"taken-over"  # our release left it alone
        stored = await mine.get("s")
        assert stored is not None and (stored.step_index, stored.state) == (2, b"two")
    finally:
        await mine.close()
        await other.close()

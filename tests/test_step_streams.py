"""`AsyncRuntimeClient.step` over the client's shared StepStream calls (codegym_client/step_streams.py):
the same answers, typed errors, resends and deadlines as one unary `Step` per step.

Real sandbox workers (nsjail) and real runtimes throughout: in process where the test counts what
the runtime received (unary Step calls, stream requests, streams open) or sets a limit the command
line does not (`max_steps_in_flight`), as processes sharing Redis where a replica is killed, and as
a process taking a tokens file for access and quotas. Every step is compared with the environment's
own trajectory, recorded in a child interpreter.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from codegym.contract import split_env_id
from codegym.library.store import Library
from codegym.server.grpcutil import ManagedServer
from codegym_client import (
    AsyncRuntimeClient,
    CapacityExceeded,
    CodeGymError,
    RuntimeUnavailable,
    SessionDone,
    SessionNotFound,
    StepConflict,
    Unauthenticated,
)
from codegym_client.api.runtime.v1 import runtime_service_pb2 as rt
from codegym_client.channels import TLS_CA_ENV, TOKEN_ENV
from codegym_client.errors import reason_sent
from codegym_client.step_streams import STREAMS
from services.dispatcher import SandboxDispatcher
from services.runtime.catalog import Catalog
from services.runtime.config import RuntimeConfig
from services.runtime.server import RuntimeServer
from services.runtime.service import SERVICE_NAME, RuntimeServicer, add_to_server
from services.runtime.sessions import InMemorySessionStore
from services.runtime.settings import RuntimeSettings
from tests.conftest import ENV_DIR, ROOT, SAMPLES
from tests.helpers.libraries import SAMPLE_LIBRARY, library_fixture
from tests.helpers.servers import CodegymServer, Redis, workers_fixture
from tests.helpers.trajectories import record

pytestmark = pytest.mark.jail

COUNTER = "Test_0001_I__CounterEnv"
RUNTIME_ENVS = ROOT / "tests" / "fixtures" / "runtime_envs"
PUBLISHED = [json.loads(x) for x in (SAMPLES / "trajectories.jsonl").read_text().splitlines() if x.strip()]
OBSERVE = '{"name": "Observe", "parameters": {}}'
TRANSPORTS = ("stream", "unary")
WAIT_S = 60.0

library = library_fixture(SAMPLE_LIBRARY, [RUNTIME_ENVS / f"{COUNTER}.py"])
workers = workers_fixture(addresses=True, clean_stop=False)


def add(amount: int) -> str:
    return json.dumps({"name": "Add", "parameters": {"amount": amount}})


def slow(ms: int) -> str:
    return json.dumps({"name": "Slow", "parameters": {"ms": ms}})


@pytest.fixture(scope="module")
def recorded() -> list[dict[str, Any]]:
    """Oracle trajectories of published tasks (at least 6 steps each), recorded in a child interpreter."""
    tasks = [t for t in PUBLISHED][::3]
    jobs = [
        {
            "path": str(ENV_DIR / f"{t['env_id']}.py"),
            "class": split_env_id(t["env_id"])[1],
            "config": t["config"],
        }
        for t in tasks
    ]
    played = [
        {"env_id": t["env_id"], "config": t["config"], **p} for t, p in zip(tasks, record(jobs), strict=True)
    ]
    return [t for t in played if len(t["steps"]) >= 6][:24]


# ---- an in-process runtime that counts what it received --------------------------------------------


class CountingServicer(RuntimeServicer):
    """The runtime, counting unary Step calls, StepStream requests read, and StepStream calls open."""

    def __init__(self, library: Path, dispatcher: SandboxDispatcher, config: RuntimeConfig) -> None:
        super().__init__(Catalog(library), InMemorySessionStore(), dispatcher, config)
        self.unary = 0
        self.read = 0
        self.opened = 0
        self.open = 0

    async def Step(self, request: rt.StepRequest, context: grpc.aio.ServicerContext) -> rt.StepResponse:
        self.unary += 1
        return await super().Step(request, context)

    async def StepStream(
        self, request_iterator: AsyncIterator[rt.StepStreamRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[rt.StepStreamResponse]:
        async def counted() -> AsyncIterator[rt.StepStreamRequest]:
            async for request in request_iterator:
                self.read += 1
                yield request

        self.opened += 1
        self.open += 1
        try:
            async for answer in super().StepStream(counted(), context):
                yield answer
        finally:
            self.open -= 1


@contextlib.asynccontextmanager
async def in_process(
    library: Path, workers: str, **config: Any
) -> AsyncIterator[tuple[CountingServicer, str]]:
    dispatcher = SandboxDispatcher(workers.split(","))
    servicer = CountingServicer(library, dispatcher, RuntimeConfig(**config))
    server = ManagedServer([SERVICE_NAME])
    add_to_server(servicer, server.server)
    await server.start()
    try:
        yield servicer, server.address
    finally:
        await server.drain(1.0)
        await dispatcher.close()


async def until(condition: Callable[[], bool | Awaitable[bool]], what: str) -> None:
    """Wait for a condition (polled), failing the test after `WAIT_S`."""
    deadline = time.monotonic() + WAIT_S
    while True:
        held = condition()
        if not isinstance(held, bool):
            held = await held
        if held:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} after {WAIT_S:.0f} s")
        await asyncio.sleep(0.02)


async def play(client: AsyncRuntimeClient, trajectory: dict[str, Any]) -> list[rt.StepResponse | str]:
    """A recorded trajectory's actions, one step after the other: the first observation, then each
    step's response."""
    created = await client.create_session(env_id=trajectory["env_id"], config=trajectory["config"])
    seen: list[rt.StepResponse | str] = [created.observation]
    for action, _ in trajectory["steps"]:
        seen.append(await client.step(created.session_id, action))
    return seen


def assert_as_recorded(trajectory: dict[str, Any], seen: list[rt.StepResponse | str]) -> None:
    first, *steps = seen
    assert first == trajectory["first"], trajectory["env_id"]
    responses = [s for s in steps if isinstance(s, rt.StepResponse)]
    assert [r.observation for r in responses] == [o for _, o in trajectory["steps"]], trajectory["env_id"]
    assert [r.step_index for r in responses] == list(range(1, len(trajectory["steps"]) + 1))
    assert responses[-1].done and responses[-1].reward == trajectory["reward"], trajectory["env_id"]


def client_tasks() -> list[asyncio.Task[Any]]:
    """The shared streams' own tasks still running in this loop (each stream's reader and writer)."""
    return [
        task
        for task in asyncio.all_tasks()
        if not task.done() and getattr(task.get_coro(), "__qualname__", "").startswith("Lane.")
    ]


# ---- the same answers --------------------------------------------------------------------------------


async def test_stream_and_unary_steps_play_recorded_trajectories_alike(
    library: Path, workers: str, recorded: list[dict[str, Any]]
) -> None:
    """Every recorded episode, all at once, over the shared streams and then over unary calls: the
    same responses, as recorded; the streams' steps reach the runtime as stream requests only, on
    at most `STREAMS` calls, and the unary ones as Step calls only."""
    steps = sum(len(t["steps"]) for t in recorded)
    played: dict[str, list[list[rt.StepResponse | str]]] = {}
    async with in_process(library, workers) as (servicer, address):
        for transport in TRANSPORTS:
            unary, read, opened = servicer.unary, servicer.read, servicer.opened
            async with AsyncRuntimeClient(address, timeout_s=60, step_transport=transport) as client:
                assert client.step_transport == transport
                played[transport] = list(await asyncio.gather(*(play(client, t) for t in recorded)))
                assert client.streams.in_flight() == 0 and not client.streams.where
            if transport == "stream":
                assert (servicer.unary - unary, servicer.read - read) == (0, steps)
                assert 1 <= servicer.opened - opened <= STREAMS
            else:
                assert (servicer.unary - unary, servicer.read - read, servicer.opened - opened) == (
                    steps,
                    0,
                    0,
                )
        await until(lambda: servicer.open == 0, "stream left open by a closed client")
    for trajectory, seen in zip(recorded, played["stream"], strict=True):
        assert_as_recorded(trajectory, seen)
    assert [seen[1:] for seen in played["stream"]] == [seen[1:] for seen in played["unary"]]


def test_a_client_with_interceptors_steps_over_unary_calls_unless_told() -> None:
    """A shared stream carries the metadata of the call that opened it: a client whose interceptors
    add per-call metadata (the OpenEnv gateway's tenant) keeps unary steps by default."""

    class Marker(grpc.aio.UnaryUnaryClientInterceptor):
        async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
            return await continuation(details, request)

    async def main() -> tuple[str, str, str]:
        plain = AsyncRuntimeClient("127.0.0.1:1")
        fronted = AsyncRuntimeClient("127.0.0.1:1", interceptors=[Marker()])
        told = AsyncRuntimeClient("127.0.0.1:1", interceptors=[Marker()], step_transport="stream")
        for client in (plain, fronted, told):
            await client.close()
        return plain.step_transport, fronted.step_transport, told.step_transport

    assert asyncio.run(main()) == ("stream", "unary", "stream")
    with pytest.raises(ValueError, match="step_transport must be one of stream, unary, not 'udp'"):
        asyncio.run(_make(step_transport="udp"))
    with pytest.raises(ValueError, match="step_streams must be at least 1"):
        asyncio.run(_make(step_streams=0))


async def _make(**options: Any) -> None:
    await AsyncRuntimeClient("127.0.0.1:1", **options).close()


# ---- the same errors -------------------------------------------------------------------------------


def signature(error: CodeGymError, session_ids: list[str]) -> tuple[Any, ...]:
    """What a caller can see of an error, session ids written out."""
    details = error.details()
    for sid in session_ids:
        details = details.replace(sid, "<sid>").replace(sid[:8], "<sid>")
    cause = error.__cause__
    return (
        type(error),
        error.reason,
        error.code(),
        error.retryable,
        error.infrastructure,
        error.retry_after_s,
        error.method,
        details,
        isinstance(cause, grpc.RpcError) and not isinstance(cause, CodeGymError),
    )


async def refusals(client: AsyncRuntimeClient, servicer: CountingServicer) -> list[Any]:
    """Each refusal a step can meet, and the step errors that are answers, in one list."""
    ids: list[str] = []
    seen: list[Any] = []

    async def counter(target: int = 5) -> str:
        sid = (await client.create_session(env_id=COUNTER, config={"target": target})).session_id
        ids.append(sid)
        return sid

    async def refused(sid: str, action: str, **options: Any) -> None:
        with pytest.raises(CodeGymError) as info:
            await client.step(sid, action, **options)
        seen.append(signature(info.value, ids))

    await refused("f" * 32, OBSERVE)  # never opened
    closed = await counter()
    assert await client.close_session(closed)
    await refused(closed, OBSERVE)
    done = await counter(1)
    await client.step(done, add(1))
    assert (await client.step(done, json.dumps({"name": "Done", "parameters": {"answer": 1}}))).done
    await refused(done, OBSERVE)
    moved = await counter()
    await refused(moved, OBSERVE, step_index=7)  # ahead of the session: a conflict, nothing applied
    # Step errors are answers (the session unchanged), over either transport.
    for action in ("{not json", '{"name": "Fly", "parameters": {}}', '{"name": "Boom", "parameters": {}}'):
        answer = await client.step(moved, action)
        seen.append((answer.error.code, answer.step_index, answer.observation))
    # CAPACITY with its retry-after: one step in flight is the runtime's limit here.
    busy = await counter()
    running = asyncio.create_task(client.step(busy, slow(1500)))
    await until(lambda: bool(servicer.steps_in_flight), "slow step running")
    await refused(moved, OBSERVE)
    assert (await running).observation == "1"
    seen.append((await client.step(moved, OBSERVE)).step_index)
    return seen


async def test_refused_steps_raise_what_a_unary_step_raises(library: Path, workers: str) -> None:
    """The same exception (type, reason, status, retry-after, details, a raw gRPC error as its
    cause) for an unknown, closed or ended session, a step index ahead of the session and CAPACITY;
    the same step errors for bad JSON, an unknown tool and bad parameters."""
    outcomes = {}
    async with in_process(library, workers, max_steps_in_flight=1) as (servicer, address):
        for transport in TRANSPORTS:
            async with AsyncRuntimeClient(address, timeout_s=60, step_transport=transport) as client:
                outcomes[transport] = await refusals(client, servicer)
    assert outcomes["stream"] == outcomes["unary"]
    errors = outcomes["stream"]
    assert [e[:3] for e in errors[:4]] == [
        (SessionNotFound, "SESSION_NOT_FOUND", grpc.StatusCode.NOT_FOUND),
        (SessionNotFound, "SESSION_NOT_FOUND", grpc.StatusCode.NOT_FOUND),
        (SessionDone, "SESSION_DONE", grpc.StatusCode.FAILED_PRECONDITION),
        (StepConflict, "STEP_CONFLICT", grpc.StatusCode.ABORTED),
    ]
    assert [e[0] for e in errors[4:7]] == [
        rt.STEP_ERROR_CODE_INVALID_ACTION,
        rt.STEP_ERROR_CODE_UNKNOWN_TOOL,
        rt.STEP_ERROR_CODE_ENV_ERROR,
    ] and all(e[1] == 0 for e in errors[4:7])
    capacity = errors[7]
    assert capacity[:3] == (CapacityExceeded, "CAPACITY", grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert capacity[5] == 0.1 and capacity[3] and capacity[8]  # retry-after 100 ms, retryable, raw cause
    assert errors[8] == 1  # the refused step applied nothing: the next one is the session's first


# ---- deadlines -------------------------------------------------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_step_past_its_deadline_raises_as_a_unary_step_does(
    library: Path, workers: str, transport: str
) -> None:
    """A step slower than the client's deadline is sent twice (the second time once late, with its
    index), then raises `RuntimeUnavailable` with DEADLINE_EXCEEDED after about twice `timeout_s`.
    On a stream the step cannot be called back: it runs, once, and the session's next step runs
    after it (on the same stream), never beside it."""
    async with in_process(library, workers) as (servicer, address):
        async with AsyncRuntimeClient(address, timeout_s=30) as owner:
            sid = (await owner.create_session(env_id=COUNTER, config={"target": 5})).session_id
        async with AsyncRuntimeClient(address, timeout_s=1.0, step_transport=transport) as client:
            started = time.monotonic()
            with pytest.raises(RuntimeUnavailable) as info:
                await client.step(sid, slow(2500), step_index=0)
            elapsed = time.monotonic() - started
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and info.value.retryable
            assert info.value.method == "Step" and 2.0 <= elapsed < 3.5, elapsed
            client.timeout_s = 30
            after = await client.step(sid, OBSERVE)
            if transport == "stream":
                assert (after.observation, after.step_index) == ("1", 2)
                await until(lambda: client.streams.in_flight() == 0, "answers of the given-up sends")
            else:  # the cancelled call may or may not have applied the step
                assert (after.observation, after.step_index) in (("0", 1), ("1", 2))
        assert (servicer.unary > 0) == (transport == "unary")


# ---- closing ---------------------------------------------------------------------------------------


async def test_closing_the_client_fails_its_steps_in_flight_and_ends_its_streams(
    library: Path, workers: str
) -> None:
    """Steps in flight when the client closes raise a typed CANCELLED at once (not resent); the
    client's stream tasks are gone, and so are the runtime's streams and the steps it ran for them."""
    async with in_process(library, workers) as (servicer, address):
        client = AsyncRuntimeClient(address, timeout_s=60)
        sids = [
            (await client.create_session(env_id=COUNTER, config={"target": 5})).session_id for _ in range(6)
        ]
        steps = [asyncio.create_task(client.step(sid, slow(3000))) for sid in sids]
        await until(lambda: len(servicer.steps_in_flight) == len(sids), "slow steps running")
        assert client.streams.in_flight() == len(sids) and client_tasks()
        started = time.monotonic()
        await client.close()
        outcomes = await asyncio.gather(*steps, return_exceptions=True)
        assert time.monotonic() - started < 2.0
        for outcome in outcomes:
            assert isinstance(outcome, CodeGymError) and outcome.code() == grpc.StatusCode.CANCELLED, outcome
            assert "closed" in outcome.details()
        assert not client_tasks() and not client.streams.lanes and not client.streams.where
        await until(lambda: servicer.open == 0 and not servicer.steps_in_flight, "runtime streams ended")
        with pytest.raises(Exception, match="Channel is closed"):  # as a unary call after close
            await client.step(sids[0], OBSERVE)


# ---- streams retire ----------------------------------------------------------------------------------


async def test_streams_retire_and_end_cleanly_while_episodes_play(
    library: Path, workers: str, recorded: list[dict[str, Any]]
) -> None:
    """With a lifetime of zero every new session's step retires the open streams: episodes still
    play as recorded (a session's steps in flight keep it on its stream), the retired streams end
    cleanly once answered, and at most `STREAMS` stay open."""
    async with (
        in_process(library, workers) as (servicer, address),
        AsyncRuntimeClient(address, timeout_s=60) as client,
    ):
        client.streams.lifetime_s = 0.0
        played = await asyncio.gather(*(play(client, t) for t in recorded[:12]))
        for trajectory, seen in zip(recorded[:12], played, strict=True):
            assert_as_recorded(trajectory, seen)
        assert servicer.opened > STREAMS and client.streams.broken == 0
        await until(lambda: servicer.open <= STREAMS, "retired streams ended")
        assert len(client.streams.lanes) == servicer.open and client.streams.in_flight() == 0


# ---- a replica killed mid-stream ---------------------------------------------------------------------

LEASE_S = "2"


@pytest.fixture
def redis() -> Iterator[Redis]:
    server = Redis()
    try:
        yield server
    finally:
        server.stop()


def replica(library: Path, workers: str, redis: Redis) -> CodegymServer:
    args = ["serve", "runtime", "--port", "0", "--library", str(library), "--sandbox", workers]
    return CodegymServer([*args, "--sessions", redis.url, "--step-lease-s", LEASE_S])


async def test_a_replica_killed_mid_stream_costs_no_step(
    library: Path, workers: str, redis: Redis, recorded: list[dict[str, Any]]
) -> None:
    """Two replicas sharing Redis, one client over both (round robin: its streams land on both),
    every recorded episode at once; one replica is SIGKILLed mid-play. The steps in flight on its
    streams fail UNAVAILABLE, are resent with their index through the other replica, and every
    episode plays exactly as recorded: no step lost, none applied twice."""
    a, b = replica(library, workers, redis), replica(library, workers, redis)
    total = sum(len(t["steps"]) for t in recorded)
    answered = [0]
    try:
        async with AsyncRuntimeClient([a.address, b.address], timeout_s=60, attempts=30) as client:

            async def counted(trajectory: dict[str, Any]) -> list[rt.StepResponse | str]:
                created = await client.create_session(
                    env_id=trajectory["env_id"], config=trajectory["config"]
                )
                seen: list[rt.StepResponse | str] = [created.observation]
                for action, _ in trajectory["steps"]:
                    seen.append(await client.step(created.session_id, action))
                    answered[0] += 1
                return seen

            playing = asyncio.gather(*(counted(t) for t in recorded))
            await until(lambda: answered[0] >= total // 4 and client.streams.in_flight() > 0, "steps played")
            a.proc.send_signal(signal.SIGKILL)
            played = await playing
            assert a.proc.wait(10) == -signal.SIGKILL
            assert client.streams.broken >= 1  # a stream broke with steps in flight, which were resent
            for trajectory, seen in zip(recorded, played, strict=True):
                assert_as_recorded(trajectory, seen)
    finally:
        a.stop()
        b.stop()


# ---- access: the stream carries the trainer's token ----------------------------------------------------

TOKENS = {
    "tokens": {
        "tight-token": {"tenant": "tight", "role": "trainer"},
        "roomy-token": {"tenant": "roomy", "role": "trainer"},
        "service-token": {"tenant": "services", "role": "service"},
    },
    "tenants": {"tight": {"steps_per_s": 4}},
}
CLEAN_ENV = {k: v for k, v in os.environ.items() if k not in (TOKEN_ENV, TLS_CA_ENV)}


@pytest.fixture(scope="module")
def guarded_runtime(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CodegymServer]:
    folder = tmp_path_factory.mktemp("access")
    (folder / "tokens.json").write_text(json.dumps(TOKENS))
    with Library(folder / "library.db") as lib:
        lib.import_paths([ENV_DIR, SAMPLES / "tasks.jsonl"])
    tokens = ["--tokens", str(folder / "tokens.json")]
    worker = CodegymServer(["serve", "sandbox", "--port", "0", "--jails", "1", *tokens], env=CLEAN_ENV)
    args = ["serve", "runtime", "--port", "0", "--library", str(folder / "library.db"), "--no-record"]
    runtime = CodegymServer(
        [*args, "--sandbox", worker.address, *tokens], env={**CLEAN_ENV, TOKEN_ENV: "service-token"}
    )
    try:
        yield runtime
    finally:
        runtime.stop()
        worker.stop()


async def test_steps_over_the_stream_carry_the_trainers_token_and_tenant(
    guarded_runtime: CodegymServer,
) -> None:
    """A trainer's token steps over the stream; its tenant's step quota answers CAPACITY with a
    retry-after, honoured; another tenant's session is unknown to it; an unknown token is refused
    once (UNAUTHENTICATED, not resent), all as over unary calls."""
    address = guarded_runtime.address
    ability = 'codegym_v1@Sample_0001_I__MaxSubarraySumEnv@{"nums": [1]}'
    async with (
        AsyncRuntimeClient(address, token="roomy-token") as roomy,
        AsyncRuntimeClient(address, token="tight-token", attempts=1) as tight,
        AsyncRuntimeClient(address, token="not-a-token") as stranger,
    ):
        mine = (await roomy.create_session(ability=ability)).session_id
        assert (await roomy.step(mine, OBSERVE)).step_index == 1
        theirs = (await tight.create_session(ability=ability)).session_id
        refusals: list[CapacityExceeded] = []
        served = 0
        while not refusals or served < 6:
            try:
                await tight.step(theirs, OBSERVE)
                served += 1
            except CapacityExceeded as exc:
                assert (
                    exc.reason == "CAPACITY" and exc.retry_after_s is not None and 0 < exc.retry_after_s <= 1
                )
                refusals.append(exc)
                await asyncio.sleep(exc.retry_after_s)
        assert (await tight.get_session(theirs)).step_index == served
        for _ in range(50):  # the quota may be spent still: wait out each CAPACITY's retry-after
            try:
                await tight.step(mine, OBSERVE)
            except CapacityExceeded as exc:
                await asyncio.sleep(exc.retry_after_s or 0.1)
            except SessionNotFound:
                break
        else:
            pytest.fail("the step quota never let a step through")
        started = time.monotonic()
        with pytest.raises(Unauthenticated):
            await stranger.step(mine, OBSERVE, step_index=1)
        assert time.monotonic() - started < 2.0
        assert (await roomy.get_session(mine)).step_index == 1
        assert roomy.streams.broken == 0 and tight.step_transport == "stream"


# ---- a runtime that stops --------------------------------------------------------------------------


async def test_a_stopping_runtime_refuses_new_steps_on_its_streams_and_ends_them(
    library: Path, workers: str
) -> None:
    """A runtime draining finishes the steps its streams hold and refuses every one sent after
    (UNAVAILABLE with its reason, nothing applied, and `stopping`): the client resends such a step
    at once even without an index, on another stream, and closes the refused streams, which the
    runtime then ends cleanly. The step is never applied by the stopping runtime."""
    async with (
        in_process(library, workers) as (servicer, address),
        AsyncRuntimeClient(address, timeout_s=60) as owner,
        AsyncRuntimeClient(address, timeout_s=60, attempts=3) as client,
    ):
        running, refused = [
            (await owner.create_session(env_id=COUNTER, config={"target": 5})).session_id for _ in range(2)
        ]
        slow_step = asyncio.create_task(client.step(running, slow(1500)))
        await until(lambda: bool(servicer.steps_in_flight), "slow step running")
        servicer.draining = True
        with pytest.raises(RuntimeUnavailable) as info:
            await client.step(refused, OBSERVE)  # a session this client never saw: no index
        # The runtime's own reason (not the status's default): nothing applied, so it was resent,
        # each time on a new stream, each refused and retired.
        assert reason_sent(info.value.trailing_metadata()) == "UNAVAILABLE" and info.value.retryable
        assert "stopping" in info.value.details()
        assert client.streams.drained == 3
        assert (await slow_step).observation == "1"  # the step it held was run and answered
        # The refused streams were closed by the client and ended; the slow step's, never sent
        # another step, is still open (the server's own stop ends it).
        await until(lambda: servicer.open == 1 and len(client.streams.lanes) == 1, "refused streams ended")
        assert client.streams.in_flight() == 0 and client.streams.broken == 0
        assert (await owner.get_session(refused)).step_index == 0
        servicer.draining = False
        assert (await client.step(refused, OBSERVE)).step_index == 1


async def test_a_runtime_stopping_mid_play_costs_no_step_even_without_indexes(
    library: Path, workers: str, redis: Redis, recorded: list[dict[str, Any]]
) -> None:
    """Two runtimes in process sharing Redis; the sessions are another client's, and the client
    that steps them forgets each index, so it may resend a step only when the runtime said nothing
    of it was applied. One runtime stops (drains, as on SIGTERM) mid-play: the steps it was running
    finish, those sent to its streams after are refused or never read, and are sent again to the
    other runtime; every episode plays as recorded. (Unary steps without an index can be lost
    here: a call the stopping runtime had taken but not started ends CANCELLED, which may or may
    not have been applied.)"""
    settings = RuntimeSettings(
        library=str(library), sandbox=workers, port=0, sessions=redis.url, no_record=True
    )
    a, b = RuntimeServer(settings), RuntimeServer(settings)
    await a.start()
    await b.start()
    total = sum(len(t["steps"]) for t in recorded)
    answered = [0]
    stopped = False
    try:
        async with (
            AsyncRuntimeClient([a.address, b.address], timeout_s=60) as owner,
            AsyncRuntimeClient([a.address, b.address], timeout_s=60) as client,
        ):
            created = [await owner.create_session(env_id=t["env_id"], config=t["config"]) for t in recorded]

            async def steps_of(
                trajectory: dict[str, Any], sid: str, first: str
            ) -> list[rt.StepResponse | str]:
                seen: list[rt.StepResponse | str] = [first]
                for action, _ in trajectory["steps"]:
                    client.indexes.forget(sid)  # as a client that never saw the session
                    seen.append(await client.step(sid, action))
                    answered[0] += 1
                return seen

            playing = asyncio.gather(
                *(steps_of(t, c.session_id, c.observation) for t, c in zip(recorded, created, strict=True))
            )
            await until(lambda: answered[0] >= total // 4, "steps played")
            await a.stop(5.0)
            stopped = True
            played = await playing
            for trajectory, seen in zip(recorded, played, strict=True):
                assert_as_recorded(trajectory, seen)
    finally:
        if not stopped:
            await a.stop(0)
        await b.stop(0)

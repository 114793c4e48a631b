"""StepStream back-pressure: a client that does not read its answers holds back its own stream.

A step keeps its `max_batch` slot until gRPC has taken its answer, and the runtime reads a request
only with a slot free: at most `max_batch` steps of a stream are running or answered-but-unsent,
and the requests past them wait in HTTP/2 flow control, on the client's side. Real sandbox workers
(a process on loopback) and a real runtime, in process here so that `max_batch` can be small (the
`codegym serve runtime` command line does not set it) and the answers gRPC took can be counted.

Answers echo their request's tag, so a big tag makes big answers: gRPC's flow-control windows (a
few MB) then hold only a few of the answers a client does not read, and the rest must wait in the
runtime, each on its slot. What the runtime ran is read as the sessions' step indexes, through
GetSession on another channel, whose steps go as unary calls (`step_transport="unary"`): the
runtime's stream counts are the test's stream's alone.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc
import pytest
from google.protobuf.message import DecodeError

from codegym.errors import Undecodable
from codegym.server.grpcutil import ManagedServer
from codegym_client.api.runtime.v1 import runtime_service_pb2 as rt
from codegym_client.async_client import AsyncRuntimeClient
from codegym_client.async_client import StepStream as ClientStepStream
from services.dispatcher import SandboxDispatcher
from services.runtime.catalog import Catalog
from services.runtime.config import RuntimeConfig
from services.runtime.service import SERVICE_NAME, RuntimeServicer, add_to_server
from services.runtime.sessions import InMemorySessionStore
from services.runtime.streaming import step_stream
from tests.conftest import ENV_DIR
from tests.helpers.libraries import library_fixture
from tests.helpers.servers import CodegymServer, workers_fixture

ENV = "Sample_0001_I__MaxSubarraySumEnv"
MAX_BATCH = 4
SESSIONS = 8
STEPS = 25  # per session
TOTAL = SESSIONS * STEPS
PAD = 256 * 1024  # bytes of tag per step: 200 answers of 256 KB are far more than gRPC buffers
DEADLINE_S = 60.0


library = library_fixture([ENV_DIR / f"{ENV}.py"])
workers = workers_fixture(1)


class CountingServicer(RuntimeServicer):
    """The runtime, counting the StepStream requests it read and the answers gRPC took from it
    (sent, or buffered in gRPC's transport for a client that does not read)."""

    def __init__(self, library: Path, dispatcher: SandboxDispatcher) -> None:
        config = RuntimeConfig(max_batch=MAX_BATCH)
        super().__init__(Catalog(library), InMemorySessionStore(), dispatcher, config)
        self.read = 0
        self.handed = 0

    async def StepStream(
        self, request_iterator: AsyncIterator[rt.StepStreamRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[rt.StepStreamResponse]:
        async def counted() -> AsyncIterator[rt.StepStreamRequest]:
            async for request in request_iterator:
                self.read += 1
                yield request

        async for answer in super().StepStream(counted(), context):
            yield answer
            self.handed += 1  # gRPC asks for the next answer: it has taken this one


@contextlib.asynccontextmanager
async def runtime(library: Path, workers: list[CodegymServer]) -> AsyncIterator[tuple[CountingServicer, str]]:
    dispatcher = SandboxDispatcher([w.address for w in workers])
    servicer = CountingServicer(library, dispatcher)
    server = ManagedServer([SERVICE_NAME])
    add_to_server(servicer, server.server)
    await server.start()
    try:
        yield servicer, server.address
    finally:
        await server.drain(1.0)
        await dispatcher.close()


def numbers(k: int) -> list[int]:
    """Session k's hidden array: GetElement(j) answers 1000k + j, so an answer names its step."""
    return list(range(1000 * k, 1000 * k + STEPS))


def get(index: int) -> dict[str, object]:
    return {"name": "GetElement", "parameters": {"index": index}}


async def open_sessions(client: AsyncRuntimeClient) -> list[str]:
    return [
        (await client.create_session(env_id=ENV, config={"nums": numbers(k)})).session_id
        for k in range(SESSIONS)
    ]


async def send_all(stream: ClientStepStream, sessions: list[str]) -> None:
    """Every session's steps, round robin, each tagged `k:j:` and padded."""
    for j in range(STEPS):
        for k, sid in enumerate(sessions):
            await stream.send(sid, get(j), tag=f"{k}:{j}:".ljust(PAD, "x"))


async def steps_run(observer: AsyncRuntimeClient, sessions: list[str]) -> int:
    return sum([(await observer.get_session(sid)).step_index for sid in sessions])


async def until(condition: Callable[[], Awaitable[bool]], what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE_S
    while not await condition():
        if loop.time() > deadline:
            pytest.fail(f"no {what} after {DEADLINE_S:.0f} s")
        await asyncio.sleep(0.05)


async def bounded(servicer: CountingServicer, observer: AsyncRuntimeClient, sessions: list[str]) -> int:
    """Check the bound and return the steps run. The step indexes are read first: both counts only
    grow, so the check can only be loose, never fail while the runtime kept the bound."""
    run = await steps_run(observer, sessions)
    handed, read = servicer.handed, servicer.read
    assert run <= handed + MAX_BATCH, f"{run} steps run but only {handed} answers taken by gRPC"
    assert read <= handed + MAX_BATCH, f"{read} requests read but only {handed} answers taken by gRPC"
    return run


async def stalled(servicer: CountingServicer, observer: AsyncRuntimeClient, sessions: list[str]) -> None:
    """Wait until every slot holds an answer gRPC did not take (none running), checking the bound."""

    async def full() -> bool:
        run = await bounded(servicer, observer, sessions)
        return run == servicer.handed + MAX_BATCH and not servicer.steps_in_flight

    await until(full, f"stream holding {MAX_BATCH} unsent answers")


async def settle(client: AsyncRuntimeClient) -> None:
    """A step of a session outside the stream, answered: the runtime went on serving meanwhile."""
    sid = (await client.create_session(env_id=ENV, config={"nums": [7, 8, 9]})).session_id
    answer = await client.step(sid, get(2))
    assert (answer.observation, answer.step_index) == ("9", 1)


def stream_tasks() -> list[asyncio.Task[object]]:
    """The runtime's StepStream tasks still alive in this loop (its reader, its steps)."""
    return [
        task
        for task in asyncio.all_tasks()
        if not task.done() and getattr(task.get_coro(), "__qualname__", "").startswith("step_stream.")
    ]


@pytest.mark.jail
async def test_a_client_that_does_not_read_holds_back_its_steps(
    library: Path, workers: list[CodegymServer]
) -> None:
    async with (
        runtime(library, workers) as (servicer, address),
        AsyncRuntimeClient(address, timeout_s=60) as client,
        AsyncRuntimeClient(address, timeout_s=60, step_transport="unary") as observer,
    ):
        sessions = await open_sessions(client)
        stream = client.step_stream()
        sending = asyncio.create_task(send_all(stream, sessions))
        # No answer read: the runtime runs as many steps as gRPC took answers, plus max_batch.
        await stalled(servicer, observer, sessions)
        await settle(observer)
        run = await bounded(servicer, observer, sessions)
        assert run < TOTAL and servicer.read < TOTAL, (run, servicer.read)

        answers: list[rt.StepStreamResponse] = []
        while len(answers) < TOTAL:
            answer = await stream.recv()
            assert answer is not None, f"the stream ended after {len(answers)} answers"
            answers.append(answer)
            if len(answers) % 40 == 0:
                await bounded(servicer, observer, sessions)
        await sending
        await stream.done_sending()
        assert await stream.recv() is None

        order: dict[int, list[int]] = {k: [] for k in range(SESSIONS)}
        for answer in answers:
            k, j, pad = answer.tag.split(":", 2)
            k_, j_ = int(k), int(j)
            assert answer.code == 0, answer.message
            assert answer.session_id == sessions[k_] and len(answer.tag) == PAD and set(pad) <= {"x"}
            assert not answer.response.HasField("error"), answer.response.error
            assert answer.response.observation == str(numbers(k_)[j_])
            assert answer.response.step_index == j_ + 1  # applied in the order sent
            order[k_].append(j_)
        assert order == {k: list(range(STEPS)) for k in range(SESSIONS)}  # and answered in that order
        assert [(await observer.get_session(sid)).step_index for sid in sessions] == [STEPS] * SESSIONS
        assert (servicer.read, servicer.handed) == (TOTAL, TOTAL)


@pytest.mark.jail
async def test_a_client_that_never_reads_then_cancels_leaves_the_runtime_healthy(
    library: Path, workers: list[CodegymServer]
) -> None:
    async with (
        runtime(library, workers) as (servicer, address),
        AsyncRuntimeClient(address, timeout_s=60) as client,
        AsyncRuntimeClient(address, timeout_s=60, step_transport="unary") as observer,
    ):
        sessions = await open_sessions(client)
        stream = client.step_stream()
        sending = asyncio.create_task(send_all(stream, sessions))
        await stalled(servicer, observer, sessions)
        # The client goes away without having read an answer: it stops sending, cancels the call.
        sending.cancel()
        stream.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sending

        async def let_go() -> bool:
            return not stream_tasks() and not servicer.steps_in_flight

        await until(let_go, "end of the cancelled stream's reader and steps")
        run = await bounded(servicer, observer, sessions)
        assert run < TOTAL

        await settle(observer)  # a new session steps
        for k, sid in enumerate(sessions):  # and the stream's sessions go on where they stopped
            done = (await observer.get_session(sid)).step_index
            answer = await observer.step(sid, get(done))
            assert (answer.observation, answer.step_index) == (str(numbers(k)[done]), done + 1)

        again = observer.step_stream()  # and a new stream works
        for k, sid in enumerate(sessions):
            await again.send(sid, {"name": "Observe", "parameters": {}}, tag=str(k))
        await again.done_sending()
        tags = []
        while (answer := await again.recv()) is not None:
            assert (answer.code, answer.response.observation) == (0, str(STEPS)), answer.message
            tags.append(answer.tag)
        assert sorted(tags) == [str(k) for k in range(SESSIONS)]
        assert await steps_run(observer, sessions) == run + 2 * SESSIONS


# ---- step_stream itself, with a step that is answered at once -------------------------------------


class Context:
    """What `step_stream` uses of a grpc.aio.ServicerContext: the status it ends the call with."""

    def __init__(self) -> None:
        self.status: tuple[grpc.StatusCode, str] | None = None

    def set_trailing_metadata(self, metadata: object) -> None:
        pass

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.status = (code, details)
        raise grpc.aio.AbortError(details)


async def turns(count: int = 200) -> None:
    """Let every task that can run, run (no I/O here: each waits only for the others)."""
    for _ in range(count):
        await asyncio.sleep(0)


@pytest.mark.parametrize("ending", ["end", "decode error"])
async def test_undecodable_requests_take_slots_and_never_block(ending: str) -> None:
    """Undecodable requests between steps, a consumer taking one answer at a time: the queue stays
    bounded, nothing waits forever, each session's steps apply in order, the end is always seen."""
    max_batch = 3
    pulled: list[object] = []
    applied: dict[str, int] = {}

    async def requests() -> AsyncIterator[object]:
        for n in range(30):
            item: object = (
                Undecodable(f"bad {n}")
                if n % 3 == 0
                else rt.StepStreamRequest(step=rt.StepRequest(session_id=f"s{n % 2}"), tag=str(n))
            )
            pulled.append(item)
            yield item
        if ending == "decode error":
            raise DecodeError("Error parsing message")

    async def entry(step: rt.StepRequest) -> rt.StepResponse:
        await asyncio.sleep(0)
        applied[step.session_id] = applied.get(step.session_id, 0) + 1
        return rt.StepResponse(step_index=applied[step.session_id])

    context = Context()
    answers = step_stream(requests(), context, entry, max_batch)  # type: ignore[arg-type]
    taken: list[rt.StepStreamResponse] = []
    with contextlib.suppress(grpc.aio.AbortError) if ending == "decode error" else contextlib.nullcontext():
        async for answer in answers:
            taken.append(answer)
            await turns()
            # The answers before this one gave their slots back; this one and the rest hold theirs.
            assert len(pulled) <= len(taken) - 1 + max_batch, (len(pulled), len(taken))
    assert len(pulled) == 30 and len(taken) == 30
    bad = [a for a in taken if not a.tag]
    assert len(bad) == 10 and all(a.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] for a in bad)
    assert all("bad " in a.message and a.reason == "INVALID_REQUEST" for a in bad)
    for sid in ("s0", "s1"):
        mine = [a for a in taken if a.session_id == sid]
        assert [a.response.step_index for a in mine] == list(range(1, len(mine) + 1))
        assert [int(a.tag) for a in mine] == sorted(int(a.tag) for a in mine)
    if ending == "decode error":
        assert context.status is not None and context.status[0] == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid StepStreamRequest" in context.status[1]
    else:
        assert context.status is None

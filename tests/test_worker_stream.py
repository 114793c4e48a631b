"""The runtime's stream to each sandbox worker (`ExecuteStream`; services/worker_stream.py and
sandbox_worker/streaming.py), against real worker processes (real nsjail) on loopback.

Operations over the stream answer as their unary calls do; each has its own deadline, its own
refusal (invalid, overloaded, draining, undecodable) that leaves the stream's other operations
alone; a stream is read no faster than the worker admits; a worker killed under a stream loses no
operation (the dispatcher re-runs them on the session's next worker) and the next operation opens
a new stream; a worker without the RPC gets unary calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from codegym.sandbox.v1 import sandbox_service_pb2 as sb
from codegym.sandbox.v1 import sandbox_service_pb2_grpc as sb_grpc
from codegym_client.channels import aio_channel
from codegym_client.errors import CORE_INTERNAL, REASON_TRAILER, RETRY_AFTER_TRAILER
from services.dispatcher import SANDBOX_SERVICE, SandboxDispatcher, sourced
from services.worker_stream import QueueFull, WorkerStream
from tests.conftest import ROOT
from tests.helpers.processes import sleeping_in_jails, wait_until
from tests.helpers.servers import CodegymServer, sandbox_workers, workers_fixture

COUNTER = (ROOT / "tests" / "fixtures" / "runtime_envs" / "Test_0001_I__CounterEnv.py").read_text()
COUNTER_SHA = hashlib.sha256(COUNTER.encode()).hexdigest()
STEP = sb.Limits(wall_ms=5000)

workers = workers_fixture(2, jails=2)


def create(key: str, target: int = 50) -> sb.Operation:
    config = json.dumps({"target": target})
    return sb.Operation(
        source=sb.SourceRef(code=COUNTER), create=sb.CreateOp(config_json=config, session_key=key)
    )


def step(key: str, state: bytes, name: str, **parameters: Any) -> sb.Operation:
    action = json.dumps({"name": name, "parameters": parameters})
    return sb.Operation(
        source=sb.SourceRef(sha256=COUNTER_SHA),
        limits=STEP,
        step=sb.StepOp(state=state, action=action, session_key=key),
    )


def sleeper(seconds: float, wall_ms: int = 0) -> sb.Operation:
    return sb.Operation(
        source=sb.SourceRef(code=f"import time\ntime.sleep({seconds})\nprint('slept')\n"),
        run_script=sb.RunScriptOp(),
        limits=sb.Limits(wall_ms=wall_ms or int(seconds * 1000) + 5000),
    )


def seen(result: sb.OperationResult) -> tuple[Any, ...]:
    """What an answer says, but its usage (timings differ between runs)."""
    return (result.status, result.observation, result.reward, result.done, result.step_count, result.message)


def trailer(error: grpc.aio.AioRpcError, key: str) -> str:
    return str(dict(error.trailing_metadata() or ()).get(key, ""))


async def until(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    """Wait for loop-side state (the loop keeps running meanwhile)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        if loop.time() > deadline:
            pytest.fail(f"timed out after {timeout_s:g} s waiting for {what}")
        await asyncio.sleep(0.01)


async def in_jails(*pids: int, count: int = 1) -> None:
    """Wait until `count` jailed processes under the workers `pids` sleep (an operation has started)."""
    await asyncio.to_thread(
        wait_until, lambda: len(sleeping_in_jails(*pids)) >= count, 30, f"{count} operations to start"
    )


def worker_stream(address: str, **options: Any) -> tuple[grpc.aio.Channel, WorkerStream]:
    channel = aio_channel(address, [SANDBOX_SERVICE], retry=False, health_service=SANDBOX_SERVICE)
    return channel, WorkerStream(sb_grpc.SandboxServiceStub(channel), address, **options)


@pytest.mark.jail
async def test_operations_over_the_stream_answer_as_unary_calls_do(workers: list[CodegymServer]) -> None:
    channel, stream = worker_stream(workers[0].address)
    stub = sb_grpc.SandboxServiceStub(channel)

    async def unary(op: sb.Operation) -> sb.OperationResult:
        return (await stub.Execute(sb.ExecuteRequest(operation=op), timeout=30)).result

    try:
        keys = [f"s{i}" for i in range(6)]
        # Creates, then three rounds of steps of every session at once: each session's results
        # through the stream are those of its twin session through unary calls.
        by_stream = await asyncio.gather(*(stream.submit(create(k)) for k in keys))
        by_call = await asyncio.gather(*(unary(create(k + "u")) for k in keys))
        assert [seen(r) for r in by_stream] == [seen(r) for r in by_call]
        assert all(r.status == sb.STATUS_OK for r in by_stream), by_stream[0].message
        for round_ in range(3):
            by_stream = await asyncio.gather(
                *(
                    stream.submit(step(k, r.state, "Add", amount=i + 1))
                    for i, (k, r) in enumerate(zip(keys, by_stream, strict=True))
                )
            )
            by_call = await asyncio.gather(
                *(
                    unary(step(k + "u", r.state, "Add", amount=i + 1))
                    for i, (k, r) in enumerate(zip(keys, by_call, strict=True))
                )
            )
            assert [seen(r) for r in by_stream] == [seen(r) for r in by_call]
            assert [r.observation for r in by_stream] == [
                str((i + 1) * (round_ + 1)) for i in range(len(keys))
            ]
        # A state from the stream steps the same through a unary call, and the reverse.
        assert seen(await unary(step("x", by_stream[0].state, "Observe"))) == seen(
            await stream.submit(step("y", by_call[0].state, "Observe"))
        )

        # A source the worker has not seen: SOURCE_NEEDED, then sent with its code (`sourced`).
        fresh = COUNTER + "\n# another version\n"
        sha = hashlib.sha256(fresh.encode()).hexdigest()
        op = sb.Operation(source=sb.SourceRef(sha256=sha), create=sb.CreateOp(config_json='{"target": 1}'))
        assert (await stream.submit(op)).status == sb.STATUS_SOURCE_NEEDED
        created = await sourced(stream.submit, op, fresh)
        assert created.status == sb.STATUS_OK and created.source_sha256 == sha

        # An operation the worker cannot serve is refused alone, as its unary call was; the others
        # on the stream are answered.
        bad = stream.submit(sb.Operation(source=sb.SourceRef(code=COUNTER)))
        good = stream.submit(step("s0", by_stream[0].state, "Observe"))
        results = await asyncio.gather(bad, good, return_exceptions=True)
        assert isinstance(results[0], grpc.aio.AioRpcError)
        assert results[0].code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "operation has no kind" in (results[0].details() or "")
        assert trailer(results[0], REASON_TRAILER) == "INVALID_REQUEST"
        assert isinstance(results[1], sb.OperationResult) and results[1].observation == "3"
        # One stream carried all of it, and nothing is left waiting.
        assert stream.opened == 1 and stream.in_flight == 0
    finally:
        await stream.close()
        await channel.close()


def request(*ops: tuple[int, sb.Operation]) -> bytes:
    return sb.ExecuteStreamRequest(
        operations=[sb.StreamOperation(id=i, operation=op) for i, op in ops]
    ).SerializeToString()


async def raw_stream(address: str, *messages: bytes) -> tuple[list[sb.StreamAnswer], grpc.StatusCode, str]:
    """Send `messages` as they are on one ExecuteStream, end the side: every answer, and the status."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.stream_stream(
            f"/{SANDBOX_SERVICE}/ExecuteStream", response_deserializer=sb.ExecuteStreamResponse.FromString
        )()
        for message in messages:
            await call.write(message)
        await call.done_writing()
        answers: list[sb.StreamAnswer] = []
        try:
            async for response in call:
                answers.extend(response.answers)
        except grpc.aio.AioRpcError:
            pass
        return answers, await call.code(), await call.details() or ""


@pytest.mark.jail
async def test_an_undecodable_message_is_answered_alone_and_the_stream_goes_on(
    workers: list[CodegymServer],
) -> None:
    answers, code, _ = await raw_stream(
        workers[0].address,
        request((7, sleeper(0))),
        # An operation whose run_script stdin is not UTF-8: not an ExecuteStreamRequest.
        b"\x0a\x0a\x08\x08\x12\x06\x7a\x04\x0a\x02\xff\xfe",
        request((9, sleeper(0)), (10, sleeper(0))),  # two in one message
    )
    assert code == grpc.StatusCode.OK
    by_id = {a.id: a for a in answers}
    assert sorted(by_id) == [0, 7, 9, 10], answers
    assert by_id[0].code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and by_id[0].reason == "INVALID_REQUEST"
    assert "not a valid ExecuteStreamRequest" in by_id[0].message and "Traceback" not in by_id[0].message
    assert [by_id[i].result.stdout for i in (7, 9, 10)] == ["slept\n"] * 3

    # A message of more operations than a request may carry runs none of them and ends the call
    # (a caller that breaks the protocol), once what was read before it is answered.
    empty = sb.Operation()
    answers, code, details = await raw_stream(
        workers[0].address, request((1, sleeper(0))), request(*((i, empty) for i in range(2, 4099)))
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "a request of 4097 operations (max 4096)" in details
    assert [(a.id, a.result.stdout) for a in answers] == [(1, "slept\n")]


@pytest.mark.jail
async def test_a_stream_is_read_no_faster_than_the_worker_admits_and_overload_is_per_operation() -> None:
    # Two jails, at most two operations held: a stream that sends three has its third read only
    # once one of the first two is answered, and a second stream's operation is refused CAPACITY
    # with a retry-after, alone.
    with sandbox_workers(1, "--max-pending", "2", jails=2) as (worker,):
        channel, stream = worker_stream(worker.address)
        other = WorkerStream(sb_grpc.SandboxServiceStub(channel), worker.address)
        try:
            order: list[str] = []

            async def run(name: str, op: sb.Operation) -> sb.OperationResult:
                result = await stream.submit(op)
                order.append(name)
                return result

            first = asyncio.ensure_future(run("first", sleeper(4.0)))
            second = asyncio.ensure_future(run("second", sleeper(4.0)))
            await in_jails(worker.pid, count=2)
            third = asyncio.ensure_future(run("third", sleeper(0)))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await other.submit(sleeper(0))
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert trailer(refused.value, REASON_TRAILER) == "CAPACITY"
            assert trailer(refused.value, RETRY_AFTER_TRAILER) == "50"
            assert "worker overloaded" in (refused.value.details() or "")
            results = await asyncio.gather(first, second, third)
            assert [r.status for r in results] == [sb.STATUS_OK] * 3
            assert order.index("third") > 0  # read after an answer freed its slot, never refused
            assert stream.opened == 1 and other.opened == 1
        finally:
            await stream.close()
            await other.close()
            await channel.close()


@pytest.mark.jail
async def test_an_operation_past_its_deadline_fails_alone_and_its_late_answer_is_dropped() -> None:
    with sandbox_workers(1, jails=1) as (worker,):
        channel, stream = worker_stream(worker.address, slack_s=0.3)
        try:
            # The jail is busy for 5 s (a margin for a loaded machine); an operation with 100 ms
            # of wall time may wait 0.5 s.
            busy = asyncio.ensure_future(stream.submit(sleeper(5.0, wall_ms=8000)))
            await in_jails(worker.pid)
            started = asyncio.get_running_loop().time()
            with pytest.raises(grpc.aio.AioRpcError) as late:
                await stream.submit(sleeper(0, wall_ms=100))
            waited = asyncio.get_running_loop().time() - started
            assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and waited > 0.4
            assert not busy.done()  # failed by its own deadline, not after the jail came free
            assert stream.in_flight == 1  # the busy one alone
            assert (await busy).status == sb.STATUS_OK
            # The stream goes on (the late answer came and was dropped).
            assert (await stream.submit(sleeper(0))).stdout == "slept\n"
            assert stream.opened == 1 and stream.in_flight == 0
        finally:
            await stream.close()
            await channel.close()


@pytest.mark.jail
async def test_creates_wait_for_their_slots_steps_do_not_and_past_the_bound_nothing_queues(
    workers: list[CodegymServer],
) -> None:
    # One slot for creates, resets and one-shot operations; two operations held at most.
    channel, stream = worker_stream(workers[0].address, others_in_flight=1, max_in_flight=2)
    try:
        running = asyncio.ensure_future(stream.submit(sleeper(3.0)))
        await until(lambda: stream.in_flight == 1 and stream.queued == 0, "the first operation to be sent")
        held = asyncio.ensure_future(stream.submit(sleeper(0)))
        await until(lambda: stream.queued == 1, "the second one-shot operation to wait for the slot")
        assert stream.in_flight == 2
        # Held operations count: a third is refused here, not queued.
        with pytest.raises(QueueFull):
            await stream.submit(sb.Operation(release=sb.ReleaseOp(session_key="nobody")))
        assert (await running).status == sb.STATUS_OK and (await held).status == sb.STATUS_OK
        # A release (as a step) never waits for the slot: it is answered while a one-shot holds it.
        running = asyncio.ensure_future(stream.submit(sleeper(3.0)))
        await until(lambda: stream.in_flight == 1, "the one-shot operation to be sent")
        released = await stream.submit(sb.Operation(release=sb.ReleaseOp(session_key="nobody")))
        assert released.status == sb.STATUS_OK and not running.done()
        assert (await running).status == sb.STATUS_OK
        assert stream.in_flight == 0 and stream.queued == 0
    finally:
        await stream.close()
        await channel.close()


@pytest.mark.jail
async def test_steps_past_their_slots_wait_in_the_runtime_and_are_all_answered(
    workers: list[CodegymServer],
) -> None:
    """A burst of steps larger than the steps a worker is sent at once waits here (counted as
    queued and held), never refused by the worker, and every step is answered in full."""
    channel, stream = worker_stream(workers[0].address, steps_in_flight=1)
    try:
        made = await asyncio.gather(*(stream.submit(create(f"w{i}")) for i in range(3)))
        slow = asyncio.ensure_future(stream.submit(step("w0", made[0].state, "Slow", ms=1500)))
        await until(lambda: stream.in_flight == 1 and stream.queued == 0, "the slow step to be sent")
        quick = [
            asyncio.ensure_future(stream.submit(step(f"w{i}", made[i].state, "Add", amount=i)))
            for i in (1, 2)
        ]
        await until(lambda: stream.queued == 2, "the two steps to wait for the one step slot")
        assert stream.in_flight == 3 and not any(q.done() for q in quick)
        answers = await asyncio.gather(slow, *quick)
        assert all(a.status == sb.STATUS_OK for a in answers)
        assert [a.observation for a in answers[1:]] == ["1", "2"]
        assert stream.in_flight == 0 and stream.queued == 0
    finally:
        await stream.close()
        await channel.close()


@pytest.mark.jail
async def test_streams_are_retired_by_age_and_lose_nothing(workers: list[CodegymServer]) -> None:
    # Every operation after the first finds its stream too old: it goes on a new one, while the
    # old one ends once its last answer is in.
    channel, stream = worker_stream(workers[1].address, max_age_s=0.0)
    try:
        keys = [f"r{i}" for i in range(4)]
        results = await asyncio.gather(*(stream.submit(create(k)) for k in keys))
        for round_ in range(5):
            results = await asyncio.gather(
                *(
                    stream.submit(step(k, r.state, "Add", amount=1))
                    for k, r in zip(keys, results, strict=True)
                )
            )
            assert [r.observation for r in results] == [str(round_ + 1)] * len(keys)
        assert stream.opened > 5
        await until(lambda: not stream.retiring, "the retired streams to end")
        assert stream.in_flight == 0
    finally:
        await stream.close()
        await channel.close()


def homed(dispatcher: SandboxDispatcher, per_worker: int) -> list[str]:
    """Session keys, `per_worker` of them at home on each worker."""
    keys: list[str] = []
    counts = dict.fromkeys(dispatcher.workers, 0)
    for i in range(1000):
        home = dispatcher.order(f"k{i}")[0]
        if counts[home] < per_worker:
            counts[home] += 1
            keys.append(f"k{i}")
    assert set(counts.values()) == {per_worker}
    return keys


@pytest.mark.jail
async def test_a_worker_killed_under_its_stream_loses_no_operation() -> None:
    with sandbox_workers(2, jails=2, clean_stop=False) as started:
        dispatcher = SandboxDispatcher([w.address for w in started])
        try:
            keys = homed(dispatcher, 4)
            results = await asyncio.gather(*(dispatcher.execute(create(k), COUNTER, k) for k in keys))
            assert all(r.status == sb.STATUS_OK for r in results), results[0].message
            victim = started[0]
            stream = dispatcher.workers[victim.address].stream
            mine = [dispatcher.order(k)[0] == victim.address for k in keys]
            # Every session steps at once, slowly: the victim's jails run two of its four when it
            # dies, the other two wait for a jail there.
            steps = [
                asyncio.ensure_future(dispatcher.execute(step(k, r.state, "Slow", ms=1500), COUNTER, k))
                for k, r in zip(keys, results, strict=True)
            ]
            await in_jails(victim.pid, count=2)
            assert stream.in_flight > 0
            os.killpg(victim.pid, signal.SIGKILL)
            results = await asyncio.gather(*steps)
            # Each answered once, right: the victim's sessions by the other worker.
            assert [(r.status, r.observation, r.step_count) for r in results] == [(sb.STATUS_OK, "1", 1)] * 8
            assert victim.address in dispatcher.down_until and stream.in_flight == 0
            assert stream.current is None  # the broken stream is gone

            # The worker comes back on its port; once the channel to it is up again (reconnects
            # back off) and its down time is over, its sessions' next operations open a new stream
            # to it (and run cold there: a new process).
            port = victim.address.rsplit(":", 1)[1]
            victim.stop()
            started[0] = CodegymServer(["serve", "sandbox", "--port", port, "--jails", "2"])
            await asyncio.wait_for(dispatcher.workers[victim.address].channel.channel_ready(), 30)
            await until(
                lambda: dispatcher.down_until[victim.address] < time.monotonic(), "the down time to end"
            )
            again = await asyncio.gather(
                *(
                    dispatcher.execute(step(k, r.state, "Add", amount=2), COUNTER, k)
                    for k, r, home in zip(keys, results, mine, strict=True)
                    if home
                )
            )
            assert [(r.observation, r.resident) for r in again] == [("3", False)] * 4
            assert stream.opened == 2
        finally:
            await dispatcher.close()


async def serving(address: str) -> bool:
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=2
            )
        except grpc.aio.AioRpcError:
            return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


@pytest.mark.jail
async def test_a_draining_worker_finishes_what_runs_and_refuses_the_rest() -> None:
    with sandbox_workers(1, jails=1, clean_stop=False) as (worker,):
        channel, stream = worker_stream(worker.address)
        try:
            # Long enough to still run after the checks below on a loaded machine, within the
            # worker's 5 s grace.
            running = asyncio.ensure_future(stream.submit(sleeper(4.0)))
            await in_jails(worker.pid)
            worker.proc.send_signal(signal.SIGTERM)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 10
            while await serving(worker.address):
                assert loop.time() < deadline, "the worker still serves 10 s after SIGTERM"
                await asyncio.sleep(0.02)
            # An operation sent on the open stream while the worker drains is refused UNAVAILABLE
            # (the dispatcher then marks the worker down and moves the session); what runs finishes.
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stream.submit(sleeper(0))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "draining" in (refused.value.details() or "")
            assert not running.done()
            assert (await running).stdout == "slept\n"
            # Nothing of it runs any more: the worker ends the stream and exits cleanly.
            await until(lambda: stream.current is None, "the worker to end the stream")
            assert await asyncio.to_thread(worker.proc.wait, 20) == 0
        finally:
            await stream.close()
            await channel.close()


class OlderWorker(sb_grpc.SandboxServiceServicer):
    """A worker of a release without ExecuteStream (the generated base answers UNIMPLEMENTED)."""

    def __init__(self) -> None:
        self.calls = 0

    async def Execute(
        self, request: sb.ExecuteRequest, context: grpc.aio.ServicerContext
    ) -> sb.ExecuteResponse:
        self.calls += 1
        return sb.ExecuteResponse(result=sb.OperationResult(status=sb.STATUS_OK, stdout=f"call {self.calls}"))


@contextlib.asynccontextmanager
async def streaming_to(servicer: sb_grpc.SandboxServiceServicer) -> AsyncIterator[WorkerStream]:
    """A `WorkerStream` to a real gRPC server (port 0) serving `servicer` (a worker of another
    behaviour than ours); the stream, its channel and the server are closed on the way out."""
    server = grpc.aio.server()
    sb_grpc.add_SandboxServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel, stream = worker_stream(f"127.0.0.1:{port}")
    try:
        yield stream
    finally:
        await stream.close()
        await channel.close()
        await server.stop(0)


async def test_a_worker_without_the_stream_gets_unary_calls() -> None:
    older = OlderWorker()
    async with streaming_to(older) as stream:
        assert (await stream.submit(sleeper(0))).stdout == "call 1"
        assert (await stream.submit(sleeper(0))).stdout == "call 2"
        assert stream.opened == 1 and stream.unary_until > 0 and older.calls == 2


class LostStatusWorker(OlderWorker):
    """A worker whose streams end as grpc.aio reports one when a write raced the worker's end of
    the call: INTERNAL "Internal error from Core" in place of the worker's own status (seen under
    load with a refused token: 10 streams in 150)."""

    def __init__(self) -> None:
        super().__init__()
        self.streams = 0

    async def ExecuteStream(
        self, request_iterator: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[sb.ExecuteStreamResponse]:
        self.streams += 1
        await context.abort(grpc.StatusCode.INTERNAL, CORE_INTERNAL)
        yield sb.ExecuteStreamResponse()  # pragma: no cover - abort raised


async def test_a_stream_whose_status_grpc_lost_asks_the_worker_again_in_a_unary_call() -> None:
    lost = LostStatusWorker()
    async with streaming_to(lost) as stream:
        # Not a worker lost (UNAVAILABLE, sent round the others): the worker's own answer.
        assert (await stream.submit(sleeper(0))).stdout == "call 1"
        # Nor a worker without streams: the next operation tries a stream again.
        assert (await stream.submit(sleeper(0))).stdout == "call 2"
        assert lost.streams == 2 and stream.unary_until == 0 and lost.calls == 2

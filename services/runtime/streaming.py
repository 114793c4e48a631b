"""Many steps in one call: `BatchStep` (one answer for all) and `StepStream` (each answered when done).

Both run each step exactly as `Step` does (`entry`: the step's response, or the status a unary
`Step` would have ended with), so a failure of one entry is that entry's answer and never ends the
call. A stream's answer carries the whole status (code, message, reason, retry-after): the client
sends its steps over a shared stream (codegym_client/step_streams.py) and must raise exactly what a
unary `Step` raises.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
from google.protobuf.message import DecodeError

from codegym.errors import EntryStatus, Reason, Refusal, Undecodable, clipped, fail_internally, refuse
from codegym_client.api.runtime.v1 import runtime_service_pb2 as rt

Entry = Callable[[rt.StepRequest], Awaitable[rt.StepResponse | EntryStatus]]


async def batch_step(request: rt.BatchStepRequest, entry: Entry, max_batch: int) -> rt.BatchStepResponse:
    steps = request.steps
    if len(steps) > max_batch:
        raise Refusal(Reason.INVALID_REQUEST, f"batch of {len(steps)} steps (max {max_batch})")
    ids = [s.session_id for s in steps]
    if len(set(ids)) != len(ids):
        raise Refusal(Reason.INVALID_REQUEST, "a batch must name distinct sessions (one step per session)")

    async def one(step: rt.StepRequest) -> rt.BatchStepResult:
        answer = await entry(step)
        if isinstance(answer, EntryStatus):
            return rt.BatchStepResult(session_id=step.session_id, code=answer.code, message=answer.message)
        return rt.BatchStepResult(session_id=step.session_id, response=answer)

    return rt.BatchStepResponse(results=await asyncio.gather(*(one(s) for s in steps)))


async def step_stream(
    request_iterator: AsyncIterator[rt.StepStreamRequest],
    context: grpc.aio.ServicerContext,
    entry: Entry,
    max_batch: int,
    draining: Callable[[], bool] = lambda: False,
) -> AsyncIterator[rt.StepStreamResponse]:
    """Run every step sent as it arrives and answer each when done, with back-pressure.

    A request takes one of `max_batch` slots before it is read, and its answer gives it back only
    once gRPC has taken the answer (the `yield` returned): at most `max_batch` steps are running,
    waiting for their session's earlier step, or answered and not yet sent. With every slot taken
    the server reads no more requests, and HTTP/2 flow control holds the client's sends: a caller
    that does not read its answers stops the runtime from running its steps, instead of making it
    run and hold all of them.

    Steps of one session run in the order sent (each waits for the one before it), so their
    answers come in that order. A request that cannot be decoded is answered INVALID_ARGUMENT in
    the stream (holding a slot like a step) when the server decodes leniently (`add_to_server`);
    otherwise it ends the request side, and the call ends INVALID_ARGUMENT once the steps already
    sent are answered. The client going away cancels the steps still running.

    Draining (`draining()`, the runtime stopping): every request read from then on is answered
    UNAVAILABLE with its reason (nothing applied: send it again, to another replica) and
    `stopping` set, so the client sends no more on this call and closes its side once its steps
    are answered (codegym_client/step_streams.py); the steps already running are answered as
    usual. The call then ends OK, having answered every request it read: a client left with steps
    it has no answer for knows they were never read, never applied. The server reads on rather
    than end the call itself: a write racing the call's end fails on the client's side with
    gRPC's INTERNAL, which says nothing of what the runtime did.
    """
    stream = StreamedSteps(entry, max(1, max_batch), draining)
    reader = asyncio.get_running_loop().create_task(stream.read(request_iterator))
    try:
        while (answer := await stream.answers.get()) is not None:
            yield answer
            stream.slots.release()  # gRPC has taken the answer
        await reader
        if stream.broken:
            raise Refusal(Reason.INVALID_REQUEST, stream.broken[0])
    except Refusal as exc:
        await refuse(context, exc)
    except (grpc.aio.AbortError, asyncio.CancelledError):
        raise
    except Exception:
        await fail_internally(context, "StepStream")
    finally:
        reader.cancel()
        for task in list(stream.running):
            task.cancel()


class StreamedSteps:
    """The steps of one `StepStream` call: those running, the answers not yet sent, and the slots
    (`max_batch`) that bound both (see `step_stream`)."""

    def __init__(self, entry: Entry, max_batch: int, draining: Callable[[], bool] = lambda: False) -> None:
        self.entry = entry
        self.draining = draining
        self.slots = asyncio.Semaphore(max_batch)
        # Every answer queued holds a slot, so the queue never has more than `max_batch` answers,
        # and the one place left is for the final None: `put_nowait` never waits nor fails (if it
        # failed, the accounting would be wrong, and the call ends INTERNAL).
        self.answers: asyncio.Queue[rt.StepStreamResponse | None] = asyncio.Queue(maxsize=max_batch + 1)
        self.running: set[asyncio.Task[None]] = set()
        self.latest: dict[str, asyncio.Task[None]] = {}  # each session's last step still running
        self.broken: list[str] = []

    async def one(self, item: rt.StepStreamRequest, before: asyncio.Task[None] | None) -> None:
        """Run one step on the slot taken for it; its answer keeps the slot until it is sent."""
        queued = False
        try:
            if before is not None:
                await asyncio.wait([before])  # this session's earlier step first
            done = await self.entry(item.step)
            answer = rt.StepStreamResponse(session_id=item.step.session_id, tag=item.tag)
            if isinstance(done, EntryStatus):
                answer.code, answer.message = done.code, done.message
                answer.reason, answer.retry_after_ms = done.reason.name, done.retry_after_ms
            else:
                answer.response.CopyFrom(done)
            self.answers.put_nowait(answer)
            queued = True
        finally:
            if not queued:
                self.slots.release()

    def start(self, item: rt.StepStreamRequest) -> None:
        sid = item.step.session_id
        latest = self.latest
        task = asyncio.get_running_loop().create_task(self.one(item, latest.get(sid)))
        latest[sid] = task
        self.running.add(task)
        task.add_done_callback(self.running.discard)
        task.add_done_callback(lambda done: latest.pop(sid) if latest.get(sid) is done else None)

    async def read(self, request_iterator: AsyncIterator[rt.StepStreamRequest]) -> None:
        """Take a slot, read a request, start its step; until the request side ends, then wait
        for the steps started and queue the final None."""
        try:
            requests = aiter(request_iterator)
            while True:
                await self.slots.acquire()  # the next request's slot, before reading it
                try:
                    item = await anext(requests)
                except StopAsyncIteration:
                    self.slots.release()
                    break
                except DecodeError as exc:  # gRPC decodes lazily here: the request side ends
                    self.slots.release()
                    self.broken.append(f"a request is not a valid StepStreamRequest: {exc}")
                    break
                if isinstance(item, Undecodable):
                    code = grpc.StatusCode.INVALID_ARGUMENT.value[0]
                    refused = rt.StepStreamResponse(
                        code=code, message=clipped(item.reason), reason=Reason.INVALID_REQUEST.name
                    )
                    self.answers.put_nowait(refused)
                elif self.draining():  # its slot is held by its answer, as a step's
                    self.answers.put_nowait(
                        rt.StepStreamResponse(
                            session_id=item.step.session_id,
                            tag=item.tag,
                            code=grpc.StatusCode.UNAVAILABLE.value[0],
                            message="the runtime is stopping: the step was not applied; send it again",
                            reason=Reason.UNAVAILABLE.name,
                            stopping=True,
                        )
                    )
                else:
                    self.start(item)
            await asyncio.gather(*list(self.running))
        finally:
            self.answers.put_nowait(None)

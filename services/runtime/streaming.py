"""Many steps in one call: `BatchStep` (one answer for all) and `StepStream` (each answered when done).

Both run each step exactly as `Step` does (`entry`: the step's response, or its status code and
message), so a failure of one entry is that entry's answer and never ends the call.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
from google.protobuf.message import DecodeError

from codegym.errors import Reason, Refusal, Undecodable, clipped, fail_internally, refuse
from codegym.runtime.v1 import runtime_service_pb2 as rt

Entry = Callable[[rt.StepRequest], Awaitable[tuple[rt.StepResponse | None, int, str]]]


async def batch_step(request: rt.BatchStepRequest, entry: Entry, max_batch: int) -> rt.BatchStepResponse:
    steps = request.steps
    if len(steps) > max_batch:
        raise Refusal(Reason.INVALID_REQUEST, f"batch of {len(steps)} steps (max {max_batch})")
    ids = [s.session_id for s in steps]
    if len(set(ids)) != len(ids):
        raise Refusal(Reason.INVALID_REQUEST, "a batch must name distinct sessions (one step per session)")

    async def one(step: rt.StepRequest) -> rt.BatchStepResult:
        response, code, message = await entry(step)
        if response is None:
            return rt.BatchStepResult(session_id=step.session_id, code=code, message=message)
        return rt.BatchStepResult(session_id=step.session_id, response=response)

    return rt.BatchStepResponse(results=await asyncio.gather(*(one(s) for s in steps)))


async def step_stream(
    request_iterator: AsyncIterator[rt.StepStreamRequest],
    context: grpc.aio.ServicerContext,
    entry: Entry,
    max_batch: int,
) -> AsyncIterator[rt.StepStreamResponse]:
    """Run every step sent as it arrives (at most `max_batch` at once) and answer each when done.

    A request that cannot be decoded is answered INVALID_ARGUMENT in the stream when the server
    decodes leniently (`add_to_server`); otherwise it ends the request side, and the call ends
    INVALID_ARGUMENT once the steps already sent are answered.
    """
    answers: asyncio.Queue[rt.StepStreamResponse | None] = asyncio.Queue()
    slots = asyncio.Semaphore(max_batch)
    running: set[asyncio.Task[None]] = set()
    latest: dict[str, asyncio.Task[None]] = {}
    broken: list[str] = []

    async def one(item: rt.StepStreamRequest, before: asyncio.Task[None] | None) -> None:
        if before is not None:
            await asyncio.wait([before])  # this session's earlier step first
        try:
            response, code, message = await entry(item.step)
        finally:
            slots.release()
        answer = rt.StepStreamResponse(session_id=item.step.session_id, tag=item.tag)
        if response is None:
            answer.code, answer.message = code, message
        else:
            answer.response.CopyFrom(response)
        await answers.put(answer)

    def forget(task: asyncio.Task[None]) -> None:
        for sid, last in list(latest.items()):
            if last is task:
                del latest[sid]

    async def read() -> None:
        try:
            try:
                async for item in request_iterator:
                    if isinstance(item, Undecodable):
                        code = grpc.StatusCode.INVALID_ARGUMENT.value[0]
                        await answers.put(rt.StepStreamResponse(code=code, message=clipped(item.reason)))
                        continue
                    await slots.acquire()
                    sid = item.step.session_id
                    task = asyncio.get_running_loop().create_task(one(item, latest.get(sid)))
                    latest[sid] = task
                    running.add(task)
                    task.add_done_callback(running.discard)
                    task.add_done_callback(forget)
            except DecodeError as exc:  # gRPC decodes lazily here: the request side ends
                broken.append(f"a request is not a valid StepStreamRequest: {exc}")
            await asyncio.gather(*list(running))
        finally:
            await answers.put(None)

    reader = asyncio.get_running_loop().create_task(read())
    try:
        while (answer := await answers.get()) is not None:
            yield answer
        await reader
        if broken:
            raise Refusal(Reason.INVALID_REQUEST, broken[0])
    except Refusal as exc:
        await refuse(context, exc)
    except (grpc.aio.AbortError, asyncio.CancelledError):
        raise
    except Exception:
        await fail_internally(context, "StepStream")
    finally:
        reader.cancel()
        for task in list(running):
            task.cancel()

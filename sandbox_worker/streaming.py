"""`ExecuteStream`: many operations over one long-lived call, each answered by its id when done.

A unary call per operation costs the worker a call's setup and several completion-queue wakeups;
a message on an open stream costs it about half of that (bench/stream_bench.py). The runtime keeps
one stream per worker for its sessions' operations (services/worker_stream.py, `WorkerStream`).

The operations of a stream run as `ExecuteBatch`'s do: all at once, waiting for a jail by the
pool's priorities, each answered as soon as it finishes (the answers carry the operation's id, not
its position). A message carries the operations its sender had ready at once, and an answer
message those that finished while the last one was being sent: one each while the stream is not
busy, many under load, where that saves a message's CPU per operation (as `ExecuteBatch`'s
coalescing did). Every refusal is one operation's answer and never ends the call: an operation
that cannot be served (INVALID_ARGUMENT), one past the worker's `max_pending` over all its calls
and streams (RESOURCE_EXHAUSTED with a retry-after, never a queue of its own), one that arrives
while the worker drains (UNAVAILABLE: the caller sends it to another worker), a request that does
not decode (INVALID_ARGUMENT under id 0, since its ids could not be read).

Bounded per stream too: the worker reads a request only while fewer than `cap` of the stream's
operations are running or answered and not yet sent (an operation counts from the read of its
request until gRPC has taken its answer), so at most `cap` plus one request's operations
(`MAX_OPERATIONS`) are held. With the stream full the worker reads no more, and HTTP/2 flow
control holds the caller's sends: a caller that sends faster than the worker answers, or does not
read its answers, waits at its end instead of growing a queue here.

A draining worker refuses what it reads and ends the stream (UNAVAILABLE, reason draining) as soon
as nothing of it runs, so the drain is not held up by streams left open and the caller opens its
next stream elsewhere.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import Protocol

import grpc
from google.protobuf.message import DecodeError

from codegym.errors import Reason, Refusal, Undecodable, clipped, entry_status, fail_internally, refuse
from codegym.sandbox.v1 import sandbox_service_pb2 as pb
from sandbox_worker.prepared import Prepared

Ready = Prepared | pb.OperationResult
DRAINING = "worker is draining; retry on another worker"
# Operations in one request, past which the request is refused (and the call ended).
MAX_OPERATIONS = 4096
# Answers in one message: what finished while the previous message was sent, up to this.
ANSWERS_PER_MESSAGE = 64
WHAT = "an operation of ExecuteStream"


class Executor(Protocol):
    """What a stream needs of the servicer (`sandbox_worker.service.SandboxServicer`)."""

    # One token per operation admitted and not yet answered, over every call and stream.
    pending: set[object]
    # Set when the worker starts draining.
    drain: asyncio.Event

    def admit(self, count: int) -> None: ...

    def prepare(self, op: pb.Operation) -> Ready: ...

    def run(self, prepared: Ready) -> Awaitable[pb.OperationResult]: ...


def refusal(op_id: int, exc: BaseException, what: str = WHAT) -> pb.StreamAnswer:
    """An operation's answer for a failure: the status, reason and retry-after its call would have had."""
    status = entry_status(exc, what)
    return pb.StreamAnswer(
        id=op_id,
        code=status.code,
        message=status.message,
        reason=status.reason.name,
        retry_after_ms=status.retry_after_ms,
    )


async def execute_stream(
    requests: AsyncIterator[pb.ExecuteStreamRequest | Undecodable],
    context: grpc.aio.ServicerContext,
    executor: Executor,
    cap: int,
) -> AsyncIterator[pb.ExecuteStreamResponse]:
    """Answer every operation read from `requests` as it finishes (see the module doc).

    The call ends OK when the caller ends its side and every operation is answered; UNAVAILABLE
    when the worker drains; INVALID_ARGUMENT for a request of more than `MAX_OPERATIONS`, or one
    gRPC itself could not decode (only without lenient decoding: with it, that request is answered
    under id 0 and the call goes on), once the operations already read are answered. The caller
    going away cancels the operations still running."""
    stream = OperationStream(executor, max(1, cap))
    loop = asyncio.get_running_loop()
    reader = loop.create_task(stream.read(requests))
    watcher = loop.create_task(stream.watch_drain())
    try:
        while (batch := await stream.next_answers()) is not None:
            yield pb.ExecuteStreamResponse(answers=batch)
            stream.sent(len(batch))  # gRPC has taken the answers
        if stream.reading:  # only the drain ends the call before the caller's side ends
            raise Refusal(Reason.UNAVAILABLE, DRAINING)
        await reader
        if stream.broken:
            raise Refusal(Reason.INVALID_REQUEST, stream.broken[0])
    except Refusal as exc:
        await refuse(context, exc)
    except (grpc.aio.AbortError, asyncio.CancelledError, GeneratorExit):
        raise
    except Exception:
        await fail_internally(context, "ExecuteStream")
    finally:
        reader.cancel()
        watcher.cancel()
        for task in list(stream.running):
            task.cancel()


class OperationStream:
    """One `ExecuteStream` call: its operations running, its answers not yet sent, and the count
    of both that bounds the reading."""

    def __init__(self, executor: Executor, cap: int) -> None:
        self.executor = executor
        self.cap = cap
        self.held = 0  # operations read and not yet answered to gRPC
        self.room = asyncio.Event()  # set while held < cap
        self.room.set()
        # Answers not yet sent, then None once nothing more will be answered. Bounded by `held`.
        self.answers: asyncio.Queue[pb.StreamAnswer | None] = asyncio.Queue()
        self.running: set[asyncio.Task[None]] = set()
        self.broken: list[str] = []
        self.draining = False
        self.ended = False
        self.finishing = False
        self.reading = True

    async def next_answers(self) -> list[pb.StreamAnswer] | None:
        """The answers ready now (at least one, waiting for it), up to `ANSWERS_PER_MESSAGE`; None
        once the call is to end and every answer before that was taken."""
        if self.finishing:
            return None
        answer = await self.answers.get()
        batch: list[pb.StreamAnswer] = []
        while answer is not None:
            batch.append(answer)
            if len(batch) >= ANSWERS_PER_MESSAGE or self.answers.empty():
                return batch
            answer = self.answers.get_nowait()
        self.finishing = True  # the end, behind these answers: the next call returns None
        return batch or None

    def sent(self, count: int) -> None:
        self.held -= count
        if self.held < self.cap:
            self.room.set()

    def end(self) -> None:
        """Queue the final None, once: the call ends after the answers queued before it."""
        if not self.ended:
            self.ended = True
            self.answers.put_nowait(None)

    def settled(self) -> None:
        """End the call when nothing more will be answered: the caller's side ended or the worker
        drains, and nothing runs."""
        if not self.running and (not self.reading or self.draining):
            self.end()

    async def watch_drain(self) -> None:
        await self.executor.drain.wait()
        self.draining = True
        self.settled()

    async def one(self, op_id: int, prepared: Ready, token: object) -> None:
        """Run one operation; its answer is queued, an unexpected failure as its INTERNAL."""
        try:
            try:
                answer = pb.StreamAnswer(id=op_id, result=await self.executor.run(prepared))
            except Exception as exc:  # a bug: this operation's INTERNAL, the stream goes on
                answer = refusal(op_id, exc)
            self.answers.put_nowait(answer)
        except BaseException:
            self.sent(1)  # cancelled: it will never be answered
            raise
        finally:
            self.executor.pending.discard(token)

    def start(self, item: pb.StreamOperation) -> None:
        """Admit, check and start one operation, or queue its refusal."""
        try:
            self.executor.admit(1)
            prepared = self.executor.prepare(item.operation)
        except Exception as exc:  # a refusal, or a bug (INTERNAL): this operation's answer
            self.answers.put_nowait(refusal(item.id, exc))
            return
        if isinstance(prepared, pb.OperationResult):  # answered without a jail (SOURCE_NEEDED)
            self.answers.put_nowait(pb.StreamAnswer(id=item.id, result=prepared))
            return
        token = object()
        self.executor.pending.add(token)  # counted from admission on, as a unary call is
        task = asyncio.get_running_loop().create_task(self.one(item.id, prepared, token))
        self.running.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self.running.discard(task)
        self.settled()

    async def read(self, requests: AsyncIterator[pb.ExecuteStreamRequest | Undecodable]) -> None:
        """Wait for room, read a request, start its operations; until the caller's side ends."""
        try:
            stream = aiter(requests)
            while True:
                await self.room.wait()
                try:
                    item = await anext(stream)
                except StopAsyncIteration:
                    break
                except DecodeError as exc:  # gRPC decodes lazily here: the caller's side ends
                    self.broken.append(f"a request is not a valid ExecuteStreamRequest: {exc}")
                    break
                if isinstance(item, Undecodable):
                    self.take(1)
                    code = grpc.StatusCode.INVALID_ARGUMENT.value[0]
                    reason = Reason.INVALID_REQUEST.name
                    self.answers.put_nowait(
                        pb.StreamAnswer(code=code, message=clipped(item.reason), reason=reason)
                    )
                    continue
                if len(item.operations) > MAX_OPERATIONS:
                    self.broken.append(
                        f"a request of {len(item.operations)} operations (max {MAX_OPERATIONS}); none was run"
                    )
                    break
                self.take(len(item.operations))
                for operation in item.operations:
                    self.start(operation)
        finally:
            self.reading = False
            self.settled()

    def take(self, count: int) -> None:
        self.held += count
        if self.held >= self.cap:
            self.room.clear()

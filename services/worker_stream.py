"""The runtime's one long-lived `ExecuteStream` per sandbox worker, for its sessions' operations.

A unary call per operation costs the worker a call's setup and several completion-queue wakeups,
most of its CPU for a step outside the jail; a message on an open stream costs it about half of
that, and the runtime about as much as the call did (bench/stream_bench.py). So each
worker gets one stream (`WorkerStream`), opened when the first operation needs it, that carries
every operation of the sessions pinned to that worker: steps, creates, resets, releases. The
worker runs them concurrently, by its pool's priorities, and answers each by its id as it finishes
(sandbox_worker/streaming.py); here a future per id waits for its answer. A message carries the
operations queued while the previous one was written (one each while the stream is not busy),
and the worker answers alike, so under load many operations share a message's CPU, as the
`ExecuteBatch` calls this replaces shared a call's.

What a unary call gave for free is kept per operation:

- **Deadline.** Each operation has the deadline its own call had (its wall limit times
  `RUNS_PER_OPERATION`, plus `DEADLINE_SLACK_S`); past it the operation fails DEADLINE_EXCEEDED
  (nothing was applied: the runtime commits only an answer), and a late answer is dropped.
- **Refusals.** A worker's refusal of one operation (overloaded, draining, malformed) arrives as
  the `grpc.aio.AioRpcError` the unary call would have raised, with the reason and retry-after
  trailers, so the failure table (codegym_client.errors) decides as it did.
- **A broken stream.** When the stream ends under operations still waiting (the worker killed or
  restarted, the connection lost), each fails UNAVAILABLE: the dispatcher marks the worker down
  and re-runs them on the session's next worker (every operation is a pure function of source,
  state, input and seed, so a re-run gives the same answer). The next operation opens a new
  stream. A refusal of the stream itself for its token (UNAUTHENTICATED, PERMISSION_DENIED) is
  each operation's, as it was each call's: no other worker would take that token either. When
  grpc.aio hides the worker's status behind its own INTERNAL (a write that raced the worker's end
  of the call, `StreamStatusLost`), each waiting operation asks the worker again in a unary call.
- **Bounded.** At most `max_in_flight` operations are held for a worker (counted from the futures
  held and the operations waiting for a slot); past that `submit` raises `QueueFull` and the
  runtime answers CAPACITY. Steps and releases go at most `STEPS_IN_FLIGHT` at a time, creates,
  resets and one-shot operations at most `OTHERS_IN_FLIGHT` (never ahead of steps), so a burst
  waits here and never fills the worker's admission (a refusal there would be sent round every
  worker) nor the worker's slots for the stream ahead of the steps. The worker reads a stream no faster
  than it admits (flow control then holds the writes here).

A stream is retired after `max_age_s`: it takes no new operations (they go on a new stream),
ends its side once its writes are out, and closes when its last answer arrives. Servers recycle
their connections (`grpc.max_connection_age_ms`, five minutes, then a 30 s grace) and a call still
open at the end of the grace is cut; a stream younger than the grace never is, so recycling never
looks like a worker lost.

A worker without `ExecuteStream` (an older release, during a rolling upgrade) answers
UNIMPLEMENTED: that worker is then sent one `Execute` call per operation, as before, for
`UNARY_S` (then its stream is tried again: it may have been upgraded).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable

import grpc

from codegym.sandbox.v1 import sandbox_service_pb2 as sb
from codegym.sandbox.v1 import sandbox_service_pb2_grpc as sb_grpc
from codegym_client.errors import REASON_TRAILER, RETRY_AFTER_TRAILER, access_refused, status_lost_in_write

log = logging.getLogger(__name__)
# Time a call may take beyond the operation's own wall limit (queueing, transport, jail restart).
DEADLINE_SLACK_S = 5.0
# A worker runs an operation once more, cold, after a failure its own code may not have caused
# (sandbox_worker/pool.py): a call's deadline allows for both runs.
RUNS_PER_OPERATION = 2
# Operations held for one worker (sent, or waiting here to be), past which the runtime answers CAPACITY.
MAX_IN_FLIGHT = 4096
# Operations in one message: those queued while the previous message was written, up to this.
OPERATIONS_PER_MESSAGE = 64
# Operations sent at once to a worker on behalf of everything but steps and releases (creates,
# resets, one-shot operations): enough to keep every jail of a worker busy with them (the worker
# orders them behind steps), few enough that a burst of thousands of creates waits here, where
# MAX_IN_FLIGHT bounds it, rather than in the worker, where it would fill the stream's slots and
# hold up the steps behind it.
OTHERS_IN_FLIGHT = 32
# Steps and releases: never queued behind creates (a release frees a process), and sent at once
# while fewer than `STEPS_IN_FLIGHT` of them are out to the worker.
PROMPT = frozenset({"step", "release"})
# Steps and releases out at once to one worker. Below the worker's own admission (`max_pending`,
# 256 operations a jail) together with `OTHERS_IN_FLIGHT`, even for a worker of one jail: a burst
# of first steps (16,384 rollouts starting, each first step cold at several ms) waits here, where
# `MAX_IN_FLIGHT` bounds it and a caller past it gets CAPACITY with a retry-after, instead of being
# refused by the worker and sent round every worker until the dispatcher gives up (UNAVAILABLE).
# 192 steps keep two jails busy for hundreds of milliseconds: more out would only queue there.
STEPS_IN_FLIGHT = 192
# A stream's age when it is retired: well within a connection's 30 s grace after GOAWAY (see the
# module doc), however long the operations it carries take to finish (steps: milliseconds).
STREAM_AGE_S = 10.0
# How long a worker found without ExecuteStream gets unary calls before its stream is tried again
# (it may have been upgraded in the meantime).
UNARY_S = 60.0
STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


class QueueFull(Exception):
    """A worker holds as many of the runtime's operations as it may: the runtime answers CAPACITY."""


class StreamUnsupported(Exception):
    """The worker has no `ExecuteStream` (UNIMPLEMENTED): it takes unary calls only."""


class StreamStatusLost(Exception):
    """The stream ended with gRPC's own INTERNAL "Internal error from Core", not the worker's
    status: a write raced the worker's end of the call (grpc.aio then replaces the status it had
    not yet read with that one). The worker's real answer, a refusal of the token included, is
    asked for again over a unary call (`WorkerStream._send`)."""


def deadline_s(op: sb.Operation, slack_s: float = DEADLINE_SLACK_S) -> float:
    """The time the worker may take to answer `op`: what its unary call's deadline was."""
    return (op.limits.wall_ms or 5000) / 1000 * RUNS_PER_OPERATION + slack_s


def rpc_error(
    code: grpc.StatusCode, details: str, reason: str = "", retry_after_ms: int = 0
) -> grpc.aio.AioRpcError:
    """The error a unary call answered `code` would have raised, trailers included."""
    trailers = []
    if reason:
        trailers.append((REASON_TRAILER, reason))
    if retry_after_ms:
        trailers.append((RETRY_AFTER_TRAILER, str(retry_after_ms)))
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailers), details)


def answer_error(answer: sb.StreamAnswer) -> grpc.aio.AioRpcError:
    code = STATUS_BY_NUMBER.get(answer.code, grpc.StatusCode.UNKNOWN)
    return rpc_error(code, answer.message, answer.reason, answer.retry_after_ms)


class StreamCall:
    """One `ExecuteStream` call: its writer, its reader, and a future per operation waiting."""

    def __init__(self, stub: sb_grpc.SandboxServiceStub, address: str, on_end: Callable[[StreamCall], None]):
        loop = asyncio.get_running_loop()
        self.address = address
        self.on_end = on_end
        self.opened = loop.time()
        # Operations waiting for their answer: id -> (future, deadline timer).
        self.waiting: dict[int, tuple[asyncio.Future[sb.OperationResult], asyncio.TimerHandle]] = {}
        # Operations not yet written (None: end the call's side). Bounded by `waiting`: every
        # operation put here has its future there, and `WorkerStream` caps those.
        self.outbox: asyncio.Queue[sb.StreamOperation | None] = asyncio.Queue()
        self.unsent = 0
        self.open = True  # takes new operations
        self.call = stub.ExecuteStream()
        self.writer = loop.create_task(self._write())
        self.reader = loop.create_task(self._read())

    def submit(self, op_id: int, op: sb.Operation, timeout_s: float) -> asyncio.Future[sb.OperationResult]:
        """Send `op` under `op_id`; the future is its answer, or its failure (see the module doc)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[sb.OperationResult] = loop.create_future()
        timer = loop.call_later(timeout_s, self._expire, op_id)
        self.waiting[op_id] = (future, timer)
        self.unsent += 1
        self.outbox.put_nowait(sb.StreamOperation(id=op_id, operation=op))
        return future

    def forget(self, op_id: int) -> None:
        """Stop waiting for `op_id` (its caller went away); a late answer is dropped."""
        entry = self.waiting.pop(op_id, None)
        if entry is not None:
            entry[1].cancel()

    def retire(self) -> None:
        """Take no new operations; end the call's side once what is queued is written."""
        if self.open:
            self.open = False
            self.outbox.put_nowait(None)

    def close(self) -> None:
        """End the call now: what waits fails UNAVAILABLE."""
        self.open = False
        self.call.cancel()
        self.writer.cancel()
        self.reader.cancel()

    def _expire(self, op_id: int) -> None:
        entry = self.waiting.pop(op_id, None)
        if entry is not None and not entry[0].done():
            entry[0].set_exception(
                rpc_error(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"sandbox worker {self.address} did not answer an operation in time",
                )
            )

    async def _write(self) -> None:
        """Write what is queued, as it comes: one operation a message while the stream is not
        busy, everything queued meanwhile (up to `OPERATIONS_PER_MESSAGE`) in the next one."""
        try:
            ending = False
            while not ending:
                item = await self.outbox.get()
                batch: list[sb.StreamOperation] = []
                while item is not None:
                    batch.append(item)
                    if len(batch) >= OPERATIONS_PER_MESSAGE or self.outbox.empty():
                        break
                    item = self.outbox.get_nowait()
                ending = item is None
                if batch:
                    try:
                        await self.call.write(sb.ExecuteStreamRequest(operations=batch))
                    finally:
                        self.unsent -= len(batch)
            await self.call.done_writing()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass  # the call ended: the reader fails what waits, with the call's status

    async def _read(self) -> None:
        ended: BaseException | None = None
        try:
            while (response := await self.call.read()) is not grpc.aio.EOF:
                assert isinstance(response, sb.ExecuteStreamResponse)
                for answer in response.answers:
                    self._answer(answer)
        except grpc.aio.AioRpcError as exc:
            ended = exc
        except asyncio.CancelledError as exc:
            ended = exc
            raise
        except Exception as exc:  # a bug: what waits still fails, as from a broken stream
            log.exception("reading the stream to sandbox worker %s failed", self.address)
            ended = exc
        finally:
            self.open = False
            self._fail_waiting(ended)
            self.writer.cancel()
            self.on_end(self)

    def _answer(self, answer: sb.StreamAnswer) -> None:
        entry = self.waiting.pop(answer.id, None)
        if entry is None:  # late: past its deadline, or its caller went away
            if answer.id == 0:  # a request the worker could not read: a bug here
                log.error("sandbox worker %s: %s", self.address, answer.message)
            return
        future, timer = entry
        timer.cancel()
        if future.done():
            return
        if answer.code:
            future.set_exception(answer_error(answer))
        else:
            future.set_result(answer.result)

    def _fail_waiting(self, ended: BaseException | None) -> None:
        """Fail every operation still waiting, as the call's end says (see the module doc)."""
        if not self.waiting:
            return
        if isinstance(ended, grpc.aio.AioRpcError) and access_refused(ended):
            code, details = ended.code(), ended.details() or ""
            trailers = ended.trailing_metadata() or grpc.aio.Metadata()

            def error() -> BaseException:
                return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailers, details)

        elif isinstance(ended, grpc.aio.AioRpcError) and ended.code() == grpc.StatusCode.UNIMPLEMENTED:

            def error() -> BaseException:
                return StreamUnsupported(ended.details() or "")

        elif isinstance(ended, grpc.aio.AioRpcError) and status_lost_in_write(ended):

            def error() -> BaseException:
                return StreamStatusLost(ended.details() or "")

        else:
            why = (
                f"{ended.code().name}: {ended.details()}"
                if isinstance(ended, grpc.aio.AioRpcError)
                else "closed"
                if isinstance(ended, asyncio.CancelledError)
                else f"{type(ended).__name__}: {ended}"
                if ended is not None
                else "ended with operations unanswered"
            )
            message = f"the stream to sandbox worker {self.address} broke ({why}); nothing was applied"

            def error() -> BaseException:
                return rpc_error(grpc.StatusCode.UNAVAILABLE, message)

        log.info(
            "stream to %s ended with %d operations waiting: %s", self.address, len(self.waiting), error()
        )
        waiting, self.waiting = self.waiting, {}
        for future, timer in waiting.values():
            timer.cancel()
            if not future.done():
                future.set_exception(error())  # one each: an exception raised in many places


class WorkerStream:
    """The operations the runtime sends one worker, over one stream at a time (see the module doc)."""

    def __init__(
        self,
        stub: sb_grpc.SandboxServiceStub,
        address: str,
        *,
        max_in_flight: int = MAX_IN_FLIGHT,
        others_in_flight: int = OTHERS_IN_FLIGHT,
        steps_in_flight: int = STEPS_IN_FLIGHT,
        max_age_s: float = STREAM_AGE_S,
        slack_s: float = DEADLINE_SLACK_S,
    ) -> None:
        """`slack_s`: what an operation's deadline allows beyond its runs (`deadline_s`)."""
        self.stub = stub
        self.address = address
        self.max_in_flight = max_in_flight
        self.others = asyncio.Semaphore(others_in_flight)
        self.prompt = asyncio.Semaphore(steps_in_flight)
        self.max_age_s = max_age_s
        self.slack_s = slack_s
        self.ids = itertools.count(1)
        self.current: StreamCall | None = None
        self.retiring: set[StreamCall] = set()  # older calls waiting for their last answers
        self.unary_until = 0.0  # the worker has no ExecuteStream: unary calls until then
        # Operations in a unary call, and operations waiting here for a slot (`others` or
        # `prompt`): each held by a token while it is, so the counts are what is held.
        self.unary_calls: set[object] = set()
        self.slot_waiters: set[object] = set()
        self.opened = 0  # calls opened, for the tests and the logs

    def calls(self) -> list[StreamCall]:
        return [*self.retiring, *([self.current] if self.current is not None else [])]

    @property
    def in_flight(self) -> int:
        """Operations held for this worker and not yet answered: waiting here, or sent."""
        return (
            sum(len(call.waiting) for call in self.calls()) + len(self.unary_calls) + len(self.slot_waiters)
        )

    @property
    def queued(self) -> int:
        """Operations waiting here to be sent: for a slot (`others`, `prompt`), or to be written (the
        worker is not reading: flow control)."""
        return len(self.slot_waiters) + sum(call.unsent for call in self.calls())

    async def submit(self, op: sb.Operation) -> sb.OperationResult:
        """The worker's answer to `op`; raises what its unary call would have (see the module doc)."""
        if self.in_flight >= self.max_in_flight:
            raise QueueFull(f"{self.in_flight} operations in flight to sandbox worker {self.address}")
        slots = self.prompt if op.WhichOneof("kind") in PROMPT else self.others
        waiter = object()
        self.slot_waiters.add(waiter)
        try:
            await slots.acquire()
        finally:
            self.slot_waiters.discard(waiter)
        try:
            return await self._send(op)
        finally:
            slots.release()

    async def _send(self, op: sb.Operation) -> sb.OperationResult:
        now = asyncio.get_running_loop().time()
        if now < self.unary_until:
            return await self._unary(op)
        call = self._call()
        op_id = next(self.ids)
        try:
            return await call.submit(op_id, op, deadline_s(op, self.slack_s))
        except StreamUnsupported as exc:
            if now >= self.unary_until:
                log.warning(
                    "sandbox worker %s has no ExecuteStream (%s): unary calls for %.0f s",
                    self.address,
                    exc,
                    UNARY_S,
                )
                self.unary_until = asyncio.get_running_loop().time() + UNARY_S
            return await self._unary(op)
        except StreamStatusLost:
            # Nothing was applied on the stream, and every operation is a pure function of what it
            # carries: the unary call gives the worker's own answer (or its refusal).
            return await self._unary(op)
        finally:
            call.forget(op_id)

    async def _unary(self, op: sb.Operation) -> sb.OperationResult:
        token = object()
        self.unary_calls.add(token)
        try:
            request = sb.ExecuteRequest(operation=op)
            response = await self.stub.Execute(request, timeout=deadline_s(op, self.slack_s))
            return response.result
        finally:
            self.unary_calls.discard(token)

    def _call(self) -> StreamCall:
        """The open call, a new one when there is none or it is due to retire."""
        current = self.current
        now = asyncio.get_running_loop().time()
        if current is not None and current.open:
            if now - current.opened < self.max_age_s:
                return current
            current.retire()
            self.retiring.add(current)
        # A call retired long ago that waits for nothing any more holds only operations given up
        # on (past their deadline): end it, so a worker that never answers them holds nothing here.
        for call in [c for c in self.retiring if not c.waiting and now - c.opened > 2 * self.max_age_s]:
            call.close()
        self.current = StreamCall(self.stub, self.address, self._ended)
        self.opened += 1
        return self.current

    def _ended(self, call: StreamCall) -> None:
        self.retiring.discard(call)
        if self.current is call:
            self.current = None

    async def close(self) -> None:
        calls = self.calls()
        for call in calls:
            call.close()
        for call in calls:
            await asyncio.gather(call.reader, call.writer, return_exceptions=True)

"""Steps of many sessions over a few shared `StepStream` calls, each awaited as a unary `Step` is:
how `AsyncRuntimeClient.step` sends its steps (unless `step_transport="unary"`).

Why: a trainer drives hundreds of episodes from one client, and a unary call costs the runtime's
gRPC machinery about twice what a message on an open stream costs (a call object, metadata, the
status trailer): a quarter of the runtime's CPU per step goes with it. The runtime's `StepStream`
(services/runtime/streaming.py) runs every step sent on it as `Step` would and answers each as soon
as it is done, tagged, with the status a unary `Step` would have ended with (code, message, reason,
retry-after), so a step sent here raises exactly what it raises sent alone: `StepStreams.step` turns
a refused answer into the same `grpc.RpcError` (its trailers rebuilt from the answer) that the
client types and resends as before (`AsyncRuntimeClient._send`).

How many streams: at most `STREAMS` (4) at a time, opened as steps need them (the least loaded
taken, a new one only when every open one holds steps). A channel over several replicas
(round_robin) gives each new call the next replica, so four streams spread one client's steps over
up to four replicas; more would buy little (a trainer runs one client per rollout worker, and each
stream already takes `max_batch` steps at once on the runtime) and each costs the runtime a reader
task.

Why streams end: a stream is given new sessions for `STREAM_LIFETIME_S` (20 s), then retired: it
takes no new session, and it half-closes once what it holds is answered, so the runtime ends it
cleanly. A runtime recycles its connections (GOAWAY after 5 minutes, `grpc.max_connection_age_ms`)
and breaks the calls still open 30 s later: a stream retired within 20 s of opening is gone by
then, and the new ones go where the channel sends new calls (to a replica added since, too).

Order: a session's steps go on the stream that holds its earlier steps still in flight (tracked
per session, `StepStreams.where`), so the runtime, which runs one stream's steps of a session in
the order sent, never runs a resend ahead of the step it repeats; a session with nothing in flight
goes on any stream. A step whose caller stopped waiting (its deadline passed, its task was
cancelled) cannot be called back from a stream: it runs on the runtime unless it had not been
written yet (then it is dropped unsent), and counts as in flight until its answer arrives.

Failures: a stream that ends while steps are in flight on it (a runtime restarted or killed, a
connection broken, the client closed) fails each of them with the call's status (UNAVAILABLE when
the connection broke), as a unary call broken the same way would fail; the client resends a step
that carries its index (the runtime answers it from its record if it had been applied), and the
next step opens a new stream. A runtime that stops (drains) answers every step sent on its streams
from then on with UNAVAILABLE, its reason (nothing applied) and `stopping`: the client resends such
a step at once, on another stream (another replica), gives that stream no more steps and closes
its side once its steps are answered, so the runtime ends it cleanly. (Steps still unanswered on a
stream the runtime ended cleanly were never read, never applied: they fail the same way.)

Bounds: what a stream holds is its steps in flight, each awaited by a caller or answered by the
runtime (`max_batch` slots per stream there, and HTTP/2 flow control holding this side's writes
beyond them); nothing else is kept.

Steps carry the channel's call credentials (a trainer's token) like every call. A stream carries
the metadata of the call that opened it, not of each step: a client whose interceptors add
per-call metadata (the OpenEnv gateway names each caller's tenant) keeps unary steps.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, cast

import grpc

from codegym_client.api.runtime.v1 import runtime_service_pb2 as rt
from codegym_client.errors import REASON_TRAILER, RETRY_AFTER_TRAILER, status_lost_in_write

__all__ = ["STREAMS", "STREAM_LIFETIME_S", "StepFailed", "StepStreams"]

STREAMS = 4
STREAM_LIFETIME_S = 20.0

_CODES = {code.value[0]: code for code in grpc.StatusCode}


class StepFailed(grpc.RpcError):
    """A step sent on a stream that failed: the status a unary `Step` would have ended with (a
    refused answer's, the stream's end, or the step's own deadline), for `typed_error` to type."""

    def __init__(
        self, code: grpc.StatusCode, details: str, trailers: Iterable[tuple[str, str | bytes]] = ()
    ) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details
        self._trailers = tuple(trailers)

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        return self._trailers


def refused(answer: rt.StepStreamResponse) -> StepFailed:
    """A refused answer as the error of a unary Step refused the same way (its trailers rebuilt)."""
    trailers: list[tuple[str, str | bytes]] = []
    if answer.reason:
        trailers.append((REASON_TRAILER, answer.reason))
    if answer.retry_after_ms:
        trailers.append((RETRY_AFTER_TRAILER, str(answer.retry_after_ms)))
    return StepFailed(_CODES.get(answer.code, grpc.StatusCode.UNKNOWN), answer.message, trailers)


class _Sent:
    """A step in flight on a stream: its session, and the future its caller awaits (done once the
    caller stopped waiting)."""

    __slots__ = ("future", "session_id")

    def __init__(self, future: asyncio.Future[rt.StepStreamResponse], session_id: str) -> None:
        self.future = future
        self.session_id = session_id


class Lane:
    """One StepStream call and the steps this client has in flight on it, with the two tasks that
    drive it: `write` sends the queued steps one at a time (gRPC takes one write at a time, and a
    cancelled write cancels the whole call, so no caller ever writes itself), `read` hands each
    answer to its step and fails those left when the call ends."""

    def __init__(self, call: Any, owner: StepStreams) -> None:
        loop = asyncio.get_running_loop()
        self.call = call
        self.owner = owner
        self.opened = loop.time()
        self.sent: dict[str, _Sent] = {}  # tag → step in flight (queued, sent, or given up)
        self.sessions: dict[str, int] = {}  # session → its steps in `sent`
        self.outbox: deque[tuple[str, rt.StepStreamRequest]] = deque()  # each one in `sent`
        self.ready = asyncio.Event()  # the outbox has a step, or the lane was retired
        self.tags = itertools.count()
        self.retired = False
        self.ended = False
        self.reader = loop.create_task(self.read())
        self.writer = loop.create_task(self.write())

    def send(self, request: rt.StepRequest) -> asyncio.Future[rt.StepStreamResponse]:
        tag = str(next(self.tags))
        future: asyncio.Future[rt.StepStreamResponse] = asyncio.get_running_loop().create_future()
        session_id = request.session_id
        self.sent[tag] = _Sent(future, session_id)
        held = self.sessions.get(session_id, 0)
        self.sessions[session_id] = held + 1
        if not held:
            self.owner.where[session_id] = self
        self.outbox.append((tag, rt.StepStreamRequest(step=request, tag=tag)))
        self.ready.set()
        return future

    def retire(self) -> None:
        """Take no new session; half-close once every step in flight is answered."""
        self.retired = True
        self.ready.set()

    def _done(self, tag: str) -> _Sent | None:
        """Forget a step in flight (answered, or dropped unsent)."""
        sent = self.sent.pop(tag, None)
        if sent is None:
            return None
        left = self.sessions[sent.session_id] - 1
        if left:
            self.sessions[sent.session_id] = left
        else:
            del self.sessions[sent.session_id]
            if self.owner.where.get(sent.session_id) is self:
                del self.owner.where[sent.session_id]
        if self.retired and not self.sent:
            self.ready.set()
        return sent

    async def write(self) -> None:
        try:
            while True:
                if not self.outbox:
                    if self.retired and not self.sent:
                        await self.call.done_writing()
                        return
                    self.ready.clear()
                    await self.ready.wait()
                    continue
                tag, request = self.outbox.popleft()
                sent = self.sent.get(tag)
                if sent is None:
                    continue
                if sent.future.done():  # its caller stopped waiting before it went: never sent
                    self._done(tag)
                    continue
                await self.call.write(request)
        except (grpc.RpcError, asyncio.InvalidStateError):
            pass  # the call has ended: `read` fails what is in flight

    async def read(self) -> None:
        # A call that ended OK answered every step it read (services/runtime/streaming.py): a step
        # left was never read, never applied (this side closes a stream only once all is answered,
        # so none is left unless the runtime ended the call by itself).
        code, details = (
            grpc.StatusCode.UNAVAILABLE,
            "the runtime ended the step stream before reading the step",
        )
        trailers: tuple[tuple[str, str | bytes], ...] = ((REASON_TRAILER, "UNAVAILABLE"),)
        try:
            while (answer := await self.call.read()) is not grpc.aio.EOF:
                answer = cast(rt.StepStreamResponse, answer)
                if answer.stopping and not self.retired:  # the runtime is stopping: no more here
                    self.owner.retire(self)
                    self.owner.drained += 1
                sent = self._done(answer.tag)
                if sent is not None and not sent.future.done():
                    sent.future.set_result(answer)
        except grpc.RpcError as exc:
            code, details = exc.code(), str(exc.details() or "")
            trailers = tuple(exc.trailing_metadata() or ())
            if status_lost_in_write(exc):
                # gRPC's own status for a write that failed as the call ended, which replaces the
                # call's real one: the call broke, nobody knows how (as UNAVAILABLE says).
                code, details = grpc.StatusCode.UNAVAILABLE, "the step stream broke while sending"
        except asyncio.CancelledError:
            code, details = grpc.StatusCode.CANCELLED, "the client was closed with the step in flight"
            trailers = ()
            raise
        finally:
            self.end(lambda: StepFailed(code, details, trailers))

    def end(self, failure: Callable[[], StepFailed]) -> None:
        """The call is over: every step still in flight fails with its status; the lane is dropped."""
        self.ended = True
        self.owner.dropped(self)
        if self.sent:
            self.owner.broken += 1
        for sent in self.sent.values():
            if not sent.future.done():
                sent.future.set_exception(failure())
            if self.owner.where.get(sent.session_id) is self:
                del self.owner.where[sent.session_id]
        self.sent.clear()
        self.sessions.clear()
        self.outbox.clear()
        if not self.writer.done():
            self.writer.cancel()


class StepStreams:
    """A client's shared step streams (see the module docstring). Use it inside one event loop;
    `open_call()` opens a StepStream call on the client's channel."""

    def __init__(
        self, open_call: Callable[[], Any], streams: int = STREAMS, lifetime_s: float = STREAM_LIFETIME_S
    ) -> None:
        self.open_call = open_call
        self.lifetime_s = lifetime_s
        self.slots: list[Lane | None] = [None] * max(1, streams)
        self.lanes: set[Lane] = set()  # every lane not ended: the slots' and the retired ones
        self.where: dict[str, Lane] = {}  # session → the lane holding its steps in flight
        self.broken = 0  # streams that ended with steps in flight (each failed, to be resent)
        self.drained = 0  # streams retired because their runtime said it was stopping

    async def step(self, request: rt.StepRequest, timeout_s: float) -> rt.StepResponse:
        """Send one step and await its answer for at most `timeout_s`; a refused step, a broken
        stream or the deadline raise the `grpc.RpcError` a unary Step would have raised."""
        lane = self.where.get(request.session_id) or self.pick()
        future = lane.send(request)
        try:
            answer = await asyncio.wait_for(future, timeout_s)
        except asyncio.TimeoutError:
            raise StepFailed(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        if answer.code:
            raise refused(answer)
        return answer.response

    def pick(self) -> Lane:
        """The least loaded lane for a session with nothing in flight (an open one before a new
        one); lanes past their lifetime are retired here."""
        now = asyncio.get_running_loop().time()
        best, best_load = -1, -1
        for k, lane in enumerate(self.slots):
            if lane is not None and now - lane.opened > self.lifetime_s:
                lane.retire()
                lane = self.slots[k] = None
            load = len(lane.sent) if lane is not None else 0
            if best < 0 or load < best_load or (load == best_load and self.slots[best] is None):
                best, best_load = k, load
        lane = self.slots[best]
        if lane is None:
            lane = self.slots[best] = Lane(self.open_call(), self)
            self.lanes.add(lane)
        return lane

    def retire(self, lane: Lane) -> None:
        """Give the lane no new session (its runtime is stopping); it ends once answered."""
        lane.retire()
        for k, held in enumerate(self.slots):
            if held is lane:
                self.slots[k] = None

    def dropped(self, lane: Lane) -> None:
        self.lanes.discard(lane)
        for k, held in enumerate(self.slots):
            if held is lane:
                self.slots[k] = None

    def in_flight(self) -> int:
        """Steps in flight over every lane (awaited, or given up and not answered yet)."""
        return sum(len(lane.sent) for lane in self.lanes)

    async def close(self) -> None:
        """Cancel every stream; steps in flight fail CANCELLED. Returns once their tasks ended."""
        lanes = list(self.lanes)
        for lane in lanes:
            lane.call.cancel()
        tasks = [task for lane in lanes for task in (lane.reader, lane.writer)]
        await asyncio.gather(*tasks, return_exceptions=True)

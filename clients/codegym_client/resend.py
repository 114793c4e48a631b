"""Resending a call whose reply was lost, without applying it twice.

The client tracks each session's step index from the replies (0 after create and reset, then each
reply's `step_index`); a step whose reply was lost (the connection dropped, a replica died, a
draining replica cancelled it, or the call's own deadline passed while the runtime may have been
waiting out a dead replica's step lease) is sent again with that index, up to `attempts` sends with
a short back-off, and the channel's `round_robin` sends each to a replica that is up. The runtime
applies a step sent with the session's index, and answers one sent with the index before it from
its record, so nothing is applied twice: a replica's death costs a trainer latency, not an episode.
Create and reset are sent again the same way (a reset twice is one reset; a create whose reply was
lost may leave an unanswered session behind, which expires).

The first send of a step carries no index unless the caller gives one (`step(...,
step_index=N)`): a session stepped by someone else too (another client object, a raw stub, a
stream) has a stale index here, and a stale index one behind is answered with the other caller's
recorded reply, silently. Sent on resends only, an index can be stale only when a reply was lost
as well. Steps of one session are sent one at a time by one client (so that the index it resends
is the one the step was meant for); a session this client never saw has no index to resend with,
and its step is sent again only when the runtime answered that nothing was applied (UNAVAILABLE
with its reason). The drop-in environments (`OnlineGymEnv`, `RemoteEnv`) own their sessions and
send every step with its index.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import grpc

from codegym_client.api.runtime.v1 import runtime_service_pb2 as rt
from codegym_client.errors import ANY_CALL, FAILURES, LATE, NEVER, CodeGymError, failure_row, typed_error
from codegym_client.requests import ActionLike, step_request

# How often a step, create or reset is sent at most when its reply is lost, and the back-off
# between sends: short, because the next attempt goes to another replica; the sends span about
# 1.5-3 s, long enough for the channel to find a replica that restarted on its address.
DEFAULT_ATTEMPTS = 6
FIRST_BACKOFF_S = 0.1
MAX_BACKOFF_S = 1.0
# Of those, sends after the call's own deadline passed: one, so that a step that was waiting out a
# dead replica's step lease gets its answer, while a hung runtime costs at most twice `timeout_s`.
LATE_RESENDS = 1
# Sessions whose step index a client remembers (least recently used forgotten first): a forgotten
# session's next step goes without an index, as a session this client never saw.
TRACKED_SESSIONS = 1 << 17
# A step of a session whose step deadline is known (CreateSession's `step_timeout_ms`) is
# given at least this deadline: the worker may run it twice (once more, cold, after an
# infrastructure fault), plus time for the way there and a cold start. A client's `timeout_s`
# below it would cut a legitimate long step short and make a resend wait out the first send.
RUNS_PER_STEP = 2
STEP_DEADLINE_SLACK_S = 10.0


def resend_kind(error: CodeGymError, repeatable: bool) -> str:
    """Whether a failed call is sent again: "" (no), "now" or "late" (its own deadline passed), by
    the `resend` column of the failure table (errors.py).

    `repeatable`: sending the call twice does what sending it once does (a step with its index,
    a reset, a create whose orphan may expire). Such a call is resent whenever its reply may have
    been lost (the connection dropped or the replica died: UNAVAILABLE; our own deadline passed:
    DEADLINE_EXCEEDED; a draining replica cancelled it: CANCELLED). Any call, even a step without
    an index, is resent when the runtime itself answered UNAVAILABLE: by the table, nothing was
    applied then.
    """
    row = failure_row(error)
    resend = NEVER if row is None else row.resend
    if resend == ANY_CALL:
        return "now"
    if resend == NEVER or not repeatable:
        return ""
    return "late" if resend == LATE else "now"


@dataclass
class Attempts:
    """The resend budget of one call: `attempts` sends at most, of which `LATE_RESENDS` after a
    deadline, with a jittered exponential back-off between sends (jitter: trainers that lost the
    same replica do not all come back at the same instant)."""

    attempts: int
    sent: int = 0
    late: int = 0

    def again(self, kind: str) -> float | None:
        """The delay before the next send after a failure of `kind`, or None: give up."""
        self.sent += 1
        if not kind or self.sent >= self.attempts:
            return None
        if kind == "late":
            if self.late >= LATE_RESENDS:
                return None
            self.late += 1
        backoff = min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2 ** (self.sent - 1))
        return backoff * random.uniform(0.5, 1.0)


class StepIndexes:
    """The step index of each session this client has seen (thread-safe, least recently used
    forgotten past `limit`), and a lock per session so that one session's steps are sent one at
    a time: a step resent with the index it started from must not race another step of the same
    session, or the runtime would take one for the other's resend."""

    def __init__(self, limit: int = TRACKED_SESSIONS) -> None:
        self.limit = limit
        self._index: OrderedDict[str, int] = OrderedDict()
        self._deadline: dict[str, float] = {}  # session → the least deadline of its steps, s
        self._mutex = threading.Lock()
        self._locks: dict[str, list[Any]] = {}  # session → [lock, holders]

    def get(self, session_id: str) -> int | None:
        with self._mutex:
            index = self._index.get(session_id)
            if index is not None:
                self._index.move_to_end(session_id)
            return index

    def set(self, session_id: str, index: int) -> None:
        with self._mutex:
            self._index[session_id] = index
            self._index.move_to_end(session_id)
            while len(self._index) > self.limit:
                gone, _ = self._index.popitem(last=False)
                self._deadline.pop(gone, None)

    def created(self, response: rt.CreateSessionResponse) -> None:
        """A session this client created: index 0, and its steps' deadline from its step timeout."""
        self.set(response.session_id, 0)
        if response.step_timeout_ms:
            with self._mutex:
                if response.session_id in self._index:
                    seconds = response.step_timeout_ms / 1000 * RUNS_PER_STEP + STEP_DEADLINE_SLACK_S
                    self._deadline[response.session_id] = seconds

    def made(self, session: rt.ForkedSession) -> None:
        """A session a fork or restore made: its index, and its steps' deadline."""
        self.set(session.session_id, session.step_index)
        if session.step_timeout_ms:
            with self._mutex:
                if session.session_id in self._index:
                    seconds = session.step_timeout_ms / 1000 * RUNS_PER_STEP + STEP_DEADLINE_SLACK_S
                    self._deadline[session.session_id] = seconds

    def deadline(self, session_ids: Iterable[str], floor: float) -> float:
        """The deadline for one call stepping `session_ids`: `floor` (the client's
        `timeout_s`), raised to what the slowest of those sessions' steps may take."""
        with self._mutex:
            return max([floor, *(self._deadline.get(s, 0.0) for s in session_ids)])

    def forget(self, session_id: str) -> None:
        with self._mutex:
            self._index.pop(session_id, None)
            self._deadline.pop(session_id, None)

    def __len__(self) -> int:
        return len(self._index)

    def _enter(self, session_id: str, make: Callable[[], Any]) -> Any:
        with self._mutex:
            entry = self._locks.get(session_id)
            if entry is None:
                entry = self._locks[session_id] = [make(), 0]
            entry[1] += 1
            return entry[0]

    def _leave(self, session_id: str) -> None:
        with self._mutex:
            entry = self._locks[session_id]
            entry[1] -= 1
            if entry[1] == 0:
                del self._locks[session_id]

    @contextlib.contextmanager
    def holding(self, session_ids: Iterable[str]) -> Iterator[None]:
        """The sessions' locks, taken in one order (no deadlock between two batches)."""
        held: list[str] = []
        locked: list[threading.Lock] = []
        try:
            for session_id in sorted(set(session_ids)):
                lock = self._enter(session_id, threading.Lock)
                held.append(session_id)
                lock.acquire()
                locked.append(lock)
            yield
        finally:
            for lock in reversed(locked):
                lock.release()
            for session_id in reversed(held):
                self._leave(session_id)

    @contextlib.asynccontextmanager
    async def holding_async(self, session_ids: Iterable[str]) -> AsyncIterator[None]:
        """`holding` for one event loop's tasks (asyncio locks)."""
        held: list[str] = []
        locked: list[asyncio.Lock] = []
        try:
            for session_id in sorted(set(session_ids)):
                lock = self._enter(session_id, asyncio.Lock)
                held.append(session_id)
                await lock.acquire()
                locked.append(lock)
            yield
        finally:
            for lock in reversed(locked):
                lock.release()
            for session_id in reversed(held):
                self._leave(session_id)

    def learn(self, session_id: str, response: rt.StepResponse) -> None:
        """A step's reply: its `step_index` is the session's index now (unchanged by a step error)."""
        self.set(session_id, response.step_index)


def batch_entry_lost(result: rt.BatchStepResult) -> bool:
    """An entry the runtime answered UNAVAILABLE: by the failure table, nothing of it was applied (an
    entry carries its status, not a reason: the runtime's own UNAVAILABLE row decides)."""
    return result.code == FAILURES["UNAVAILABLE"].code.value[0]


def step_requests(
    session_id: str, action: ActionLike, step_index: int | None, indexes: StepIndexes
) -> tuple[rt.StepRequest, rt.StepRequest]:
    """A step's first send and its resends: the first carries only an index the caller gave, the
    resends the index this client knows, when it knows one (see the module docstring for why)."""
    request = step_request(session_id, action, step_index)
    if step_index is not None:
        return request, request
    known = indexes.get(session_id)
    return request, request if known is None else step_request(session_id, action, known)


class PendingBatch:
    """A BatchStep being played, over possibly several calls: the entries the runtime answered
    UNAVAILABLE (nothing of them applied) are sent again, in a smaller batch, until none is left or
    the budget runs out; every other entry keeps its first answer. The whole call is sent again
    when the runtime itself answered it UNAVAILABLE (nothing applied), or when its reply is lost
    and every pending entry carries its session's index.

    The sync and async clients drive it the same way, differing only in how they send and sleep:

        while True:
            try:
                answer = send(batch.request())
            except grpc.RpcError as exc:
                delay = batch.after_error(exc, closed)  # raises when no round was answered
            else:
                delay = batch.after_answer(answer, closed)
            if delay is None:
                return batch.finish(indexes)
            sleep(delay)
    """

    def __init__(
        self, steps: Sequence[tuple[str, ActionLike]], indexes: StepIndexes, attempts: int = DEFAULT_ATTEMPTS
    ) -> None:
        # The first send goes as the caller gave it; sends after it carry each known index.
        self.requests = [step_request(s, a) for s, a in steps]
        self.numbered = [
            self.requests[k] if (index := indexes.get(s)) is None else step_request(s, a, index)
            for k, (s, a) in enumerate(steps)
        ]
        self.results: list[rt.BatchStepResult | None] = [None] * len(self.requests)
        self.pending = list(range(len(self.requests)))
        self.sent = 0
        self.budget = Attempts(max(1, attempts))
        self.failed: CodeGymError | None = None  # the last round's error, if it failed

    def after_error(self, exc: grpc.RpcError, closed: bool) -> float | None:
        """The round failed: the delay before sending it again, or None to stop with what the
        earlier rounds answered. Raises the typed error when no round was answered at all."""
        self.failed = typed_error(exc, "BatchStep")
        delay = None if closed else self.budget.again(resend_kind(self.failed, self.repeatable()))
        if delay is None and not self.answered():
            raise self.failed from exc
        return delay

    def after_answer(self, answer: rt.BatchStepResponse, closed: bool) -> float | None:
        """The round was answered: the delay before sending its UNAVAILABLE entries again, or
        None when none is left or the budget is spent."""
        self.failed = None
        self.take(answer.results)
        if not self.pending or closed:
            return None
        return self.budget.again("now")

    def finish(self, indexes: StepIndexes) -> list[rt.BatchStepResult]:
        """The entries, in the caller's order; the sessions' indexes learnt from them."""
        self.learn(indexes)
        return self.give_up(self.failed)

    def request(self) -> rt.BatchStepRequest:
        steps = self.requests if self.sent == 0 else self.numbered
        self.sent += 1
        return rt.BatchStepRequest(steps=[steps[k] for k in self.pending])

    def repeatable(self) -> bool:
        """Whether this round can be sent again after its reply was lost: every step has its index."""
        return all(self.numbered[k].HasField("step_index") for k in self.pending)

    def take(self, results: Sequence[rt.BatchStepResult]) -> None:
        for k, result in zip(self.pending, results, strict=True):
            self.results[k] = result
        self.pending = [
            k for k in self.pending if batch_entry_lost(cast(rt.BatchStepResult, self.results[k]))
        ]

    def answered(self) -> bool:
        """Some round got its reply (so the batch returns entries instead of raising)."""
        return any(result is not None for result in self.results)

    def give_up(self, error: CodeGymError | None) -> list[rt.BatchStepResult]:
        """The entries; those still pending carry the error of the round that failed, if one did
        (they may or may not have been applied, unlike an entry the runtime answered UNAVAILABLE)."""
        if error is not None:
            for k in self.pending:
                self.results[k] = rt.BatchStepResult(
                    session_id=self.requests[k].session_id,
                    code=error.code().value[0],
                    message=f"sent again after UNAVAILABLE, then: {error.details()}",
                )
        return [cast(rt.BatchStepResult, result) for result in self.results]

    def learn(self, indexes: StepIndexes) -> None:
        for result in self.results:
            if result is None:
                continue
            if result.code == 0 and result.HasField("response"):
                indexes.learn(result.session_id, result.response)
            elif result.code == grpc.StatusCode.NOT_FOUND.value[0]:
                indexes.forget(result.session_id)

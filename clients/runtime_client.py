"""Clients of the runtime service for trainers: `RuntimeClient` (threads) and `AsyncRuntimeClient`.

Deadlines and retries are set once, on the channel: every call gets `timeout_s`, and the channel
retries UNAVAILABLE (a replica restarting, a connection reset) except for Step and BatchStep, which
change a session and must not be applied twice by a blind retry.

Steps are resent here instead, safely. The client tracks each session's step index from the
replies (0 after create and reset, then each reply's `step_index`); a step whose reply was lost (the
connection dropped, a replica died, a draining replica cancelled it, or the call's own deadline
passed while the runtime may have been waiting out a dead replica's step lease) is sent again with
that index, up to `attempts` sends with a short back-off, and the channel's `round_robin` sends
each to a replica that is up. The runtime applies a step sent with the session's index, and answers
one sent with the index before it from its record, so nothing is applied twice: a replica's death
costs a trainer latency, not an episode. Create and reset are sent again the same way (a reset
twice is one reset; a create whose reply was lost may leave an unanswered session behind, which
expires).

The first send of a step carries no index unless the caller gives one (`step(...,
step_index=N)`): a session stepped by someone else too (another client object, a raw stub, a
stream) has a stale index here, and a stale index one behind is answered with the other caller's
recorded reply, silently. Sent on resends only, an index can be stale only when a reply was lost
as well. Steps of one session are sent one at a time by one client (so that the index it resends
is the one the step was meant for); a session this client never saw has no index to resend with,
and its step is sent again only when the runtime answered that nothing was applied (UNAVAILABLE
with its reason). The drop-in environments (`OnlineGymEnv`, `RemoteEnv`) own their sessions and
send every step with its index.

A call the runtime refuses raises a `CodeGymError` subclass chosen by the `codegym-reason` trailer
the runtime sends with every refusal, or by the status code when there is none (an older server,
or a failure on the way):

| reason              | status              | exception           | retry                     |
|---------------------|---------------------|---------------------|---------------------------|
| `INVALID_REQUEST`   | INVALID_ARGUMENT    | `InvalidRequest`    | never                     |
| `ENV_NOT_FOUND`     | NOT_FOUND           | `EnvNotFound`       | never                     |
| `SESSION_NOT_FOUND` | NOT_FOUND           | `SessionNotFound`   | never                     |
| `SESSION_DONE`      | FAILED_PRECONDITION | `SessionDone`       | never (Reset first)       |
| `ENV_FAILED`        | FAILED_PRECONDITION | `EnvFailed`         | never                     |
| `STEP_CONFLICT`     | ABORTED             | `StepConflict`      | after reading the session |
| `CAPACITY`          | RESOURCE_EXHAUSTED  | `CapacityExceeded`  | after `retry_after_s`     |
| `UNAVAILABLE`       | UNAVAILABLE         | `RuntimeUnavailable`| yes, any replica          |
| `UPSTREAM_REJECTED` | FAILED_PRECONDITION | `CodeGymError`      | never (synthesis only)    |
| `INTERNAL`          | INTERNAL            | `CodeGymError`      | never                     |

Each error has `reason` (the row's name), `retryable` and `retry_after_s`, and is also a
`grpc.RpcError` with `code()`, `details()` and `trailing_metadata()`, so code written against raw
gRPC errors keeps working. Per-entry codes of `BatchStep` and `StepStream` answers stay in the
answers (`code`, `message`); see `batch_step` and `StepStream` for what is resent there.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import random
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar, cast

import grpc

from clients.actions import Action
from codegym.grpcutil import aio_channel, sync_channel
from codegym.runtime.v1 import runtime_service_pb2 as rt
from codegym.runtime.v1 import runtime_service_pb2_grpc as rt_grpc

SERVICE = rt.DESCRIPTOR.services_by_name["RuntimeService"].full_name
NOT_RETRIED = [(SERVICE, "Step"), (SERVICE, "BatchStep")]
DEFAULT_TARGET = "127.0.0.1:50051"
# RPCs that name an environment: NOT_FOUND there means the env, anywhere else the session.
ENV_METHODS = frozenset({"CreateSession", "GetEnv"})
# RPCs that run the environment's reset: FAILED_PRECONDITION there is the environment failing.
ENV_RESET_METHODS = frozenset({"CreateSession", "Reset"})
PROBE_TIMEOUT_S = 1.0

# The trailers the runtime sends with a refusal (codegym/errors.py on the server side; the client
# install does not ship the servers, so the names are repeated here and a test keeps them equal).
REASON_TRAILER = "codegym-reason"
RETRY_AFTER_TRAILER = "retry-after-ms"

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

ActionLike = str | dict[str, Any] | Action | rt.ToolCall

__all__ = [
    "DEFAULT_TARGET",
    "ActionLike",
    "AsyncRuntimeClient",
    "CapacityExceeded",
    "CodeGymError",
    "EnvFailed",
    "EnvNotFound",
    "InvalidRequest",
    "RuntimeClient",
    "RuntimeUnavailable",
    "SessionDone",
    "SessionNotFound",
    "StepConflict",
    "StepStream",
    "create_request",
    "step_request",
]


# ---- errors ---------------------------------------------------------------------------------------


def reason_sent(trailers: Iterable[tuple[str, str | bytes]]) -> str:
    """The `codegym-reason` trailer's value, or "" when the server sent none."""
    for key, value in trailers:
        if key.lower() == REASON_TRAILER:
            return value.decode("ascii", "replace") if isinstance(value, bytes) else str(value)
    return ""


class CodeGymError(grpc.RpcError):
    """A runtime call that failed: the gRPC status (`code()`, `details()`), the RPC (`method`), the
    `reason` from the error table (see the module docstring), whether the same call can succeed
    later as it is (`retryable`) and, when the runtime sent a `retry-after-ms` trailer, how long to
    wait before retrying (`retry_after_s`).

    `reason` is the runtime's `codegym-reason` trailer when it sent one whose status agrees, else
    the reason the status code stands for ("" for a status outside the table, e.g. UNKNOWN).
    """

    default_reason = ""

    def __init__(
        self,
        code: grpc.StatusCode,
        details: str,
        method: str = "",
        trailers: Iterable[tuple[str, str | bytes]] = (),
    ) -> None:
        self._code = code
        self._details = details
        self.method = method
        self._trailers = tuple((str(k), v) for k, v in trailers)
        self.retry_after_s = retry_after_s(self._trailers)
        sent = reason_sent(self._trailers)
        if sent in REASONS and REASONS[sent][0] == code:
            self.reason = sent
        elif type(self).default_reason:
            self.reason = type(self).default_reason
        else:
            self.reason = "INTERNAL" if code == grpc.StatusCode.INTERNAL else ""
        # Only infrastructure and capacity refusals clear up by themselves; every other reason
        # fails the same way again until the request or the session changes.
        self.retryable = self.reason in RETRYABLE_REASONS
        super().__init__(f"{code.name}: {details}" if details else code.name)

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        return self._trailers

    def __reduce__(self) -> tuple[Any, ...]:
        # Picklable with its status (trainers pass errors between processes).
        return (type(self), (self._code, self._details, self.method, self._trailers))


class InvalidRequest(CodeGymError):
    """INVALID_ARGUMENT (`INVALID_REQUEST`): the request cannot be served as sent (bad task, config
    or options)."""

    default_reason = "INVALID_REQUEST"


class EnvNotFound(CodeGymError):
    """NOT_FOUND (`ENV_NOT_FOUND`) from CreateSession or GetEnv: no such environment (or env class)
    in the library."""

    default_reason = "ENV_NOT_FOUND"


class SessionNotFound(CodeGymError):
    """NOT_FOUND (`SESSION_NOT_FOUND`) from a session RPC: the session is closed, expired or was
    never opened."""

    default_reason = "SESSION_NOT_FOUND"


class SessionDone(CodeGymError):
    """FAILED_PRECONDITION (`SESSION_DONE`): the session's episode has ended (done or truncated);
    Reset it or open another."""

    default_reason = "SESSION_DONE"


class EnvFailed(InvalidRequest):
    """FAILED_PRECONDITION (`ENV_FAILED`) from CreateSession or Reset: the environment itself failed
    to start or reset with this config (it raised, looped or ran out of memory). The same call fails
    again: skip the config. It is an `InvalidRequest` too, because code written before this error
    existed caught an environment raising at create as one."""

    default_reason = "ENV_FAILED"


class StepConflict(CodeGymError):
    """ABORTED (`STEP_CONFLICT`): the step's index is not the session's (another client, or a
    replica whose lease ran out, moved the session). Nothing was applied by this call: read the
    session (`get_session`) and decide, e.g. `step(..., step_index=view.step_index)`."""

    default_reason = "STEP_CONFLICT"


class CapacityExceeded(CodeGymError):
    """RESOURCE_EXHAUSTED (`CAPACITY`): the runtime is at its session limit (or a size or sandbox
    limit was hit); `retry_after_s` carries the runtime's hint when it sent one."""

    default_reason = "CAPACITY"


class RuntimeUnavailable(CodeGymError):
    """UNAVAILABLE (`UNAVAILABLE`), or DEADLINE_EXCEEDED: no runtime replica (or none of its sandbox
    workers) answered in time. Steps, creates and resets were already resent before this is raised;
    a step sent again later with `step()` keeps its index, so it is still not applied twice."""

    default_reason = "UNAVAILABLE"


# reason → (status, exception). The server's codegym/errors.py holds the same table; a test keeps
# the two equal.
REASONS: dict[str, tuple[grpc.StatusCode, type[CodeGymError]]] = {
    "INVALID_REQUEST": (grpc.StatusCode.INVALID_ARGUMENT, InvalidRequest),
    "ENV_NOT_FOUND": (grpc.StatusCode.NOT_FOUND, EnvNotFound),
    "SESSION_NOT_FOUND": (grpc.StatusCode.NOT_FOUND, SessionNotFound),
    "SESSION_DONE": (grpc.StatusCode.FAILED_PRECONDITION, SessionDone),
    "ENV_FAILED": (grpc.StatusCode.FAILED_PRECONDITION, EnvFailed),
    "STEP_CONFLICT": (grpc.StatusCode.ABORTED, StepConflict),
    "CAPACITY": (grpc.StatusCode.RESOURCE_EXHAUSTED, CapacityExceeded),
    "UNAVAILABLE": (grpc.StatusCode.UNAVAILABLE, RuntimeUnavailable),
    # The synthesis server's (an LLM endpoint refusing the request); no runtime call answers it.
    "UPSTREAM_REJECTED": (grpc.StatusCode.FAILED_PRECONDITION, CodeGymError),
    "INTERNAL": (grpc.StatusCode.INTERNAL, CodeGymError),
}
RETRYABLE_REASONS = frozenset({"UNAVAILABLE", "CAPACITY"})

# The fallback for a status that came without a reason (NOT_FOUND and FAILED_PRECONDITION depend
# on the RPC, see `error_class`).
BY_CODE: dict[grpc.StatusCode, type[CodeGymError]] = {
    grpc.StatusCode.FAILED_PRECONDITION: SessionDone,
    grpc.StatusCode.ABORTED: StepConflict,
    grpc.StatusCode.RESOURCE_EXHAUSTED: CapacityExceeded,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.UNAVAILABLE: RuntimeUnavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: RuntimeUnavailable,
}


def error_class(code: grpc.StatusCode, reason: str, method: str) -> type[CodeGymError]:
    """The exception for a status: the reason's row when the reason agrees with the status (a
    reason under another status was not this status's cause, e.g. a proxy's), else by status."""
    row = REASONS.get(reason)
    if row is not None and row[0] == code:
        return row[1]
    if code == grpc.StatusCode.NOT_FOUND:
        return EnvNotFound if method in ENV_METHODS else SessionNotFound
    if code == grpc.StatusCode.FAILED_PRECONDITION and method in ENV_RESET_METHODS:
        return EnvFailed  # create and reset have no finished episode to refuse
    return BY_CODE.get(code, CodeGymError)


def retry_after_s(trailers: Iterable[tuple[str, str | bytes]]) -> float | None:
    for key, value in trailers:
        if key.lower() == RETRY_AFTER_TRAILER:
            try:
                return max(0.0, int(value) / 1000)
            except ValueError:
                return None
    return None


def typed_error(exc: grpc.RpcError, method: str) -> CodeGymError:
    """The typed twin of a raw gRPC error raised by `method` (a RuntimeService RPC name)."""
    if isinstance(exc, CodeGymError):
        return exc
    code_of = getattr(exc, "code", None)
    code = code_of() if callable(code_of) else None
    if not isinstance(code, grpc.StatusCode):
        code = grpc.StatusCode.UNKNOWN
    details_of = getattr(exc, "details", None)
    details = (details_of() if callable(details_of) else None) or ""
    trailers_of = getattr(exc, "trailing_metadata", None)
    trailers = tuple((trailers_of() if callable(trailers_of) else None) or ())
    kind = error_class(code, reason_sent(trailers), method)
    return kind(code, str(details), method, trailers)


P = ParamSpec("P")
R = TypeVar("R")


def raises_typed(method: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Turn the raw gRPC errors of a client method (plain, async or generator) into `CodeGymError`s."""

    def wrap(fn: Callable[P, R]) -> Callable[P, R]:
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def run_async(*args: P.args, **kwargs: P.kwargs) -> Any:
                try:
                    return await fn(*args, **kwargs)
                except CodeGymError:
                    raise
                except grpc.RpcError as exc:
                    raise typed_error(exc, method) from exc

            return cast(Callable[P, R], run_async)

        if inspect.isgeneratorfunction(fn):

            @functools.wraps(fn)
            def run_generator(*args: P.args, **kwargs: P.kwargs) -> Any:
                try:
                    return (yield from cast(Iterator[Any], fn(*args, **kwargs)))
                except CodeGymError:
                    raise
                except grpc.RpcError as exc:
                    raise typed_error(exc, method) from exc

            return cast(Callable[P, R], run_generator)

        @functools.wraps(fn)
        def run(*args: P.args, **kwargs: P.kwargs) -> R:
            try:
                return fn(*args, **kwargs)
            except CodeGymError:
                raise
            except grpc.RpcError as exc:
                raise typed_error(exc, method) from exc

        return run

    return wrap


# ---- resending ------------------------------------------------------------------------------------

# Statuses a call can end with on the way, without the runtime having decided anything we know of:
# the connection dropped or the replica died (UNAVAILABLE), our own deadline passed
# (DEADLINE_EXCEEDED), or a draining replica cancelled the call (CANCELLED). The call may or may not
# have been applied.
LOST_REPLY = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
)


def resend_kind(error: CodeGymError, repeatable: bool) -> str:
    """Whether a failed call is sent again: "" (no), "now" or "late" (its own deadline passed).

    `repeatable`: sending the call twice does what sending it once does (a step with its index,
    a reset, a create whose orphan may expire). Such a call is resent whenever its reply may have
    been lost. Any call, even a step without an index, is resent when the runtime itself answered
    UNAVAILABLE: by the error table, nothing was applied then.
    """
    sent = reason_sent(error.trailing_metadata())
    if sent:  # the runtime (not the way to it) answered: only its UNAVAILABLE clears up by itself
        return "now" if sent == "UNAVAILABLE" and error.code() == grpc.StatusCode.UNAVAILABLE else ""
    if not repeatable or error.code() not in LOST_REPLY:
        return ""
    return "late" if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED else "now"


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
                self._index.popitem(last=False)

    def forget(self, session_id: str) -> None:
        with self._mutex:
            self._index.pop(session_id, None)

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
    """An entry the runtime answered UNAVAILABLE: by the error table, nothing of it was applied."""
    return result.code == grpc.StatusCode.UNAVAILABLE.value[0]


def connect_cause(details: str) -> str:
    """A short reason from the details of a call that could not reach the runtime."""
    low = details.lower()
    for needle, cause in (
        ("connection refused", "connection refused (nothing listens there)"),
        ("domain name not found", "host name not found"),
        ("name or service not known", "host name not found"),
        ("network is unreachable", "network unreachable"),
        ("no route to host", "no route to host"),
        ("connection reset", "connection reset"),
        ("deadline exceeded", "no answer in time"),
        ("timed out", "no answer in time"),
    ):
        if needle in low:
            return cause
    return details or "no answer"


def target_text(target: str | Sequence[str]) -> str:
    return target if isinstance(target, str) else ",".join(target)


# grpc.health.v1's HealthCheckRequest for the whole server is the empty message: sent as raw bytes,
# so the client needs no health-checking package (a trainer installs grpcio and protobuf only).
HEALTH_REQUEST = b""
HEALTH_CHECK = "/grpc.health.v1.Health/Check"  # outside the channel's retry policy: fails at once


def unreachable(target: str, timeout_s: float, probe: grpc.RpcError) -> RuntimeUnavailable | None:
    """The error of a channel that did not connect in time, or None when the probe got through."""
    code = probe.code()
    if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return None  # something answered: the channel connected after all
    cause = connect_cause(str(probe.details() or ""))
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        cause = f"no answer after {timeout_s:g} s"
    return RuntimeUnavailable(grpc.StatusCode.UNAVAILABLE, f"cannot reach {target}: {cause}", "wait_ready")


def create_request(
    *,
    ability: str = "",
    env_id: str = "",
    config: dict[str, Any] | str | None = None,
    env_str: str = "",
    max_steps: int = 0,
    step_timeout_ms: int = 0,
    seed: int = 0,
) -> rt.CreateSessionRequest:
    options = rt.SessionOptions(max_steps=max_steps, step_timeout_ms=step_timeout_ms, seed=seed)
    if ability:
        return rt.CreateSessionRequest(ability=ability, options=options)
    config_json = config if isinstance(config, str) else json.dumps(config or {})
    task = rt.EnvTask(env_id=env_id, config_json=config_json if not env_str else "", env_str=env_str)
    return rt.CreateSessionRequest(env_task=task, options=options)


def step_request(session_id: str, action: ActionLike, step_index: int | None = None) -> rt.StepRequest:
    """A StepRequest; with `step_index` (the session's index before this step) it can be resent."""
    if isinstance(action, rt.ToolCall):
        request = rt.StepRequest(session_id=session_id, tool_call=action)
    else:
        if isinstance(action, Action):
            action = action.to_json()
        elif isinstance(action, dict):
            action = json.dumps(action, ensure_ascii=False)
        request = rt.StepRequest(session_id=session_id, action_json=action)
    if step_index is not None:
        request.step_index = step_index
    return request


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
    the budget runs out; every other entry keeps its first answer."""

    def __init__(self, steps: Sequence[tuple[str, ActionLike]], indexes: StepIndexes) -> None:
        # The first send goes as the caller gave it; sends after it carry each known index.
        self.requests = [step_request(s, a) for s, a in steps]
        self.numbered = [
            self.requests[k] if (index := indexes.get(s)) is None else step_request(s, a, index)
            for k, (s, a) in enumerate(steps)
        ]
        self.results: list[rt.BatchStepResult | None] = [None] * len(self.requests)
        self.pending = list(range(len(self.requests)))
        self.sent = 0

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


class RuntimeClient:
    """Blocking client; thread-safe (one channel, many threads). Failed calls raise `CodeGymError`s.

    `timeout_s` is each send's deadline; `attempts` how many times a step, create or reset is sent
    at most when its reply is lost (1: never resent). See the module docstring.
    """

    def __init__(
        self,
        target: str | Sequence[str] = DEFAULT_TARGET,
        *,
        timeout_s: float = 30.0,
        attempts: int = DEFAULT_ATTEMPTS,
    ) -> None:
        self.target = target_text(target)
        self.channel = sync_channel(target, [SERVICE], no_retry=NOT_RETRIED)
        self.stub = rt_grpc.RuntimeServiceStub(self.channel)
        self.timeout_s = timeout_s
        self.attempts = max(1, attempts)
        self.indexes = StepIndexes()
        self._closed = False

    def close(self) -> None:
        self._closed = True
        self.channel.close()

    def __enter__(self) -> RuntimeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Wait until the channel is connected; `RuntimeUnavailable` (with the cause) if it is not."""
        try:
            grpc.channel_ready_future(self.channel).result(timeout=timeout_s)
            return
        except grpc.FutureTimeoutError:
            pass
        probe = self.channel.unary_unary(HEALTH_CHECK)  # raw bytes: see HEALTH_REQUEST
        try:  # one quick call, for the reason (a connection refused, an unknown host...)
            probe(HEALTH_REQUEST, timeout=PROBE_TIMEOUT_S)
        except grpc.RpcError as exc:
            error = unreachable(self.target, timeout_s, exc)
            if error is not None:
                raise error from None

    def _send(self, method: str, call: Callable[[bool], R], *, repeatable: bool) -> R:
        """`call(first)`, sent again while its reply may have been lost and the budget lasts."""
        budget = Attempts(self.attempts)
        while True:
            try:
                return call(budget.sent == 0)
            except grpc.RpcError as exc:
                error = typed_error(exc, method)
                delay = None if self._closed else budget.again(resend_kind(error, repeatable))
                if delay is None:
                    raise error from exc
            time.sleep(delay)

    @raises_typed("CreateSession")
    def create_session(self, **kwargs: Any) -> rt.CreateSessionResponse:
        """See `create_request` for the arguments (ability, or env_id + config, or env_str)."""
        request = create_request(**kwargs)
        response: rt.CreateSessionResponse = self._send(
            "CreateSession",
            lambda _: self.stub.CreateSession(request, timeout=self.timeout_s),
            repeatable=True,
        )
        self.indexes.set(response.session_id, 0)
        return response

    @raises_typed("Step")
    def step(self, session_id: str, action: ActionLike, *, step_index: int | None = None) -> rt.StepResponse:
        """One step. A step whose reply is lost is sent again with the session's index, as this
        client tracks it; `step_index` (the session's index before this step) makes every send
        carry it, and the runtime then refuses the step with `StepConflict` when the session is
        elsewhere (see the module docstring)."""
        with self.indexes.holding((session_id,)):
            request, numbered = step_requests(session_id, action, step_index, self.indexes)
            try:
                response: rt.StepResponse = self._send(
                    "Step",
                    lambda first: self.stub.Step(request if first else numbered, timeout=self.timeout_s),
                    repeatable=numbered.HasField("step_index"),
                )
            except SessionNotFound:
                self.indexes.forget(session_id)
                raise
            self.indexes.learn(session_id, response)
            return response

    @raises_typed("BatchStep")
    def batch_step(self, steps: Sequence[tuple[str, ActionLike]]) -> list[rt.BatchStepResult]:
        """One step for each of several distinct sessions, in one call; each entry is answered
        with a response or a status (`code`, `message`, e.g. NOT_FOUND for an unknown session).

        An entry the runtime answers UNAVAILABLE applied nothing: it is sent again (with its
        session's index) in a smaller batch, while the budget lasts. The whole call is sent again
        when its reply is lost and this client knows every entry's session index; otherwise it
        raises, as a lost Step of an unknown session does. Entries still failing when the budget
        runs out are returned with their last code."""
        ids = [session_id for session_id, _ in steps]
        with self.indexes.holding(ids):
            batch = PendingBatch(steps, self.indexes)
            budget = Attempts(self.attempts)
            failed: CodeGymError | None = None
            while True:
                try:
                    answer = self.stub.BatchStep(batch.request(), timeout=self.timeout_s)
                except grpc.RpcError as exc:
                    failed = typed_error(exc, "BatchStep")
                    delay = None if self._closed else budget.again(resend_kind(failed, batch.repeatable()))
                    if delay is None:
                        if not batch.answered():
                            raise failed from exc
                        break
                else:
                    failed = None
                    batch.take(answer.results)
                    if not batch.pending:
                        break
                    delay = None if self._closed else budget.again("now")
                    if delay is None:
                        break
                time.sleep(delay)
            batch.learn(self.indexes)
            return batch.give_up(failed)

    @raises_typed("Reset")
    def reset(self, session_id: str) -> str:
        """Reset to the session's own task (sent again when its reply is lost: a reset twice is one)."""
        with self.indexes.holding((session_id,)):
            request = rt.ResetRequest(session_id=session_id)
            response = self._send(
                "Reset", lambda _: self.stub.Reset(request, timeout=self.timeout_s), repeatable=True
            )
            self.indexes.set(session_id, 0)
            return str(response.observation)

    @raises_typed("CloseSession")
    def close_session(self, session_id: str) -> bool:
        response = self.stub.CloseSession(
            rt.CloseSessionRequest(session_id=session_id), timeout=self.timeout_s
        )
        self.indexes.forget(session_id)
        return bool(response.existed)

    @raises_typed("GetSession")
    def get_session(self, session_id: str) -> rt.GetSessionResponse:
        response: rt.GetSessionResponse = self.stub.GetSession(
            rt.GetSessionRequest(session_id=session_id), timeout=self.timeout_s
        )
        return response

    @raises_typed("ListEnvs")
    def list_envs(self, prefix: str = "", page_size: int = 100) -> Iterator[rt.EnvSummary]:
        token = ""
        while True:
            page = self.stub.ListEnvs(
                rt.ListEnvsRequest(prefix=prefix, page_size=page_size, page_token=token),
                timeout=self.timeout_s,
            )
            yield from page.envs
            token = page.next_page_token
            if not token:
                return

    @raises_typed("GetEnv")
    def get_env(self, env_id: str) -> rt.GetEnvResponse:
        response: rt.GetEnvResponse = self.stub.GetEnv(
            rt.GetEnvRequest(env_id=env_id), timeout=self.timeout_s
        )
        return response


class AsyncRuntimeClient:
    """asyncio client; create it inside the running event loop. Failed calls raise `CodeGymError`s.

    Same resending as `RuntimeClient` (`timeout_s` per send, `attempts` sends at most).
    """

    def __init__(
        self,
        target: str | Sequence[str] = DEFAULT_TARGET,
        *,
        timeout_s: float = 30.0,
        attempts: int = DEFAULT_ATTEMPTS,
    ) -> None:
        self.target = target_text(target)
        self.channel = aio_channel(target, [SERVICE], no_retry=NOT_RETRIED)
        self.stub = rt_grpc.RuntimeServiceStub(self.channel)
        self.timeout_s = timeout_s
        self.attempts = max(1, attempts)
        self.indexes = StepIndexes()
        self._closed = False

    async def close(self) -> None:
        self._closed = True
        await self.channel.close()

    async def __aenter__(self) -> AsyncRuntimeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Wait until the channel is connected; `RuntimeUnavailable` (with the cause) if it is not."""
        try:
            await asyncio.wait_for(self.channel.channel_ready(), timeout_s)
            return
        except TimeoutError:
            pass
        probe = self.channel.unary_unary(HEALTH_CHECK)  # raw bytes: see HEALTH_REQUEST
        try:  # one quick call, for the reason (a connection refused, an unknown host...)
            await probe(HEALTH_REQUEST, timeout=PROBE_TIMEOUT_S)
        except grpc.RpcError as exc:
            error = unreachable(self.target, timeout_s, exc)
            if error is not None:
                raise error from None

    async def _send(self, method: str, call: Callable[[bool], Awaitable[R]], *, repeatable: bool) -> R:
        """`await call(first)`, sent again while its reply may have been lost and the budget lasts."""
        budget = Attempts(self.attempts)
        while True:
            try:
                return await call(budget.sent == 0)
            except grpc.RpcError as exc:
                error = typed_error(exc, method)
                delay = None if self._closed else budget.again(resend_kind(error, repeatable))
                if delay is None:
                    raise error from exc
            await asyncio.sleep(delay)

    @raises_typed("CreateSession")
    async def create_session(self, **kwargs: Any) -> rt.CreateSessionResponse:
        """See `create_request` for the arguments (ability, or env_id + config, or env_str)."""
        request = create_request(**kwargs)
        response: rt.CreateSessionResponse = await self._send(
            "CreateSession",
            lambda _: self.stub.CreateSession(request, timeout=self.timeout_s),
            repeatable=True,
        )
        self.indexes.set(response.session_id, 0)
        return response

    @raises_typed("Step")
    async def step(
        self, session_id: str, action: ActionLike, *, step_index: int | None = None
    ) -> rt.StepResponse:
        """One step; see `RuntimeClient.step`."""
        async with self.indexes.holding_async((session_id,)):
            request, numbered = step_requests(session_id, action, step_index, self.indexes)
            try:
                response: rt.StepResponse = await self._send(
                    "Step",
                    lambda first: self.stub.Step(request if first else numbered, timeout=self.timeout_s),
                    repeatable=numbered.HasField("step_index"),
                )
            except SessionNotFound:
                self.indexes.forget(session_id)
                raise
            self.indexes.learn(session_id, response)
            return response

    @raises_typed("BatchStep")
    async def batch_step(self, steps: Sequence[tuple[str, ActionLike]]) -> list[rt.BatchStepResult]:
        """See `RuntimeClient.batch_step`."""
        ids = [session_id for session_id, _ in steps]
        async with self.indexes.holding_async(ids):
            batch = PendingBatch(steps, self.indexes)
            budget = Attempts(self.attempts)
            failed: CodeGymError | None = None
            while True:
                try:
                    answer = await self.stub.BatchStep(batch.request(), timeout=self.timeout_s)
                except grpc.RpcError as exc:
                    failed = typed_error(exc, "BatchStep")
                    delay = None if self._closed else budget.again(resend_kind(failed, batch.repeatable()))
                    if delay is None:
                        if not batch.answered():
                            raise failed from exc
                        break
                else:
                    failed = None
                    batch.take(answer.results)
                    if not batch.pending:
                        break
                    delay = None if self._closed else budget.again("now")
                    if delay is None:
                        break
                await asyncio.sleep(delay)
            batch.learn(self.indexes)
            return batch.give_up(failed)

    def step_stream(self) -> StepStream:
        """One StepStream call: `send` steps of any sessions, `recv` answers as they complete."""
        return StepStream(self.stub.StepStream(timeout=None), self.indexes)

    @raises_typed("Reset")
    async def reset(self, session_id: str) -> str:
        """See `RuntimeClient.reset`."""
        async with self.indexes.holding_async((session_id,)):
            request = rt.ResetRequest(session_id=session_id)
            response = await self._send(
                "Reset", lambda _: self.stub.Reset(request, timeout=self.timeout_s), repeatable=True
            )
            self.indexes.set(session_id, 0)
            return str(response.observation)

    @raises_typed("CloseSession")
    async def close_session(self, session_id: str) -> bool:
        response = await self.stub.CloseSession(
            rt.CloseSessionRequest(session_id=session_id), timeout=self.timeout_s
        )
        self.indexes.forget(session_id)
        return bool(response.existed)

    @raises_typed("GetSession")
    async def get_session(self, session_id: str) -> rt.GetSessionResponse:
        response: rt.GetSessionResponse = await self.stub.GetSession(
            rt.GetSessionRequest(session_id=session_id), timeout=self.timeout_s
        )
        return response

    @raises_typed("ListEnvs")
    async def list_envs(self, prefix: str = "", page_size: int = 100) -> list[rt.EnvSummary]:
        envs: list[rt.EnvSummary] = []
        token = ""
        while True:
            page = await self.stub.ListEnvs(
                rt.ListEnvsRequest(prefix=prefix, page_size=page_size, page_token=token),
                timeout=self.timeout_s,
            )
            envs.extend(page.envs)
            token = page.next_page_token
            if not token:
                return envs

    @raises_typed("GetEnv")
    async def get_env(self, env_id: str) -> rt.GetEnvResponse:
        response: rt.GetEnvResponse = await self.stub.GetEnv(
            rt.GetEnvRequest(env_id=env_id), timeout=self.timeout_s
        )
        return response


class StepStream:
    """A trainer's side of `StepStream`: many sessions' steps over one call, answered as they finish.

    Answers carry the session id and the tag given to `send`; steps of one session apply in the
    order they were sent. A step the runtime refuses (e.g. an unknown session) is an answer with a
    gRPC status `code` and `message`, not an exception; only the call itself failing raises a
    `CodeGymError`. `done_sending()` ends the request side; `recv()` returns None once every
    answer has arrived.

    Nothing is resent here: a stream may hold several steps of one session at once, and an
    errored step leaves the index where it was, so the client cannot number them in advance.
    Steps go without an index unless `send` is given one. An answer with code UNAVAILABLE applied
    nothing: send that step again. When the call itself fails (`RuntimeUnavailable`), the steps not
    answered yet may or may not have been applied. The client learns each session's index from
    every answer, so a session's first unanswered step can be sent again safely with
    `client.step(session_id, action, step_index=client.indexes.get(session_id))` (answered from the
    runtime's record if it had been applied), then its later steps in order; this needs an index
    the client knew before the stream (a session it created, reset or stepped).
    """

    def __init__(self, call: Any, indexes: StepIndexes | None = None) -> None:
        self.call = call
        self.indexes = indexes
        # gRPC takes one write at a time on a call; concurrent senders queue here.
        self.writing = asyncio.Lock()

    @raises_typed("StepStream")
    async def send(
        self, session_id: str, action: ActionLike, tag: str = "", *, step_index: int | None = None
    ) -> None:
        request = rt.StepStreamRequest(step=step_request(session_id, action, step_index), tag=tag)
        async with self.writing:
            await self.call.write(request)

    @raises_typed("StepStream")
    async def recv(self) -> rt.StepStreamResponse | None:
        answer = await self.call.read()
        if answer is grpc.aio.EOF:
            return None
        answer = cast(rt.StepStreamResponse, answer)
        if self.indexes is not None and answer.code == 0 and answer.HasField("response"):
            self.indexes.learn(answer.session_id, answer.response)
        return answer

    @raises_typed("StepStream")
    async def done_sending(self) -> None:
        await self.call.done_writing()

    def cancel(self) -> None:
        self.call.cancel()

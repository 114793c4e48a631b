"""Typed errors of CodeGym calls: one exception per row of the servers' error table.

A call a server refuses raises a `CodeGymError` subclass chosen by the `codegym-reason` trailer
every CodeGym server sends with a refusal, or by the status code when there is none (an older
server, or a failure on the way):

| reason              | status              | exception           | retry                     | infrastructure |
|---------------------|---------------------|---------------------|---------------------------|----------------|
| `INVALID_REQUEST`   | INVALID_ARGUMENT    | `InvalidRequest`    | never                     | no             |
| `ENV_NOT_FOUND`     | NOT_FOUND           | `EnvNotFound`       | never                     | no             |
| `SESSION_NOT_FOUND` | NOT_FOUND           | `SessionNotFound`   | never                     | yes            |
| `SESSION_DONE`      | FAILED_PRECONDITION | `SessionDone`       | never (Reset first)       | no             |
| `ENV_FAILED`        | FAILED_PRECONDITION | `EnvFailed`         | never                     | no             |
| `STEP_CONFLICT`     | ABORTED             | `StepConflict`      | after reading the session | yes            |
| `CAPACITY`          | RESOURCE_EXHAUSTED  | `CapacityExceeded`  | after `retry_after_s`     | yes            |
| `UNAVAILABLE`       | UNAVAILABLE         | `RuntimeUnavailable`| yes, any replica          | yes            |
| `OUTCOME_UNKNOWN`   | UNAVAILABLE         | `RuntimeUnavailable`| only with the step index  | yes            |
| `UNAUTHENTICATED`   | UNAUTHENTICATED     | `Unauthenticated`   | never                     | no             |
| `PERMISSION_DENIED` | PERMISSION_DENIED   | `PermissionDenied`  | never                     | no             |
| `UPSTREAM_REJECTED` | FAILED_PRECONDITION | `CodeGymError`      | never (synthesis only)    | no             |
| `INTERNAL`          | INTERNAL            | `CodeGymError`      | never                     | yes            |

Each error has `reason` (the row's name), `retryable`, `infrastructure` and `retry_after_s`, and
is also a `grpc.RpcError` with `code()`, `details()` and `trailing_metadata()`, so code written
against raw gRPC errors keeps working. The servers' side of the table is `codegym/errors.py`,
which takes the trailer names from here; a test keeps the rows equal.

`infrastructure`: the call failed for a reason that is neither the agent's nor the environment's
(a runtime or worker down, full, or broken, or the session of an episode the caller owns lost or
moved by a replica): an episode it ends says nothing about the policy, so a trainer must not
learn from it (drop it, never score it 0). `is_infrastructure` answers the same for any exception
a call raised (a failure on the way, with no status from the runtime, is one too).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ParamSpec, TypeVar, cast

import grpc

__all__ = [
    "INFRASTRUCTURE_REASONS",
    "REASONS",
    "REASON_TRAILER",
    "RETRY_AFTER_TRAILER",
    "CapacityExceeded",
    "CodeGymError",
    "EnvFailed",
    "EnvNotFound",
    "EpisodeEnded",
    "EpisodeFailed",
    "InfrastructureFailure",
    "InvalidRequest",
    "PermissionDenied",
    "RuntimeUnavailable",
    "SessionDone",
    "SessionNotFound",
    "StepConflict",
    "Unauthenticated",
    "is_infrastructure",
    "raises_typed",
    "reason_sent",
    "typed_error",
]

# The trailers a server sends with a refusal: the reason's name, and how long to back off.
REASON_TRAILER = "codegym-reason"
RETRY_AFTER_TRAILER = "retry-after-ms"
# RPCs that name an environment: NOT_FOUND there means the env, anywhere else the session.
ENV_METHODS = frozenset({"CreateSession", "GetEnv"})
# RPCs that run the environment's reset: FAILED_PRECONDITION there is the environment failing.
ENV_RESET_METHODS = frozenset({"CreateSession", "Reset"})


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
        self.infrastructure = self.reason in INFRASTRUCTURE_REASONS
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


class Unauthenticated(CodeGymError):
    """UNAUTHENTICATED (`UNAUTHENTICATED`): the server takes access tokens and this call carried
    none, or one it does not know. Never retried and never an infrastructure failure: the same call
    fails until the token is fixed (`CODEGYM_TOKEN` or `--token`), so a trainer stops at once."""

    default_reason = "UNAUTHENTICATED"


class PermissionDenied(CodeGymError):
    """PERMISSION_DENIED (`PERMISSION_DENIED`): the access token is known but its role may not call
    this server (a trainer's token at a sandbox worker). Never retried, never infrastructure."""

    default_reason = "PERMISSION_DENIED"


# reason → (status, exception): the one table. The servers' codegym/errors.py builds its rows
# (with when to retry and what each means) from it.
REASONS: dict[str, tuple[grpc.StatusCode, type[CodeGymError]]] = {
    "INVALID_REQUEST": (grpc.StatusCode.INVALID_ARGUMENT, InvalidRequest),
    "ENV_NOT_FOUND": (grpc.StatusCode.NOT_FOUND, EnvNotFound),
    "SESSION_NOT_FOUND": (grpc.StatusCode.NOT_FOUND, SessionNotFound),
    "SESSION_DONE": (grpc.StatusCode.FAILED_PRECONDITION, SessionDone),
    "ENV_FAILED": (grpc.StatusCode.FAILED_PRECONDITION, EnvFailed),
    "STEP_CONFLICT": (grpc.StatusCode.ABORTED, StepConflict),
    "CAPACITY": (grpc.StatusCode.RESOURCE_EXHAUSTED, CapacityExceeded),
    "UNAVAILABLE": (grpc.StatusCode.UNAVAILABLE, RuntimeUnavailable),
    # The store failed while a step was being committed: applied or not, nobody knows. Safe to
    # resend only with the step's index (the runtime then answers from its record).
    "OUTCOME_UNKNOWN": (grpc.StatusCode.UNAVAILABLE, RuntimeUnavailable),
    # Access: no token or an unknown one; a known token whose role may not call this server.
    "UNAUTHENTICATED": (grpc.StatusCode.UNAUTHENTICATED, Unauthenticated),
    "PERMISSION_DENIED": (grpc.StatusCode.PERMISSION_DENIED, PermissionDenied),
    # The synthesis server's (an LLM endpoint refusing the request); no runtime call answers it.
    "UPSTREAM_REJECTED": (grpc.StatusCode.FAILED_PRECONDITION, CodeGymError),
    "INTERNAL": (grpc.StatusCode.INTERNAL, CodeGymError),
}
RETRYABLE_REASONS = frozenset({"UNAVAILABLE", "CAPACITY"})
# The reasons that are not the agent's nor the environment's doing (the table's last column);
# "" is a status outside the table (UNKNOWN, a proxy's answer): not the environment's either.
INFRASTRUCTURE_REASONS = frozenset(
    {"UNAVAILABLE", "OUTCOME_UNKNOWN", "CAPACITY", "INTERNAL", "STEP_CONFLICT", "SESSION_NOT_FOUND", ""}
)

# The fallback for a status that came without a reason (NOT_FOUND and FAILED_PRECONDITION depend
# on the RPC, see `error_class`).
BY_CODE: dict[grpc.StatusCode, type[CodeGymError]] = {
    grpc.StatusCode.FAILED_PRECONDITION: SessionDone,
    grpc.StatusCode.ABORTED: StepConflict,
    grpc.StatusCode.RESOURCE_EXHAUSTED: CapacityExceeded,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.UNAVAILABLE: RuntimeUnavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: RuntimeUnavailable,
    # gRPC itself answers these too (call credentials that failed), with no trailer.
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
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


def is_infrastructure(exc: BaseException) -> bool:
    """Whether a call's failure is the infrastructure's (see the table): a typed error by its
    reason, any other gRPC failure (the way to the runtime broke) always."""
    if isinstance(exc, CodeGymError):
        return exc.infrastructure
    return isinstance(exc, grpc.RpcError | InfrastructureFailure)


class InfrastructureFailure(BaseException):
    """The runtime could not serve the episode (unavailable after the client's retries, the
    session lost, a call refused): not the environment's answer, so never an observation. A
    `BaseException` because trainers' tool loops (TRL's `_tool_call_loop`) catch every `Exception`
    a tool raises and show it to the model; `__cause__` is the client's error."""


class EpisodeEnded(RuntimeError):
    """A tool was called after the episode ended (done or truncated), or before any `reset`."""


class EpisodeFailed(EpisodeEnded):
    """The runtime could not serve this episode (an outage longer than the TRL adapter's
    `outage_wait_s`, the session lost, a refused call): not the model's doing. A tool raises it
    (TRL shows it to the model as a tool error: its loop cannot end one rollout), and so does every
    later tool of the episode, at once; `get_reward()` returns None, so TRL leaves the rollout
    unscored. `__cause__` is the client's error."""


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


def unreachable(target: str, timeout_s: float, probe: grpc.RpcError) -> RuntimeUnavailable | None:
    """The error of a channel that did not connect in time, or None when the probe got through."""
    code = probe.code()
    if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return None  # something answered: the channel connected after all
    cause = connect_cause(str(probe.details() or ""))
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        cause = f"no answer after {timeout_s:g} s"
    return RuntimeUnavailable(grpc.StatusCode.UNAVAILABLE, f"cannot reach {target}: {cause}", "wait_ready")

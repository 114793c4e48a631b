"""Typed errors of CodeGym calls, and the one failure table that decides what is done about each.

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
| `BAD_CHECKPOINT`    | INVALID_ARGUMENT    | `BadCheckpoint`     | never                     | no             |
| `CHECKPOINTS_OFF`   | FAILED_PRECONDITION | `CheckpointsOff`    | never                     | no             |
| `NO_HISTORY`        | FAILED_PRECONDITION | `NoHistory`         | never                     | no             |
| `CODE_GONE`         | FAILED_PRECONDITION | `CodeGone`          | never                     | no             |
| `EPISODE_NOT_FOUND` | NOT_FOUND           | `EpisodeNotFound`   | never                     | no             |

A status that came without a reason is the row its exception stands for (NOT_FOUND is
`EnvNotFound` from CreateSession and GetEnv, `SessionNotFound` elsewhere; FAILED_PRECONDITION is
`EnvFailed` from CreateSession and Reset, `SessionDone` elsewhere; DEADLINE_EXCEEDED is
`RuntimeUnavailable`), or, for a status outside the table (UNKNOWN, CANCELLED, a proxy's answer), a
`CodeGymError` with reason "": never retried, an infrastructure failure.

What a client does after a call's reply was lost (`resend`) and what a trainer adapter waits out
(`ride out`) depend on whether a CodeGym server answered: by the reason it sent (with its own
status), else by the status alone (the way to the server broke, the call's own deadline passed):

| failure                              | resend          | ride out |
|--------------------------------------|-----------------|----------|
| `UNAVAILABLE`                        | any call        | yes      |
| `OUTCOME_UNKNOWN`                    | repeatable      | yes      |
| `CAPACITY`                           | never           | yes      |
| any other reason                     | never           | no       |
| UNAVAILABLE, no reason               | repeatable      | yes      |
| DEADLINE_EXCEEDED, no reason         | repeatable late | yes      |
| CANCELLED, no reason                 | repeatable      | no       |
| RESOURCE_EXHAUSTED, no reason        | never           | yes      |
| any other status, no reason          | never           | no       |

The columns, each read from the table (`FAILURES`, `BY_STATUS`) by the code that acts on it:

- `retry` (`CodeGymError.retryable`): the same call can succeed later as it is. A server calling
  another (the runtime's dispatcher to its sandbox workers) sends again an answer whose status is
  a retryable reason's (`retryable_answer`).
- `infrastructure` (`CodeGymError.infrastructure`, `is_infrastructure`): the call failed for a
  reason that is neither the agent's nor the environment's (a runtime or worker down, full, or
  broken, or the session of an episode the caller owns lost or moved by a replica): an episode it
  ends says nothing about the policy, so a trainer must not learn from it (drop it, never score it
  0). A failure on the way, with no status from the runtime, is one too.
- `resend` (`resend.resend_kind`): sent again by the client, a short back-off later: "any call"
  (the runtime answered that nothing of it was applied), "repeatable" (only a call that may be
  sent twice: a step with its index, a create, a reset), "late" (once more after the call's own
  deadline passed, as the step may have been waiting out a dead replica's step lease), or never.
- `ride out` (`outages.clears_by_itself`): a trainer adapter sends the call again, for as long as
  the operator allows, because the failure clears by itself (codegym_client/outages.py).

The step rule (`STEP_FAULTS`), which every trainer adapter applies: an adapter's step is its own
request (the model's call, whatever it holds, is answered by the environment as an observation),
so any error a step raises once its outage was ridden out is not the model's doing: the episode
ends as the infrastructure's failure, never trained on.

Each error has `reason` (the row's name), `retryable`, `infrastructure` and `retry_after_s`, and
is also a `grpc.RpcError` with `code()`, `details()` and `trailing_metadata()`, so code written
against raw gRPC errors keeps working. The servers' side of the table is `codegym/errors.py`,
which takes the trailer names from here; a test keeps the rows equal.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import grpc

__all__ = [
    "BY_STATUS",
    "FAILURES",
    "INFRASTRUCTURE_REASONS",
    "REASONS",
    "REASON_TRAILER",
    "RETRY_AFTER_TRAILER",
    "STEP_FAULTS",
    "BadCheckpoint",
    "CapacityExceeded",
    "CheckpointsOff",
    "CodeGone",
    "CodeGymError",
    "EnvFailed",
    "EnvNotFound",
    "EpisodeEnded",
    "EpisodeFailed",
    "Failure",
    "InfrastructureFailure",
    "InvalidRequest",
    "NoHistory",
    "PermissionDenied",
    "RuntimeUnavailable",
    "SessionDone",
    "SessionNotFound",
    "StepConflict",
    "Unauthenticated",
    "access_refused",
    "failure_row",
    "is_infrastructure",
    "reason_sent",
    "refused_as_sent",
    "retryable_answer",
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
        if sent in FAILURES and FAILURES[sent].code == code:
            self.reason = sent
        elif type(self).default_reason:
            self.reason = type(self).default_reason
        else:
            self.reason = "INTERNAL" if code == grpc.StatusCode.INTERNAL else ""
        row = FAILURES.get(self.reason, OUTSIDE)  # the table's row (OUTSIDE: reason "")
        self.retryable = row.retryable
        self.infrastructure = row.infrastructure
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


class BadCheckpoint(InvalidRequest):
    """INVALID_ARGUMENT (`BAD_CHECKPOINT`) from RestoreSession: the blob is not a checkpoint this
    deployment sealed for the caller's tenant (empty, oversized, truncated, altered, sealed with a key
    the runtime does not hold, or another tenant's). Nothing was restored."""

    default_reason = "BAD_CHECKPOINT"


class CheckpointsOff(CodeGymError):
    """FAILED_PRECONDITION (`CHECKPOINTS_OFF`): the runtime has no checkpoint key, so it neither
    makes nor restores checkpoints (start it with `--checkpoint-key FILE`; `codegym up` makes one)."""

    default_reason = "CHECKPOINTS_OFF"


class NoHistory(CodeGymError):
    """FAILED_PRECONDITION (`NO_HISTORY`) from ForkSession with `at_step`: the session kept no
    history (create it with `keep_history=True`), or no longer holds that step (its history is
    bounded: the oldest entries go). Nothing was forked."""

    default_reason = "NO_HISTORY"


class CodeGone(CodeGymError):
    """FAILED_PRECONDITION (`CODE_GONE`) from RestoreSession: the checkpoint's environment code (its
    env id and sha256, named in the message) is no longer in the runtime's library."""

    default_reason = "CODE_GONE"


class EpisodeNotFound(CodeGymError):
    """NOT_FOUND (`EPISODE_NOT_FOUND`) from GetEpisode: no captured episode by that id is held for
    the caller's tenant (never captured, evicted past the runtime's byte bound, or another's)."""

    default_reason = "EPISODE_NOT_FOUND"


# -- The failure table -----------------------------------------------------------------------------

# What a client does about a failed call once its reply was lost (see the module docstring).
NEVER = "never"
ANY_CALL = "any call"  # the runtime answered that nothing of the call was applied
REPEATABLE = "repeatable"  # a call that may be sent twice: a step with its index, a create, a reset
LATE = "repeatable late"  # the same, once more after the call's own deadline passed


@dataclass(frozen=True)
class Failure:
    """One row of the failure table: a failure's status and exception, and every decision about it
    (the module docstring's columns)."""

    code: grpc.StatusCode
    error: type[CodeGymError]
    retryable: bool = False  # the same call can succeed later as it is
    infrastructure: bool = False  # neither the agent's nor the environment's: never trained on
    resend: str = NEVER  # sent again after its reply was lost: NEVER, ANY_CALL, REPEATABLE, LATE
    rides_out: bool = False  # waited out by a trainer adapter (outages.py)


_S = grpc.StatusCode
# reason → row: the one table. The servers' codegym/errors.py builds its rows (with when to retry
# and what each means) from it.
FAILURES: dict[str, Failure] = {
    "INVALID_REQUEST": Failure(_S.INVALID_ARGUMENT, InvalidRequest),
    "ENV_NOT_FOUND": Failure(_S.NOT_FOUND, EnvNotFound),
    "SESSION_NOT_FOUND": Failure(_S.NOT_FOUND, SessionNotFound, infrastructure=True),
    "SESSION_DONE": Failure(_S.FAILED_PRECONDITION, SessionDone),
    "ENV_FAILED": Failure(_S.FAILED_PRECONDITION, EnvFailed),
    "STEP_CONFLICT": Failure(_S.ABORTED, StepConflict, infrastructure=True),
    "CAPACITY": Failure(_S.RESOURCE_EXHAUSTED, CapacityExceeded, True, True, rides_out=True),
    "UNAVAILABLE": Failure(_S.UNAVAILABLE, RuntimeUnavailable, True, True, ANY_CALL, True),
    # The store failed while a step was being committed: applied or not, nobody knows. Safe to
    # resend only with the step's index (the runtime then answers from its record).
    "OUTCOME_UNKNOWN": Failure(_S.UNAVAILABLE, RuntimeUnavailable, False, True, REPEATABLE, True),
    # Access: no token or an unknown one; a known token whose role may not call this server.
    "UNAUTHENTICATED": Failure(_S.UNAUTHENTICATED, Unauthenticated),
    "PERMISSION_DENIED": Failure(_S.PERMISSION_DENIED, PermissionDenied),
    # The synthesis server's (an LLM endpoint refusing the request); no runtime call answers it.
    "UPSTREAM_REJECTED": Failure(_S.FAILED_PRECONDITION, CodeGymError),
    "INTERNAL": Failure(_S.INTERNAL, CodeGymError, infrastructure=True),
    # Forks, checkpoints and restores (docs/fork.md): the request's fault or the deployment's
    # setting, never the infrastructure's.
    "BAD_CHECKPOINT": Failure(_S.INVALID_ARGUMENT, BadCheckpoint),
    "CHECKPOINTS_OFF": Failure(_S.FAILED_PRECONDITION, CheckpointsOff),
    "NO_HISTORY": Failure(_S.FAILED_PRECONDITION, NoHistory),
    "CODE_GONE": Failure(_S.FAILED_PRECONDITION, CodeGone),
    # Captured episodes (GetEpisode).
    "EPISODE_NOT_FOUND": Failure(_S.NOT_FOUND, EpisodeNotFound),
}
# reason "": a status outside the table (UNKNOWN, a proxy's answer): not the environment's either.
OUTSIDE = Failure(_S.UNKNOWN, CodeGymError, infrastructure=True)


def _by_status(
    code: grpc.StatusCode, error: type[CodeGymError], resend: str = NEVER, rides_out: bool = False
) -> Failure:
    """A row for a status that came without a reason: retry and infrastructure are those of the
    reason its exception stands for."""
    same = FAILURES.get(error.default_reason or ("INTERNAL" if code == _S.INTERNAL else ""), OUTSIDE)
    return Failure(code, error, same.retryable, same.infrastructure, resend, rides_out)


# status → row, for a failure that carries only its status (no reason: the way to the server
# broke, the call's own deadline passed, an older server). NOT_FOUND and FAILED_PRECONDITION depend
# on the RPC too (see `error_class`).
BY_STATUS: dict[grpc.StatusCode, Failure] = {
    row.code: row
    for row in (
        _by_status(_S.UNAVAILABLE, RuntimeUnavailable, REPEATABLE, rides_out=True),
        _by_status(_S.DEADLINE_EXCEEDED, RuntimeUnavailable, LATE, rides_out=True),
        _by_status(_S.CANCELLED, CodeGymError, REPEATABLE),  # a draining replica cancelled it
        _by_status(_S.RESOURCE_EXHAUSTED, CapacityExceeded, rides_out=True),
        _by_status(_S.FAILED_PRECONDITION, SessionDone),
        _by_status(_S.ABORTED, StepConflict),
        _by_status(_S.INVALID_ARGUMENT, InvalidRequest),
        _by_status(_S.INTERNAL, CodeGymError),
        # gRPC itself answers these too (call credentials that failed), with no trailer.
        _by_status(_S.UNAUTHENTICATED, Unauthenticated),
        _by_status(_S.PERMISSION_DENIED, PermissionDenied),
    )
}

# Views of the table for code that reads one column (the servers' codegym/errors.py, verl's
# advantage estimators).
REASONS: dict[str, tuple[grpc.StatusCode, type[CodeGymError]]] = {
    name: (row.code, row.error) for name, row in FAILURES.items()
}
INFRASTRUCTURE_REASONS = frozenset(
    name for name, row in {**FAILURES, "": OUTSIDE}.items() if row.infrastructure
)


def failure_row(exc: BaseException) -> Failure | None:
    """The row that decides whether a failed call is resent or ridden out: the reason the server
    sent, when its status agrees (a reason under another status did not cause it, e.g. a proxy's);
    else the status alone. None when `exc` is not a gRPC failure."""
    if not isinstance(exc, grpc.RpcError):
        return None
    code_of = getattr(exc, "code", None)
    code = code_of() if callable(code_of) else None
    trailers_of = getattr(exc, "trailing_metadata", None)
    sent = reason_sent((trailers_of() if callable(trailers_of) else None) or ())
    row = FAILURES.get(sent) if sent else None
    if row is not None and row.code == code:
        return row
    return BY_STATUS.get(code, OUTSIDE) if isinstance(code, grpc.StatusCode) else OUTSIDE


def retryable_answer(code: grpc.StatusCode) -> bool:
    """Whether a server's answer with this status (whatever reason it sent) may succeed when the same
    call is sent again: the status of a retryable reason. What a server calling another decides by
    (the runtime's dispatcher and its sandbox workers); a status no server answers with (the
    caller's own DEADLINE_EXCEEDED) is not one."""
    return any(row.retryable and row.code == code for row in FAILURES.values())


def refused_as_sent(code: grpc.StatusCode) -> bool:
    """Whether a status says the request will never be taken as it stands (invalid, or a failed
    precondition): the pipeline records such a stage as rejected instead of trying it again."""
    row = BY_STATUS.get(code)
    return row is not None and issubclass(row.error, InvalidRequest | SessionDone)


def access_refused(exc: BaseException) -> bool:
    """Whether a call failed on its access token (none, unknown, or of a role the server refuses)."""
    row = failure_row(exc)
    return row is not None and issubclass(row.error, Unauthenticated | PermissionDenied)


# The details of the INTERNAL status grpc.aio sets on a call whose write failed in gRPC's core
# (`set_internal_error` in grpc/aio/_call.py): a write that raced the server's end of the call.
CORE_INTERNAL = "Internal error from Core"


def status_lost_in_write(exc: grpc.RpcError) -> bool:
    """Whether a streaming call's status is grpc.aio's own INTERNAL for a failed write, which
    replaces the server's status it had not read yet (no trailers: nothing came from the server).
    The server's real outcome is unknown: the call broke, nobody knows how."""
    return (exc.code(), str(exc.details() or ""), tuple(exc.trailing_metadata() or ())) == (
        grpc.StatusCode.INTERNAL,
        CORE_INTERNAL,
        (),
    )


def error_class(code: grpc.StatusCode, reason: str, method: str) -> type[CodeGymError]:
    """The exception for a status: the reason's row when the reason agrees with the status (a
    reason under another status was not this status's cause, e.g. a proxy's), else by status."""
    row = FAILURES.get(reason)
    if row is not None and row.code == code:
        return row.error
    if code == grpc.StatusCode.NOT_FOUND:
        return EnvNotFound if method in ENV_METHODS else SessionNotFound
    if code == grpc.StatusCode.FAILED_PRECONDITION and method in ENV_RESET_METHODS:
        return EnvFailed  # create and reset have no finished episode to refuse
    status = BY_STATUS.get(code)
    return CodeGymError if status is None else status.error


def is_infrastructure(exc: BaseException) -> bool:
    """Whether a call's failure is the infrastructure's (see the table): a typed error by its
    reason, any other gRPC failure (the way to the runtime broke) always."""
    if isinstance(exc, CodeGymError):
        return exc.infrastructure
    return isinstance(exc, grpc.RpcError | InfrastructureFailure)


# The step rule (see the module docstring): what a trainer adapter's step may raise once its
# outage was ridden out, every one of it the infrastructure's failure, never the model's. Every
# CodeGymError is a grpc.RpcError; a raw one is a failure on the way.
STEP_FAULTS: tuple[type[BaseException], ...] = (grpc.RpcError,)


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

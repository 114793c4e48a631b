"""The one table from an outcome to a gRPC status, and the guard every server's RPCs go through.

A trainer must tell three answers apart: "retry" (the infrastructure failed: another replica or a
moment later will do), "back off" (a capacity limit) and "this will never work" (the request, or
the environment itself, is at fault). Every refusal of every server is a `Refusal` naming a
`Reason`; the reason fixes the gRPC status and travels as the `codegym-reason` trailer, so a client
picks its exception from the reason (two reasons share FAILED_PRECONDITION, two share NOT_FOUND)
and falls back on the status code when talking to something else.

An environment's own failure is never a capacity or availability status: a config whose `reset()`
eats all memory fails the same way on every retry, so it is ENV_FAILED, not RESOURCE_EXHAUSTED.
And an infrastructure fault (a worker lost, a process killed from outside its session) is never
the environment's answer: it is retried where it happened and, when it persists, UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
from google.protobuf.message import DecodeError, Message

# The trailers' names and each reason's status and exception are the client's (the servers depend
# on the client package, never the reverse).
from codegym_client.errors import INFRASTRUCTURE_REASONS, REASON_TRAILER, REASONS, RETRY_AFTER_TRAILER

log = logging.getLogger(__name__)

# Status details travel in a trailer, and clients drop trailers past 8-16 KB: keep them short.
MAX_DETAIL_BYTES = 1024


@dataclass(frozen=True)
class Row:
    code: grpc.StatusCode
    client_error: str
    retry: str
    meaning: str


def row(name: str, retry: str, meaning: str) -> Row:
    code, error = REASONS[name]
    return Row(code, error.__name__, retry, meaning)


class Reason(enum.Enum):
    """Why a call was refused. The value is the row of the table (docs/errors.md); the status and
    the exception come from the client's table (`codegym_client.errors.REASONS`), so both sides
    read one table."""

    INVALID_REQUEST = row(
        "INVALID_REQUEST",
        "never",
        "the request cannot be served as sent",
    )
    ENV_NOT_FOUND = row("ENV_NOT_FOUND", "never", "no such environment")
    SESSION_NOT_FOUND = Row(
        grpc.StatusCode.NOT_FOUND,
        "SessionNotFound",
        "never",
        "the session is closed, expired or unknown",
    )
    SESSION_DONE = row(
        "SESSION_DONE",
        "never",
        "the episode has ended (done or truncated): Reset or open another session",
    )
    ENV_FAILED = row(
        "ENV_FAILED",
        "never",
        "the environment itself failed to start or reset with this config (raised, looped, ran out "
        "of memory): the same call fails again",
    )
    STEP_CONFLICT = row(
        "STEP_CONFLICT",
        "after resync",
        "the step's index is not the session's (another caller or replica moved it): read the "
        "session and decide",
    )
    CAPACITY = row(
        "CAPACITY",
        "after retry-after-ms",
        "a capacity limit (sessions, pending operations) is reached",
    )
    UNAVAILABLE = row(
        "UNAVAILABLE",
        "yes, at once, any replica",
        "an infrastructure fault (no worker answered, a store or replica down, draining); nothing "
        "was applied",
    )
    OUTCOME_UNKNOWN = row(
        "OUTCOME_UNKNOWN",
        "only a step sent with its step_index",
        "the session store failed while the step was being committed: it may have been applied; "
        "resent with its index, the step is answered from the record, never applied twice",
    )
    UNAUTHENTICATED = row(
        "UNAUTHENTICATED",
        "never",
        "the server takes access tokens and the call carried none it knows: set `CODEGYM_TOKEN` or `--token`",
    )
    PERMISSION_DENIED = row(
        "PERMISSION_DENIED",
        "never",
        "the access token's role may not call this server (a trainer's token at a sandbox worker)",
    )
    UPSTREAM_REJECTED = row(
        "UPSTREAM_REJECTED",
        "never",
        "the LLM endpoint refused the request (authentication, model name, quota): fix the setting",
    )
    INTERNAL = row(
        "INTERNAL",
        "never",
        "a bug in the server; the log has the traceback",
    )
    BAD_CHECKPOINT = row(
        "BAD_CHECKPOINT",
        "never",
        "the blob is not a checkpoint this deployment sealed for the caller's tenant (empty, "
        "oversized, truncated, altered, sealed with a key the runtime lacks, another tenant's)",
    )
    CHECKPOINTS_OFF = row(
        "CHECKPOINTS_OFF",
        "never",
        "the runtime has no checkpoint key: start it with `--checkpoint-key FILE`",
    )
    NO_HISTORY = row(
        "NO_HISTORY",
        "never",
        "a fork `at_step` of a session that kept no history (`keep_history`), or no longer holds that step",
    )
    CODE_GONE = row(
        "CODE_GONE",
        "never",
        "the checkpoint's environment code (env id and sha256) is no longer in the library",
    )

    EPISODE_NOT_FOUND = row(
        "EPISODE_NOT_FOUND",
        "never",
        "no captured episode by that id is held for the caller's tenant (never captured, evicted past "
        "`--capture-bytes`, or unknown)",
    )

    @property
    def code(self) -> grpc.StatusCode:
        return self.value.code


class Refusal(Exception):
    """A request a server answers with a gRPC status instead of a result."""

    def __init__(self, reason: Reason, message: str, retry_after_ms: int = 0) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.retry_after_ms = retry_after_ms

    @property
    def code(self) -> grpc.StatusCode:
        return self.reason.code


class Unavailable(Exception):
    """An infrastructure fault that outlived its retries (a store or every worker down)."""


def clipped(message: str, limit: int = MAX_DETAIL_BYTES) -> str:
    data = message.encode("utf-8", "replace")
    if len(data) <= limit:
        return message
    return data[:limit].decode("utf-8", "ignore") + f"... ({len(data)} bytes)"


def trailers(exc: Refusal) -> tuple[tuple[str, str], ...]:
    items = [(REASON_TRAILER, exc.reason.name)]
    if exc.retry_after_ms:
        items.append((RETRY_AFTER_TRAILER, str(exc.retry_after_ms)))
    return tuple(items)


async def refuse(context: grpc.aio.ServicerContext, exc: Refusal) -> NoReturn:
    context.set_trailing_metadata(trailers(exc))
    await context.abort(exc.code, clipped(exc.message))
    raise AssertionError("context.abort returned")


async def fail_internally(context: grpc.aio.ServicerContext, rpc: str) -> NoReturn:
    """The last line of defence: log the traceback, answer INTERNAL with a reference to the log line."""
    ref = secrets.token_hex(4)
    log.exception("%s failed (ref %s)", rpc, ref)
    context.set_trailing_metadata(((REASON_TRAILER, Reason.INTERNAL.name),))
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {rpc} (ref {ref}); see the server log")
    raise AssertionError("context.abort returned")


@dataclass(frozen=True)
class EntryStatus:
    """How one entry of a batch or stream failed: what a unary call would have ended with (its
    status code, message, and the trailers' reason and retry-after), carried in the entry."""

    code: int
    message: str
    reason: Reason
    retry_after_ms: int = 0


def entry_status(exc: BaseException, what: str, unavailable_retry_ms: int = 0) -> EntryStatus:
    """The status of one entry of a batch or stream that failed; `unavailable_retry_ms` is the
    retry-after an `Unavailable` gets (what `guarded` sends with it on a unary call)."""
    if isinstance(exc, Refusal):
        return EntryStatus(exc.code.value[0], clipped(exc.message), exc.reason, exc.retry_after_ms)
    if isinstance(exc, Unavailable):
        code = grpc.StatusCode.UNAVAILABLE.value[0]
        return EntryStatus(code, clipped(str(exc)), Reason.UNAVAILABLE, unavailable_retry_ms)
    ref = secrets.token_hex(4)
    log.error("%s failed (ref %s)", what, ref, exc_info=exc)
    return EntryStatus(
        grpc.StatusCode.INTERNAL.value[0],
        f"internal error in {what} (ref {ref}); see the server log",
        Reason.INTERNAL,
    )


def guarded[R](
    method: Callable[..., Awaitable[R]],
) -> Callable[..., Awaitable[R]]:
    """A unary RPC that answers every failure with a status from the table: a `Refusal` with its
    reason, an `Unavailable` as UNAVAILABLE, anything unexpected as INTERNAL (never UNKNOWN with
    Python's text). `request.reason` of an undecodable request (see `decoder`) is INVALID_ARGUMENT."""

    @functools.wraps(method)
    async def rpc(self: Any, request: Any, context: grpc.aio.ServicerContext) -> R:
        try:
            if isinstance(request, Undecodable):
                raise Refusal(Reason.INVALID_REQUEST, request.reason)
            return await method(self, request, context)
        except Refusal as exc:
            await refuse(context, exc)
        except Unavailable as exc:
            retry = int(getattr(getattr(self, "config", None), "retry_after_ms", 0) or 0)
            await refuse(context, Refusal(Reason.UNAVAILABLE, str(exc), retry))
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception:
            await fail_internally(context, method.__name__)

    return rpc


def guarded_stream[R](
    method: Callable[..., AsyncIterator[R]],
) -> Callable[..., AsyncIterator[R]]:
    """`guarded` for a server-streaming RPC: what was yielded stays sent, the failure ends the call
    with its status from the table."""

    @functools.wraps(method)
    async def rpc(self: Any, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[R]:
        try:
            if isinstance(request, Undecodable):
                raise Refusal(Reason.INVALID_REQUEST, request.reason)
            async for item in method(self, request, context):
                yield item
        except Refusal as exc:
            await refuse(context, exc)
        except Unavailable as exc:
            await refuse(context, Refusal(Reason.UNAVAILABLE, str(exc)))
        except (grpc.aio.AbortError, asyncio.CancelledError, GeneratorExit):
            raise
        except Exception:
            await fail_internally(context, method.__name__)

    return rpc


class Undecodable:
    """A request whose bytes are not its RPC's message (bad UTF-8 in a string, a corrupt wire format)."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def table_markdown() -> str:
    """The table as docs/errors.md shows it (tests/test_outcomes.py keeps the two equal)."""
    lines = [
        "| reason (`codegym-reason`) | gRPC status | client exception | retry | infrastructure | meaning |",
        "|---|---|---|---|---|---|",
    ]
    for reason in Reason:
        row = reason.value
        infrastructure = "yes" if reason.name in INFRASTRUCTURE_REASONS else "no"
        lines.append(
            f"| `{reason.name}` | `{row.code.name}` | `{row.client_error}` | {row.retry} | {infrastructure} "
            f"| {row.meaning} |"
        )
    return "\n".join(lines)


def add_lenient(servicer: Any, server: grpc.aio.Server, service: Any, messages: Any) -> None:
    """Register `servicer` for `service` (a ServiceDescriptor) like the generated
    `add_*Servicer_to_server`, except that a request whose bytes do not decode (invalid UTF-8 in a
    string, a corrupt message) reaches the servicer as `Undecodable`, which `guarded` answers
    INVALID_ARGUMENT; with the generated function gRPC answers it UNKNOWN by itself.
    `messages` is the generated `*_pb2` module holding the request and response types."""
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    for method in service.methods:
        request_type = getattr(messages, method.input_type.name)
        response_type = getattr(messages, method.output_type.name)
        if method.client_streaming and method.server_streaming:
            make = grpc.stream_stream_rpc_method_handler
        elif method.server_streaming:
            make = grpc.unary_stream_rpc_method_handler
        elif method.client_streaming:
            make = grpc.stream_unary_rpc_method_handler
        else:
            make = grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(
            getattr(servicer, method.name),
            request_deserializer=decoder(request_type),
            response_serializer=response_type.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


def decoder(message_type: type[Message]) -> Callable[[bytes], Any]:
    def decode(data: bytes) -> Any:
        try:
            return message_type.FromString(data)
        except DecodeError as exc:
            return Undecodable(f"the request is not a valid {message_type.DESCRIPTOR.name}: {exc}")

    return decode

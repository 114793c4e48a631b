"""Clients of the runtime service for trainers: `RuntimeClient` (threads) and `AsyncRuntimeClient`.

Deadlines and retries are set once, on the channel: every call gets `timeout_s`, and the channel
retries UNAVAILABLE (a replica restarting, a connection reset) except for Step and BatchStep, which
change a session and must not be applied twice.

A call the runtime refuses raises a `CodeGymError` subclass (`EnvNotFound`, `SessionNotFound`,
`SessionDone`, `CapacityExceeded`, `InvalidRequest`, `RuntimeUnavailable`); each is also a
`grpc.RpcError` with `code()`, `details()` and `trailing_metadata()`, so code written against raw
gRPC errors keeps working. Per-entry codes of `BatchStep` and `StepStream` answers stay in the
answers (`code`, `message`).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
from collections.abc import Callable, Iterable, Iterator, Sequence
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
PROBE_TIMEOUT_S = 1.0

ActionLike = str | dict[str, Any] | Action | rt.ToolCall

__all__ = [
    "DEFAULT_TARGET",
    "ActionLike",
    "AsyncRuntimeClient",
    "CapacityExceeded",
    "CodeGymError",
    "EnvNotFound",
    "InvalidRequest",
    "RuntimeClient",
    "RuntimeUnavailable",
    "SessionDone",
    "SessionNotFound",
    "StepStream",
    "create_request",
    "step_request",
]


# ---- errors ---------------------------------------------------------------------------------------


class CodeGymError(grpc.RpcError):
    """A runtime call that failed: the gRPC status (`code()`, `details()`), the RPC (`method`) and,
    when the runtime sent a `retry-after-ms` trailer, how long to wait before retrying (`retry_after_s`).
    """

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


class EnvNotFound(CodeGymError):
    """NOT_FOUND from CreateSession or GetEnv: no such environment (or env class) in the library."""


class SessionNotFound(CodeGymError):
    """NOT_FOUND from a session RPC: the session is closed, expired or was never opened."""


class SessionDone(CodeGymError):
    """FAILED_PRECONDITION: the session's episode has ended (done or truncated); Reset it or open another."""


class CapacityExceeded(CodeGymError):
    """RESOURCE_EXHAUSTED: the runtime is at its session limit (or a size or sandbox limit was hit);
    `retry_after_s` carries the runtime's hint when it sent one."""


class InvalidRequest(CodeGymError):
    """INVALID_ARGUMENT: the request cannot be served as sent (bad task, config or options)."""


class RuntimeUnavailable(CodeGymError):
    """UNAVAILABLE or DEADLINE_EXCEEDED: the runtime (or its sandbox workers) did not answer in time."""


BY_CODE: dict[grpc.StatusCode, type[CodeGymError]] = {
    grpc.StatusCode.FAILED_PRECONDITION: SessionDone,
    grpc.StatusCode.RESOURCE_EXHAUSTED: CapacityExceeded,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.UNAVAILABLE: RuntimeUnavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: RuntimeUnavailable,
}


def retry_after_s(trailers: Iterable[tuple[str, str | bytes]]) -> float | None:
    for key, value in trailers:
        if key.lower() == "retry-after-ms":
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
    trailers = (trailers_of() if callable(trailers_of) else None) or ()
    if code == grpc.StatusCode.NOT_FOUND:
        kind: type[CodeGymError] = EnvNotFound if method in ENV_METHODS else SessionNotFound
    else:
        kind = BY_CODE.get(code, CodeGymError)
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


def step_request(session_id: str, action: ActionLike) -> rt.StepRequest:
    if isinstance(action, rt.ToolCall):
        return rt.StepRequest(session_id=session_id, tool_call=action)
    if isinstance(action, Action):
        action = action.to_json()
    elif isinstance(action, dict):
        action = json.dumps(action, ensure_ascii=False)
    return rt.StepRequest(session_id=session_id, action_json=action)


class RuntimeClient:
    """Blocking client; thread-safe (one channel, many threads). Failed calls raise `CodeGymError`s."""

    def __init__(self, target: str | Sequence[str] = DEFAULT_TARGET, *, timeout_s: float = 30.0) -> None:
        self.target = target_text(target)
        self.channel = sync_channel(target, [SERVICE], no_retry=NOT_RETRIED)
        self.stub = rt_grpc.RuntimeServiceStub(self.channel)
        self.timeout_s = timeout_s

    def close(self) -> None:
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

    @raises_typed("CreateSession")
    def create_session(self, **kwargs: Any) -> rt.CreateSessionResponse:
        """See `create_request` for the arguments (ability, or env_id + config, or env_str)."""
        response: rt.CreateSessionResponse = self.stub.CreateSession(
            create_request(**kwargs), timeout=self.timeout_s
        )
        return response

    @raises_typed("Step")
    def step(self, session_id: str, action: ActionLike) -> rt.StepResponse:
        response: rt.StepResponse = self.stub.Step(step_request(session_id, action), timeout=self.timeout_s)
        return response

    @raises_typed("BatchStep")
    def batch_step(self, steps: Sequence[tuple[str, ActionLike]]) -> list[rt.BatchStepResult]:
        request = rt.BatchStepRequest(steps=[step_request(s, a) for s, a in steps])
        return list(self.stub.BatchStep(request, timeout=self.timeout_s).results)

    @raises_typed("Reset")
    def reset(self, session_id: str) -> str:
        response = self.stub.Reset(rt.ResetRequest(session_id=session_id), timeout=self.timeout_s)
        return str(response.observation)

    @raises_typed("CloseSession")
    def close_session(self, session_id: str) -> bool:
        response = self.stub.CloseSession(
            rt.CloseSessionRequest(session_id=session_id), timeout=self.timeout_s
        )
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
    """asyncio client; create it inside the running event loop. Failed calls raise `CodeGymError`s."""

    def __init__(self, target: str | Sequence[str] = DEFAULT_TARGET, *, timeout_s: float = 30.0) -> None:
        self.target = target_text(target)
        self.channel = aio_channel(target, [SERVICE], no_retry=NOT_RETRIED)
        self.stub = rt_grpc.RuntimeServiceStub(self.channel)
        self.timeout_s = timeout_s

    async def close(self) -> None:
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

    @raises_typed("CreateSession")
    async def create_session(self, **kwargs: Any) -> rt.CreateSessionResponse:
        response: rt.CreateSessionResponse = await self.stub.CreateSession(
            create_request(**kwargs), timeout=self.timeout_s
        )
        return response

    @raises_typed("Step")
    async def step(self, session_id: str, action: ActionLike) -> rt.StepResponse:
        response: rt.StepResponse = await self.stub.Step(
            step_request(session_id, action), timeout=self.timeout_s
        )
        return response

    @raises_typed("BatchStep")
    async def batch_step(self, steps: Sequence[tuple[str, ActionLike]]) -> list[rt.BatchStepResult]:
        request = rt.BatchStepRequest(steps=[step_request(s, a) for s, a in steps])
        response = await self.stub.BatchStep(request, timeout=self.timeout_s)
        return list(response.results)

    def step_stream(self) -> StepStream:
        """One StepStream call: `send` steps of any sessions, `recv` answers as they complete."""
        return StepStream(self.stub.StepStream(timeout=None))

    @raises_typed("Reset")
    async def reset(self, session_id: str) -> str:
        response = await self.stub.Reset(rt.ResetRequest(session_id=session_id), timeout=self.timeout_s)
        return str(response.observation)

    @raises_typed("CloseSession")
    async def close_session(self, session_id: str) -> bool:
        response = await self.stub.CloseSession(
            rt.CloseSessionRequest(session_id=session_id), timeout=self.timeout_s
        )
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
    """

    def __init__(self, call: Any) -> None:
        self.call = call
        # gRPC takes one write at a time on a call; concurrent senders queue here.
        self.writing = asyncio.Lock()

    @raises_typed("StepStream")
    async def send(self, session_id: str, action: ActionLike, tag: str = "") -> None:
        async with self.writing:
            await self.call.write(rt.StepStreamRequest(step=step_request(session_id, action), tag=tag))

    @raises_typed("StepStream")
    async def recv(self) -> rt.StepStreamResponse | None:
        answer = await self.call.read()
        if answer is grpc.aio.EOF:
            return None
        return cast(rt.StepStreamResponse, answer)

    @raises_typed("StepStream")
    async def done_sending(self) -> None:
        await self.call.done_writing()

    def cancel(self) -> None:
        self.call.cancel()

"""`AsyncRuntimeClient`, the asyncio client of the runtime service, and `StepStream`.

The same resending and typed errors as `RuntimeClient` (`codegym_client.runtime_client`). Its
`step` goes over a few `StepStream` calls the client shares between all its sessions
(`codegym_client.step_streams`: the runtime spends about half the CPU on a step sent that way),
answered, typed and resent exactly as a unary `Step` is; `step_transport="unary"` sends one call
per step instead. `StepStream` is the raw call, for a caller that manages one itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

import grpc

from codegym_client.api.runtime.v1 import runtime_service_pb2 as rt
from codegym_client.api.runtime.v1 import runtime_service_pb2_grpc as rt_grpc
from codegym_client.channels import (
    HEALTH_CHECK,
    HEALTH_REQUEST,
    PROBE_TIMEOUT_S,
    Access,
    aio_channel,
    target_text,
)
from codegym_client.errors import SessionNotFound, typed_error
from codegym_client.requests import (
    DEFAULT_TARGET,
    NOT_RETRIED,
    SERVICE,
    ActionLike,
    checkpoint_request,
    create_request,
    fork_request,
    restore_request,
    sample_request,
    step_request,
)
from codegym_client.resend import (
    DEFAULT_ATTEMPTS,
    Attempts,
    PendingBatch,
    StepIndexes,
    resend_kind,
    step_requests,
)
from codegym_client.step_streams import STREAMS, StepStreams
from codegym_client.typed_calls import raises_typed, unreachable

__all__ = ["STEP_TRANSPORTS", "AsyncRuntimeClient", "StepStream"]

# How `step` reaches the runtime: over the client's shared StepStream calls, or one call per step.
STEP_TRANSPORTS = ("stream", "unary")

R = TypeVar("R")


class AsyncRuntimeClient:
    """asyncio client; create it inside the running event loop. Failed calls raise `CodeGymError`s.

    Same resending and access as `RuntimeClient` (`timeout_s` per send, `attempts` sends at most;
    `token` and `tls_ca`, else `CODEGYM_TOKEN` and `CODEGYM_TLS_CA`). `interceptors` see every call
    (a front end adds metadata to its own calls: the OpenEnv gateway names its caller's tenant).

    `step_transport`: "stream" (the default without interceptors) sends `step` over at most
    `step_streams` StepStream calls shared by every session of this client (see
    `codegym_client.step_streams`); "unary" (the default with interceptors: a shared stream carries
    the metadata of the call that opened it, not each step's) sends one `Step` call per step. Both
    answer, raise and resend alike.
    """

    def __init__(
        self,
        target: str | Sequence[str] = DEFAULT_TARGET,
        *,
        timeout_s: float = 30.0,
        attempts: int = DEFAULT_ATTEMPTS,
        token: str | None = None,
        tls_ca: str | Path | None = None,
        access: Access | None = None,
        interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
        step_transport: str | None = None,
        step_streams: int = STREAMS,
    ) -> None:
        transport = step_transport or ("unary" if interceptors else "stream")
        if transport not in STEP_TRANSPORTS:
            raise ValueError(f"step_transport must be one of {', '.join(STEP_TRANSPORTS)}, not {transport!r}")
        if step_streams < 1:
            raise ValueError(f"step_streams must be at least 1, not {step_streams}")
        self.target = target_text(target)
        access = access or Access.from_env(token, tls_ca)
        self.channel = aio_channel(
            target, [SERVICE], no_retry=NOT_RETRIED, access=access, interceptors=interceptors
        )
        self.stub = rt_grpc.RuntimeServiceStub(self.channel)
        self.timeout_s = timeout_s
        self.attempts = max(1, attempts)
        self.indexes = StepIndexes()
        self.step_transport = transport
        self.streams = StepStreams(lambda: self.stub.StepStream(timeout=None), step_streams)
        self._closed = False

    async def close(self) -> None:
        """Close the channel; steps in flight on the shared streams fail CANCELLED, and no task of
        the client is left running."""
        self._closed = True
        await self.streams.close()
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
        self.indexes.created(response)
        return response

    @raises_typed("Step")
    async def step(
        self, session_id: str, action: ActionLike, *, step_index: int | None = None
    ) -> rt.StepResponse:
        """One step; see `RuntimeClient.step`."""
        async with self.indexes.holding_async((session_id,)):
            deadline = self.indexes.deadline((session_id,), self.timeout_s)
            request, numbered = step_requests(session_id, action, step_index, self.indexes)
            stream = self.step_transport == "stream"

            def send(first: bool) -> Awaitable[rt.StepResponse]:
                sent = request if first else numbered
                return self.streams.step(sent, deadline) if stream else self.stub.Step(sent, timeout=deadline)

            try:
                response = await self._send("Step", send, repeatable=numbered.HasField("step_index"))
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
            deadline = self.indexes.deadline(ids, self.timeout_s)
            batch = PendingBatch(steps, self.indexes, self.attempts)
            while True:
                try:
                    answer = await self.stub.BatchStep(batch.request(), timeout=deadline)
                except grpc.RpcError as exc:
                    delay = batch.after_error(exc, self._closed)
                else:
                    delay = batch.after_answer(answer, self._closed)
                if delay is None:
                    return batch.finish(self.indexes)
                await asyncio.sleep(delay)

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

    @raises_typed("Stats")
    async def stats(
        self, run_id: str = "", *, env_prefix: str = "", envs_only: bool = False, played_only: bool = False
    ) -> list[rt.StatsResponse]:
        """The runtime's record of served episodes: each task (unless `envs_only`), then each env."""
        request = rt.StatsRequest(
            run_id=run_id, env_prefix=env_prefix, envs_only=envs_only, played_only=played_only
        )
        return [entry async for entry in self.stub.Stats(request, timeout=max(self.timeout_s, 300.0))]

    @raises_typed("SampleTasks")
    async def sample_tasks(self, run_id: str, n: int, **options: Any) -> rt.SampleTasksResponse:
        """`n` task configurations chosen for the run (see `sample_request` for `options`)."""
        request = sample_request(run_id, n, **options)
        response: rt.SampleTasksResponse = await self._send(
            "SampleTasks",
            lambda _: self.stub.SampleTasks(request, timeout=max(self.timeout_s, 60.0)),
            repeatable=True,
        )
        return response

    @raises_typed("LiftQuarantine")
    async def lift_quarantine(self, env_id: str) -> bool:
        """Let a quarantined environment be sampled again; whether it was quarantined."""
        response = await self.stub.LiftQuarantine(
            rt.LiftQuarantineRequest(env_id=env_id), timeout=self.timeout_s
        )
        return bool(response.lifted)

    @raises_typed("ForkSession")
    async def fork_session(
        self,
        session_id: str,
        count: int = 1,
        at_step: int | None = None,
        reseed: bool = False,
        *,
        request_id: str = "",
    ) -> list[rt.ForkedSession]:
        """See `RuntimeClient.fork_session`."""
        request = fork_request(session_id, count, at_step, reseed, request_id)
        response: rt.ForkSessionResponse = await self._send(
            "ForkSession",
            lambda _: self.stub.ForkSession(request, timeout=self.timeout_s),
            repeatable=True,
        )
        for fork in response.sessions:
            self.indexes.made(fork)
        return list(response.sessions)

    @raises_typed("CheckpointSession")
    async def checkpoint_session(
        self, session_id: str, close: bool = False, *, request_id: str = ""
    ) -> bytes:
        """See `RuntimeClient.checkpoint_session`."""
        request = checkpoint_request(session_id, close, request_id)
        response: rt.CheckpointSessionResponse = await self._send(
            "CheckpointSession",
            lambda _: self.stub.CheckpointSession(request, timeout=self.timeout_s),
            repeatable=True,
        )
        if close:
            self.indexes.forget(session_id)
        return bytes(response.checkpoint)

    @raises_typed("RestoreSession")
    async def restore_session(self, blob: bytes, *, request_id: str = "") -> rt.ForkedSession:
        """See `RuntimeClient.restore_session`."""
        request = restore_request(blob, request_id)
        response: rt.RestoreSessionResponse = await self._send(
            "RestoreSession",
            lambda _: self.stub.RestoreSession(request, timeout=self.timeout_s),
            repeatable=True,
        )
        self.indexes.made(response.session)
        return response.session

    @raises_typed("RunHistory")
    async def run_history(self, run_id: str = "") -> list[rt.RunHistoryPoint]:
        """The run's played tasks by pool at each policy version it reached, oldest first."""
        response = await self.stub.RunHistory(rt.RunHistoryRequest(run_id=run_id), timeout=self.timeout_s)
        return list(response.points)


class StepStream:
    """A trainer's side of `StepStream`: many sessions' steps over one call, answered as they finish.

    Answers carry the session id and the tag given to `send`; steps of one session apply in the
    order they were sent. A step the runtime refuses (e.g. an unknown session) is an answer with a
    gRPC status `code` and `message`, and the `reason` and `retry_after_ms` a unary Step's trailers
    would carry, not an exception; only the call itself failing raises a `CodeGymError`.
    `done_sending()` ends the request side; `recv()` returns None once every answer has arrived.
    (`AsyncRuntimeClient.step` sends over such calls itself, and raises as a unary Step would.)

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

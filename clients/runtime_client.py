"""Clients of the runtime service for trainers: `RuntimeClient` (threads) and `AsyncRuntimeClient`.

Deadlines and retries are set once, on the channel: every call gets `timeout_s`, and the channel
retries UNAVAILABLE (a replica restarting, a connection reset) except for Step and BatchStep, which
change a session and must not be applied twice.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator, Sequence
from typing import Any

import grpc

from clients.actions import Action
from codegym.grpcutil import aio_channel, sync_channel
from codegym.runtime.v1 import runtime_service_pb2 as rt
from codegym.runtime.v1 import runtime_service_pb2_grpc as rt_grpc

SERVICE = rt.DESCRIPTOR.services_by_name["RuntimeService"].full_name
NOT_RETRIED = [(SERVICE, "Step"), (SERVICE, "BatchStep")]
DEFAULT_TARGET = "127.0.0.1:50051"

ActionLike = str | dict[str, Any] | Action | rt.ToolCall


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
    """Blocking client; thread-safe (one channel, many threads)."""

    def __init__(self, target: str | Sequence[str] = DEFAULT_TARGET, *, timeout_s: float = 30.0) -> None:
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
        grpc.channel_ready_future(self.channel).result(timeout=timeout_s)

    def create_session(self, **kwargs: Any) -> rt.CreateSessionResponse:
        """See `create_request` for the arguments (ability, or env_id + config, or env_str)."""
        response: rt.CreateSessionResponse = self.stub.CreateSession(
            create_request(**kwargs), timeout=self.timeout_s
        )
        return response

    def step(self, session_id: str, action: ActionLike) -> rt.StepResponse:
        response: rt.StepResponse = self.stub.Step(step_request(session_id, action), timeout=self.timeout_s)
        return response

    def batch_step(self, steps: Sequence[tuple[str, ActionLike]]) -> list[rt.BatchStepResult]:
        request = rt.BatchStepRequest(steps=[step_request(s, a) for s, a in steps])
        return list(self.stub.BatchStep(request, timeout=self.timeout_s).results)

    def reset(self, session_id: str) -> str:
        response = self.stub.Reset(rt.ResetRequest(session_id=session_id), timeout=self.timeout_s)
        return str(response.observation)

    def close_session(self, session_id: str) -> bool:
        response = self.stub.CloseSession(
            rt.CloseSessionRequest(session_id=session_id), timeout=self.timeout_s
        )
        return bool(response.existed)

    def get_session(self, session_id: str) -> rt.GetSessionResponse:
        response: rt.GetSessionResponse = self.stub.GetSession(
            rt.GetSessionRequest(session_id=session_id), timeout=self.timeout_s
        )
        return response

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

    def get_env(self, env_id: str) -> rt.GetEnvResponse:
        response: rt.GetEnvResponse = self.stub.GetEnv(
            rt.GetEnvRequest(env_id=env_id), timeout=self.timeout_s
        )
        return response


class AsyncRuntimeClient:
    """asyncio client; create it inside the running event loop."""

    def __init__(self, target: str | Sequence[str] = DEFAULT_TARGET, *, timeout_s: float = 30.0) -> None:
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
        import asyncio

        await asyncio.wait_for(self.channel.channel_ready(), timeout_s)

    async def create_session(self, **kwargs: Any) -> rt.CreateSessionResponse:
        response: rt.CreateSessionResponse = await self.stub.CreateSession(
            create_request(**kwargs), timeout=self.timeout_s
        )
        return response

    async def step(self, session_id: str, action: ActionLike) -> rt.StepResponse:
        response: rt.StepResponse = await self.stub.Step(
            step_request(session_id, action), timeout=self.timeout_s
        )
        return response

    async def batch_step(self, steps: Sequence[tuple[str, ActionLike]]) -> list[rt.BatchStepResult]:
        request = rt.BatchStepRequest(steps=[step_request(s, a) for s, a in steps])
        response = await self.stub.BatchStep(request, timeout=self.timeout_s)
        return list(response.results)

    def step_stream(self) -> StepStream:
        """One StepStream call: `send` steps of any sessions, `recv` answers as they complete."""
        return StepStream(self.stub.StepStream(timeout=None))

    async def reset(self, session_id: str) -> str:
        response = await self.stub.Reset(rt.ResetRequest(session_id=session_id), timeout=self.timeout_s)
        return str(response.observation)

    async def close_session(self, session_id: str) -> bool:
        response = await self.stub.CloseSession(
            rt.CloseSessionRequest(session_id=session_id), timeout=self.timeout_s
        )
        return bool(response.existed)

    async def get_session(self, session_id: str) -> rt.GetSessionResponse:
        response: rt.GetSessionResponse = await self.stub.GetSession(
            rt.GetSessionRequest(session_id=session_id), timeout=self.timeout_s
        )
        return response

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

    async def get_env(self, env_id: str) -> rt.GetEnvResponse:
        response: rt.GetEnvResponse = await self.stub.GetEnv(
            rt.GetEnvRequest(env_id=env_id), timeout=self.timeout_s
        )
        return response


class StepStream:
    """A trainer's side of `StepStream`: many sessions' steps over one call, answered as they finish.

    Answers carry the session id and the tag given to `send`; steps of one session apply in the
    order they were sent. `done_sending()` ends the request side; `recv()` returns None once every
    answer has arrived.
    """

    def __init__(self, call: Any) -> None:
        self.call = call
        # gRPC takes one write at a time on a call; concurrent senders queue here.
        self.writing = asyncio.Lock()

    async def send(self, session_id: str, action: ActionLike, tag: str = "") -> None:
        async with self.writing:
            await self.call.write(rt.StepStreamRequest(step=step_request(session_id, action), tag=tag))

    async def recv(self) -> rt.StepStreamResponse | None:
        answer = await self.call.read()
        if answer is grpc.aio.EOF:
            return None
        return answer

    async def done_sending(self) -> None:
        await self.call.done_writing()

    def cancel(self) -> None:
        self.call.cancel()

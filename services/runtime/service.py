"""The `codegym.runtime.v1.RuntimeService` servicer: sessions over stateless sandbox workers.

The trusted side never runs environment code: actions are checked statically against the tool
names the contract checker read from the source, then sent with the session's committed state to
a sandbox worker. The returned state is committed only when the step succeeded (trial then commit),
so an error, a timeout or a lost worker leaves the session exactly as it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc

from codegym.common.v1 import common_pb2
from codegym.contract import EnvStringError, parse_ability, parse_config, parse_env_str
from codegym.runtime.v1 import runtime_service_pb2 as rt
from codegym.runtime.v1 import runtime_service_pb2_grpc as rt_grpc
from codegym.sandbox.v1 import sandbox_service_pb2 as sb
from codegym.sandbox_client import SandboxDispatcher, SandboxUnavailable
from services.runtime.library import EnvRecord
from services.runtime.sessions import Session, SessionStore

log = logging.getLogger(__name__)

DIFFICULTY = {
    "easy": common_pb2.DIFFICULTY_EASY,
    "medium": common_pb2.DIFFICULTY_MEDIUM,
    "hard": common_pb2.DIFFICULTY_HARD,
}
LIMIT_STATUSES = (sb.STATUS_MEMORY_LIMIT, sb.STATUS_OUTPUT_LIMIT, sb.STATUS_KILLED, sb.STATUS_CRASHED)


@dataclass(frozen=True)
class RuntimeConfig:
    max_sessions: int = 50_000
    session_ttl_s: float = 30 * 60
    default_max_steps: int = 256
    max_max_steps: int = 4096
    step_timeout_ms: int = 5_000
    max_step_timeout_ms: int = 60_000
    create_timeout_ms: int = 10_000
    max_action_bytes: int = 64 * 1024
    max_batch: int = 1024
    retry_after_ms: int = 1_000


class Refusal(Exception):
    """A request the runtime answers with a gRPC status instead of a result."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_ms: int = 0) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_ms = retry_after_ms


def tool_specs(record: EnvRecord) -> list[common_pb2.ToolSpec]:
    return [
        common_pb2.ToolSpec(name=t.name, signature=t.signature, text=t.text, json_schema=json.dumps(t.schema))
        for t in record.tools
    ]


def session_seed(session_id: str) -> int:
    return int.from_bytes(hashlib.sha256(session_id.encode()).digest()[:8], "big") >> 1


class RuntimeServicer(rt_grpc.RuntimeServiceServicer):
    def __init__(
        self,
        envs: dict[str, EnvRecord],
        store: SessionStore,
        dispatcher: SandboxDispatcher,
        config: RuntimeConfig | None = None,
    ) -> None:
        self.envs = envs
        self.by_class: dict[str, list[str]] = {}
        for env_id, record in envs.items():
            self.by_class.setdefault(record.env_class, []).append(env_id)
        self.sorted_ids = sorted(envs)
        self.store = store
        self.dispatcher = dispatcher
        self.config = config or RuntimeConfig()
        self.locks: dict[str, asyncio.Lock] = {}
        self.releases: set[asyncio.Task[None]] = set()

    # ---- helpers ------------------------------------------------------------------------------

    async def _guard(self, context: grpc.aio.ServicerContext, call: Any) -> Any:
        try:
            return await call
        except Refusal as exc:
            if exc.retry_after_ms:
                context.set_trailing_metadata((("retry-after-ms", str(exc.retry_after_ms)),))
            await context.abort(exc.code, exc.message)

    def _env(self, env_id: str) -> EnvRecord:
        record = self.envs.get(env_id)
        if record is None:
            raise Refusal(
                grpc.StatusCode.NOT_FOUND,
                f"environment {env_id!r} is not in the library ({len(self.envs)} environments; see ListEnvs)",
            )
        return record

    def _resolve_task(self, request: rt.CreateSessionRequest) -> tuple[EnvRecord, dict[str, Any]]:
        which = request.WhichOneof("task")
        try:
            if which == "ability":
                ability = parse_ability(request.ability)
                return self._env(ability.env_id), ability.config
            if which == "env_task":
                task = request.env_task
                if task.env_str:
                    parsed = parse_env_str(task.env_str)
                    if task.env_id and task.env_id not in (parsed.env_class,):
                        if not task.env_id.endswith("__" + parsed.env_class):
                            raise Refusal(
                                grpc.StatusCode.INVALID_ARGUMENT,
                                f"env string names {parsed.env_class}, which is not env {task.env_id}",
                            )
                        return self._env(task.env_id), parsed.config
                    return self._env_by_class(parsed.env_class), parsed.config
                if not task.env_id:
                    raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, "env_task needs env_id (or env_str)")
                return self._env(task.env_id), parse_config(task.config_json or "{}")
        except EnvStringError as exc:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"bad task: {exc}") from None
        raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, "name the task with ability or env_task")

    def _env_by_class(self, env_class: str) -> EnvRecord:
        ids = self.by_class.get(env_class, [])
        if len(ids) > 1:
            raise Refusal(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{env_class} is ambiguous ({', '.join(ids[:5])}); give env_id as {{code_id}}__{env_class}",
            )
        if not ids:
            raise Refusal(grpc.StatusCode.NOT_FOUND, f"no environment class {env_class!r} in the library")
        return self.envs[ids[0]]

    async def _session(self, session_id: str) -> Session:
        session = await self.store.get(session_id)
        if session is not None and time.monotonic() - session.last_used > self.config.session_ttl_s:
            await self._forget(session_id)
            session = None
        if session is None:
            raise Refusal(
                grpc.StatusCode.NOT_FOUND, f"no session {session_id!r} (closed, expired or unknown)"
            )
        return session

    async def _forget(self, session_id: str) -> bool:
        self.locks.pop(session_id, None)
        existed = await self.store.delete(session_id)
        if existed:
            self._release(session_id)
        return existed

    def _release(self, session_id: str) -> None:
        """Free the session's resident process on its worker, without making the caller wait."""
        task = asyncio.get_running_loop().create_task(self.dispatcher.release(session_id))
        self.releases.add(task)
        task.add_done_callback(self.releases.discard)

    def _lock(self, session_id: str) -> asyncio.Lock:
        lock = self.locks.get(session_id)
        if lock is None:
            lock = self.locks[session_id] = asyncio.Lock()
        return lock

    async def _execute(self, op: sb.Operation, record: EnvRecord, key: str = "") -> sb.OperationResult:
        try:
            return await self.dispatcher.execute(op, record.source, key)
        except SandboxUnavailable as exc:
            raise Refusal(grpc.StatusCode.UNAVAILABLE, str(exc), self.config.retry_after_ms) from None
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                result = sb.OperationResult(
                    status=sb.STATUS_TIMEOUT, message="no sandbox worker answered in time"
                )
                return result
            log.error("sandbox call failed: %s %s", exc.code().name, exc.details())
            raise Refusal(grpc.StatusCode.INTERNAL, f"sandbox call failed: {exc.details()}") from None

    @staticmethod
    def _refusal_from(result: sb.OperationResult, what: str) -> Refusal:
        detail = result.message or sb.Status.Name(result.status)
        if result.status in (sb.STATUS_ENV_ERROR, sb.STATUS_BAD_REQUEST):
            return Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: the environment failed: {detail}")
        if result.status == sb.STATUS_TIMEOUT:
            return Refusal(grpc.StatusCode.DEADLINE_EXCEEDED, f"{what}: timed out in the sandbox: {detail}")
        return Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{what}: sandbox limit: {detail}")

    # ---- sessions -----------------------------------------------------------------------------

    async def _create(self, request: rt.CreateSessionRequest) -> rt.CreateSessionResponse:
        record, config = self._resolve_task(request)
        options = request.options
        max_steps = options.max_steps or self.config.default_max_steps
        if max_steps > self.config.max_max_steps:
            raise Refusal(
                grpc.StatusCode.INVALID_ARGUMENT, f"max_steps {max_steps} exceeds {self.config.max_max_steps}"
            )
        timeout_ms = options.step_timeout_ms or self.config.step_timeout_ms
        if timeout_ms > self.config.max_step_timeout_ms:
            raise Refusal(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"step_timeout_ms {timeout_ms} exceeds {self.config.max_step_timeout_ms}",
            )
        if await self.store.count() >= self.config.max_sessions:
            await self._expire()
            if await self.store.count() >= self.config.max_sessions:
                raise Refusal(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"session limit reached ({self.config.max_sessions} open); close finished sessions or retry",
                    self.config.retry_after_ms,
                )
        session_id = secrets.token_hex(16)
        seed = options.seed or session_seed(session_id)
        config_json = json.dumps(config, ensure_ascii=False)
        op = sb.Operation(
            source=sb.SourceRef(sha256=record.sha256),
            limits=sb.Limits(wall_ms=self.config.create_timeout_ms),
            seed=seed,
            create=sb.CreateOp(config_json=config_json, session_key=session_id),
        )
        result = await self._execute(op, record, session_id)
        if result.status != sb.STATUS_OK:
            raise self._refusal_from(result, f"creating {record.env_id}")
        session = Session(
            session_id=session_id,
            env_id=record.env_id,
            config_json=config_json,
            state=result.state,
            max_steps=max_steps,
            step_timeout_ms=timeout_ms,
            seed=seed,
        )
        session.touch()
        await self.store.put(session)
        return rt.CreateSessionResponse(
            session_id=session_id,
            observation=result.observation,
            tools=tool_specs(record),
            tools_text=record.tools_text,
            task_text=record.task_text,
            env_id=record.env_id,
            max_steps=max_steps,
        )

    def _action(self, request: rt.StepRequest, record: EnvRecord) -> tuple[str, rt.StepError | None]:
        """The action as the canonical CodeGym JSON string, or the typed reason it is refused."""

        def invalid(message: str) -> tuple[str, rt.StepError]:
            return "", rt.StepError(code=rt.STEP_ERROR_CODE_INVALID_ACTION, message=message)

        which = request.WhichOneof("action")
        if which == "action_json":
            text = request.action_json
            if len(text.encode()) > self.config.max_action_bytes:
                return invalid(f"action is {len(text.encode())} bytes (max {self.config.max_action_bytes})")
            try:
                action = json.loads(text)
            except ValueError as exc:
                return invalid(f"action is not valid JSON: {exc}")
            if isinstance(action, list):
                if len(action) != 1:
                    return invalid(f"one function call per step, got a list of {len(action)}")
                action = action[0]
            if not isinstance(action, dict) or not isinstance(action.get("name"), str):
                return invalid('action must be a JSON object {"name": ..., "parameters": {...}}')
            name, parameters = action["name"], action.get("parameters", {})
        elif which == "tool_call":
            name = request.tool_call.name
            text = request.tool_call.parameters_json or "{}"
            if len(text.encode()) > self.config.max_action_bytes:
                return invalid(
                    f"parameters are {len(text.encode())} bytes (max {self.config.max_action_bytes})"
                )
            try:
                parameters = json.loads(text)
            except ValueError as exc:
                return invalid(f"parameters_json is not valid JSON: {exc}")
        else:
            return invalid("the step has no action (action_json or tool_call)")
        if parameters is None:
            parameters = {}
        if not isinstance(parameters, dict):
            return invalid(f"parameters must be a JSON object, got {type(parameters).__name__}")
        if name not in record.tool_names:
            return "", rt.StepError(
                code=rt.STEP_ERROR_CODE_UNKNOWN_TOOL,
                message=f"unknown tool {name!r}; the tools are {', '.join(record.tool_names)}",
            )
        return json.dumps({"name": name, "parameters": parameters}, ensure_ascii=False), None

    async def _step(self, request: rt.StepRequest) -> rt.StepResponse:
        session_id = request.session_id
        await self._session(session_id)
        async with self._lock(session_id):
            # Re-read under the lock: the step before this one may have changed or ended the session.
            session = await self._session(session_id)
            if session.done:
                ended = "truncated at max steps" if session.truncated else "done"
                raise Refusal(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"session {session_id} is {ended} after {session.step_index} steps; Reset it or open a new one",
                )
            record = self._env(session.env_id)
            action, error = self._action(request, record)
            if error is None:
                op = sb.Operation(
                    source=sb.SourceRef(sha256=record.sha256),
                    limits=sb.Limits(wall_ms=session.step_timeout_ms),
                    seed=(session.seed + session.step_index + 1) % (1 << 63),
                    step=sb.StepOp(state=session.state, action=action, session_key=session_id),
                )
                result = await self._execute(op, record, session_id)
                error = self._step_error(result)
                if await self.store.get(session_id) is None:
                    # Closed (or expired) while the step ran: do not bring it back.
                    raise Refusal(
                        grpc.StatusCode.NOT_FOUND, f"session {session_id} was closed during the step"
                    )
            session.touch()
            if error is not None:
                await self.store.put(session)
                return rt.StepResponse(
                    observation=error.message,
                    reward=session.reward,
                    step_index=session.step_index,
                    error=error,
                )
            session.state = result.state
            session.step_index += 1
            session.reward = result.reward
            session.done = result.done
            if not session.done and session.step_index >= session.max_steps:
                session.done = session.truncated = True
            await self.store.put(session)
            return rt.StepResponse(
                observation=result.observation,
                reward=session.reward,
                done=session.done,
                truncated=session.truncated,
                step_index=session.step_index,
            )

    @staticmethod
    def _step_error(result: sb.OperationResult) -> rt.StepError | None:
        status = result.status
        if status == sb.STATUS_OK:
            return None
        detail = result.message or sb.Status.Name(status)
        if status == sb.STATUS_TIMEOUT:
            return rt.StepError(code=rt.STEP_ERROR_CODE_STEP_TIMEOUT, message=f"step timed out: {detail}")
        if status in LIMIT_STATUSES:
            name = sb.Status.Name(status).removeprefix("STATUS_").lower()
            return rt.StepError(code=rt.STEP_ERROR_CODE_SANDBOX_LIMIT, message=f"sandbox {name}: {detail}")
        return rt.StepError(code=rt.STEP_ERROR_CODE_ENV_ERROR, message=f"environment error: {detail}")

    async def _reset(self, request: rt.ResetRequest) -> rt.ResetResponse:
        await self._session(request.session_id)
        async with self._lock(request.session_id):
            session = await self._session(request.session_id)
            record = self._env(session.env_id)
            op = sb.Operation(
                source=sb.SourceRef(sha256=record.sha256),
                limits=sb.Limits(wall_ms=self.config.create_timeout_ms),
                seed=session.seed,
                reset=sb.ResetOp(state=session.state, config_json=session.config_json),
            )
            result = await self._execute(op, record, request.session_id)
            if result.status != sb.STATUS_OK:
                raise self._refusal_from(result, f"resetting {session.env_id}")
            if await self.store.get(request.session_id) is None:
                raise Refusal(
                    grpc.StatusCode.NOT_FOUND, f"session {request.session_id} was closed during the reset"
                )
            session.state = result.state
            session.step_index = 0
            session.reward = 0.0
            session.done = session.truncated = False
            session.touch()
            await self.store.put(session)
            return rt.ResetResponse(observation=result.observation)

    async def _expire(self) -> None:
        for session_id in await self.store.expire(self.config.session_ttl_s):
            self.locks.pop(session_id, None)
            self._release(session_id)

    async def reaper(self) -> None:
        """Drop idle sessions periodically (and lazily on access, see `_session`)."""
        interval = max(0.05, min(self.config.session_ttl_s / 4, 10.0))
        while True:
            await asyncio.sleep(interval)
            with contextlib.suppress(Exception):
                await self._expire()

    # ---- RPCs ---------------------------------------------------------------------------------

    async def CreateSession(
        self, request: rt.CreateSessionRequest, context: grpc.aio.ServicerContext
    ) -> rt.CreateSessionResponse:
        response: rt.CreateSessionResponse = await self._guard(context, self._create(request))
        return response

    async def Step(self, request: rt.StepRequest, context: grpc.aio.ServicerContext) -> rt.StepResponse:
        response: rt.StepResponse = await self._guard(context, self._step(request))
        return response

    async def BatchStep(
        self, request: rt.BatchStepRequest, context: grpc.aio.ServicerContext
    ) -> rt.BatchStepResponse:
        steps = request.steps
        if len(steps) > self.config.max_batch:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"batch of {len(steps)} steps (max {self.config.max_batch})"
            )
        ids = [s.session_id for s in steps]
        if len(set(ids)) != len(ids):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "a batch must name distinct sessions (one step per session)"
            )

        async def one(step: rt.StepRequest) -> rt.BatchStepResult:
            try:
                return rt.BatchStepResult(session_id=step.session_id, response=await self._step(step))
            except Refusal as exc:
                return rt.BatchStepResult(
                    session_id=step.session_id, code=exc.code.value[0], message=exc.message
                )

        return rt.BatchStepResponse(results=await asyncio.gather(*(one(s) for s in steps)))

    async def StepStream(
        self, request_iterator: AsyncIterator[rt.StepStreamRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[rt.StepStreamResponse]:
        """Run every step sent as it arrives (at most `max_batch` at once) and answer each when done."""
        answers: asyncio.Queue[rt.StepStreamResponse | None] = asyncio.Queue()
        slots = asyncio.Semaphore(self.config.max_batch)
        running: set[asyncio.Task[None]] = set()
        latest: dict[str, asyncio.Task[None]] = {}

        async def one(item: rt.StepStreamRequest, before: asyncio.Task[None] | None) -> None:
            if before is not None:
                await asyncio.wait([before])  # this session's earlier step first
            try:
                answer = rt.StepStreamResponse(
                    session_id=item.step.session_id, tag=item.tag, response=await self._step(item.step)
                )
            except Refusal as exc:
                answer = rt.StepStreamResponse(
                    session_id=item.step.session_id, tag=item.tag, code=exc.code.value[0], message=exc.message
                )
            finally:
                slots.release()
            await answers.put(answer)

        def forget(task: asyncio.Task[None]) -> None:
            for sid, last in list(latest.items()):
                if last is task:
                    del latest[sid]

        async def read() -> None:
            try:
                async for item in request_iterator:
                    await slots.acquire()
                    sid = item.step.session_id
                    task = asyncio.get_running_loop().create_task(one(item, latest.get(sid)))
                    latest[sid] = task
                    running.add(task)
                    task.add_done_callback(running.discard)
                    task.add_done_callback(forget)
                await asyncio.gather(*list(running))
            finally:
                await answers.put(None)

        reader = asyncio.get_running_loop().create_task(read())
        try:
            while (answer := await answers.get()) is not None:
                yield answer
            await reader
        finally:
            reader.cancel()
            for task in list(running):
                task.cancel()

    async def Reset(self, request: rt.ResetRequest, context: grpc.aio.ServicerContext) -> rt.ResetResponse:
        response: rt.ResetResponse = await self._guard(context, self._reset(request))
        return response

    async def CloseSession(
        self, request: rt.CloseSessionRequest, context: grpc.aio.ServicerContext
    ) -> rt.CloseSessionResponse:
        return rt.CloseSessionResponse(existed=await self._forget(request.session_id))

    async def GetSession(
        self, request: rt.GetSessionRequest, context: grpc.aio.ServicerContext
    ) -> rt.GetSessionResponse:
        session: Session = await self._guard(context, self._session(request.session_id))
        if session.truncated:
            status = rt.SESSION_STATUS_TRUNCATED
        elif session.done:
            status = rt.SESSION_STATUS_DONE
        else:
            status = rt.SESSION_STATUS_ACTIVE
        idle = time.monotonic() - session.last_used
        return rt.GetSessionResponse(
            session_id=session.session_id,
            env_id=session.env_id,
            status=status,
            step_index=session.step_index,
            reward=session.reward,
            max_steps=session.max_steps,
            expires_in_s=max(0, int(self.config.session_ttl_s - idle)),
        )

    async def ListEnvs(
        self, request: rt.ListEnvsRequest, context: grpc.aio.ServicerContext
    ) -> rt.ListEnvsResponse:
        size = min(request.page_size or 100, 1000)
        ids = [i for i in self.sorted_ids if i.startswith(request.prefix) and i > request.page_token]
        page = ids[:size]
        return rt.ListEnvsResponse(
            envs=[
                rt.EnvSummary(
                    env_id=i, tool_names=self.envs[i].tool_names, task_count=len(self.envs[i].tasks)
                )
                for i in page
            ],
            next_page_token=page[-1] if len(ids) > size else "",
        )

    async def GetEnv(self, request: rt.GetEnvRequest, context: grpc.aio.ServicerContext) -> rt.GetEnvResponse:
        record: EnvRecord = await self._guard(context, self._found(request.env_id))
        return rt.GetEnvResponse(
            env_id=record.env_id,
            tools=tool_specs(record),
            tools_text=record.tools_text,
            task_text=record.task_text,
            tasks=[
                common_pb2.TaskConfig(
                    env_id=t.env_id,
                    config_json=t.config_json,
                    difficulty=DIFFICULTY.get(t.difficulty, common_pb2.DIFFICULTY_UNSPECIFIED),
                    solve_fc_round=t.solve_fc_round,
                )
                for t in record.tasks
            ],
        )

    async def _found(self, env_id: str) -> EnvRecord:
        return self._env(env_id)

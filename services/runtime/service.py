"""The `codegym.runtime.v1.RuntimeService` servicer: sessions over stateless sandbox workers.

The trusted side never runs environment code: actions are checked statically against the tool
names the contract checker read from the source, then sent with the session's committed state to
a sandbox worker. The returned state is committed only when the step succeeded (trial then commit),
so an error, a timeout or a lost worker leaves the session exactly as it was.

Whatever a caller sends, the answer is a typed one: an action the runtime cannot read is a step
error `STEP_ERROR_CODE_INVALID_ACTION` (session unchanged), any other unreadable request is
INVALID_ARGUMENT, and a fault of the runtime itself is INTERNAL with a short message (the traceback
goes to the log), never gRPC's UNKNOWN with a Python exception's text.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from codegym.errors import (
    EntryStatus,
    Reason,
    Refusal,
    add_lenient,
    entry_status,
    guarded,
    guarded_stream,
)
from codegym.sandbox.v1 import sandbox_service_pb2 as sb
from codegym.server.auth import CALLER, OPERATOR
from codegym.server.logs import SESSION_ID
from codegym.server.metrics import (
    ADMISSION_REFUSALS,
    SESSIONS_EXPIRED,
    SESSIONS_OPEN,
    STEPS,
    STEPS_IN_FLIGHT,
    TENANT_CALLS,
    TENANT_SESSIONS,
    WORKER_QUEUE_DEPTH,
)
from codegym_client.api.runtime.v1 import runtime_service_pb2 as rt
from codegym_client.api.runtime.v1 import runtime_service_pb2_grpc as rt_grpc
from services.dispatcher import SandboxDispatcher
from services.runtime import captures, history
from services.runtime.capture_desk import CaptureDesk
from services.runtime.captures import CapturePolicy, CaptureStore
from services.runtime.catalog import Catalog, Served
from services.runtime.checkpoints import Keyring
from services.runtime.config import RuntimeConfig, session_seed
from services.runtime.episode_record import Recorder
from services.runtime.forking import Copies, history_write, start_entry
from services.runtime.initial_states import Initial, InitialStates
from services.runtime.outcomes import action_digest, env_failed, recorded_reply, session_reply, step_error
from services.runtime.record_desk import STEP_OUTCOMES, RecordDesk
from services.runtime.requests import action_text, config_json, create_limits, shown
from services.runtime.sandbox_calls import execute
from services.runtime.sessions import Session, SessionStore, StoreUnavailable
from services.runtime.streaming import batch_step, step_stream
from services.runtime.tenancy import Quotas, require_operator

log = logging.getLogger(__name__)

MAX_UINT32 = (1 << 32) - 1
SERVICE_NAME = rt.DESCRIPTOR.services_by_name["RuntimeService"].full_name
__all__ = ["SERVICE_NAME", "RuntimeServicer", "add_to_server"]


def add_to_server(servicer: RuntimeServicer, server: grpc.aio.Server) -> None:
    """`add_RuntimeServiceServicer_to_server`, except that a request whose bytes do not decode is
    answered INVALID_ARGUMENT (see `codegym.errors.add_lenient`)."""
    add_lenient(servicer, server, rt.DESCRIPTOR.services_by_name["RuntimeService"], rt)


def idle_ms(session: Session) -> int:
    """How long the session sat idle before this step, as its worker is told (0: unknown): a
    session that steps further apart than a resident may sit idle gets no process kept for it.
    A store shared by replicas renews `last_used` as it reads a session, so there it is 0."""
    return min(MAX_UINT32, max(0, int((time.monotonic() - session.last_used) * 1000)))


class RuntimeServicer(rt_grpc.RuntimeServiceServicer):
    def __init__(
        self,
        catalog: Catalog,
        store: SessionStore,
        dispatcher: SandboxDispatcher,
        config: RuntimeConfig | None = None,
        recorder: Recorder | None = None,
        quotas: Quotas | None = None,
        keyring: Keyring | None = None,
        captured: CaptureStore | None = None,
    ) -> None:
        """`keyring`: the deployment's checkpoint keys (None: checkpoints are refused);
        `captured`: where captured episodes are kept (None: nothing is captured)."""
        self.catalog = catalog
        self.config = config or RuntimeConfig()
        # The record of served episodes (its recorder None: the runtime runs without one, `--no-record`).
        self.desk = RecordDesk(catalog, recorder, self.config.max_batch)
        # Each tenant's limits (none without a tokens file naming tenants).
        self.quotas = quotas or Quotas({})
        self.store = store
        self.dispatcher = dispatcher
        # Captured episodes (captures.py): what a create logs, what an episode's end keeps.
        self.captures = CaptureDesk(
            catalog,
            store,
            captured,
            CapturePolicy(self.config.capture_rate, not self.config.no_capture),
        )
        # Initial states creates copy instead of building (initial_states.py).
        self.initial = InitialStates(self.config.initial_states_mb << 20)
        self.releases: set[asyncio.Task[None]] = set()
        # Set as the runtime stops: its StepStream calls take no more steps (streaming.py).
        self.draining = False
        # One token per step admitted and not yet answered.
        self.steps_in_flight: set[object] = set()
        # Forks, checkpoints and restores (forking.py).
        self.copies = Copies(
            catalog,
            store,
            self.config,
            self.quotas,
            keyring,
            session=self._session,
            expire=self._expire,
            release=self._release,
        )
        STEPS_IN_FLIGHT.set_function(lambda: len(self.steps_in_flight))
        WORKER_QUEUE_DEPTH.set_function(lambda: self.dispatcher.queued)

    # ---- helpers ------------------------------------------------------------------------------

    @staticmethod
    def _tenant() -> str:
        """The tenant of the call being served ("" without access tokens)."""
        caller = CALLER.get()
        return caller.tenant if caller is not None else ""

    @staticmethod
    def _owns(session: Session) -> bool:
        """Whether the caller may use the session: its own tenant's, or any for an operator. Another
        tenant's session id is answered as unknown, never with its state."""
        caller = CALLER.get()
        return caller is None or caller.role == OPERATOR or caller.tenant == session.tenant

    async def _session(self, session_id: str) -> Session:
        session = await self.store.get(session_id)
        if session is not None and not self._owns(session):
            session = None
        if session is not None and time.monotonic() - session.last_used > self.config.session_ttl_s:
            await self._forget(session_id)
            session = None
        if session is None:
            raise Refusal(
                Reason.SESSION_NOT_FOUND, f"no session {shown(session_id)} (closed, expired or unknown)"
            )
        return session

    async def _forget(self, session_id: str) -> bool:
        session = await self.store.get(session_id)
        if session is None or not self._owns(session):
            return False
        await self.captures.ended(session, closed=True)
        existed = await self.store.delete(session_id)
        if existed:
            self._release(session_id)
        return existed

    def _release(self, session_id: str) -> None:
        """Free the session's resident process on its worker, without making the caller wait."""
        task = asyncio.get_running_loop().create_task(self.dispatcher.release(session_id))
        self.releases.add(task)
        task.add_done_callback(self.releases.discard)

    def _lock(self, session_id: str) -> contextlib.AbstractAsyncContextManager[None]:
        """Serializes steps of one session: in this process, or across replicas (Redis lease)."""
        return self.store.lock(session_id)

    async def _execute(self, op: sb.Operation, record: Served, key: str = "") -> sb.OperationResult:
        return await execute(self.dispatcher, op, record, key, self.config)

    # ---- sessions -----------------------------------------------------------------------------

    async def _create(self, request: rt.CreateSessionRequest) -> rt.CreateSessionResponse:
        named, config = self.catalog.resolve(request)
        config_json = self._config_json(config)
        record = self.catalog.task_code(named, config)
        options = request.options
        max_steps, timeout_ms = create_limits(request, self.config)
        tenant = self._tenant()
        self.quotas.admit_create(
            tenant,
            await self.store.count_of(tenant) if self.quotas.limit(tenant).sessions else 0,
            self.config.retry_after_ms,
        )
        TENANT_CALLS.labels(tenant, "create").inc()
        if await self.store.count() >= self.config.max_sessions:
            await self._expire()
            if await self.store.count() >= self.config.max_sessions:
                ADMISSION_REFUSALS.labels("sessions").inc()
                raise Refusal(
                    Reason.CAPACITY,
                    f"session limit reached ({self.config.max_sessions} open); close finished sessions or retry",
                    self.config.retry_after_ms,
                )
        session_id = secrets.token_hex(16)
        seed = options.seed or session_seed(session_id)

        async def build() -> Initial:
            """The episode built in a sandbox, its process kept there as the session's resident."""
            op = sb.Operation(
                source=sb.SourceRef(sha256=record.sha256),
                limits=sb.Limits(wall_ms=self.config.create_timeout_ms),
                seed=seed,
                create=sb.CreateOp(config_json=config_json, session_key=session_id),
            )
            result = await self._execute(op, record, session_id)
            if result.status != sb.STATUS_OK:
                raise env_failed(result, f"creating {record.env_id}")
            return Initial(result.state, result.observation)

        initial, _ = await self.initial.make((record.sha256, config_json), seed, build)
        session = Session(
            session_id=session_id,
            env_id=record.env_id,
            config_json=config_json,
            sha256=record.sha256,
            state=initial.state,
            max_steps=max_steps,
            step_timeout_ms=timeout_ms,
            seed=seed,
            run_id=request.run_id,
            policy_version=request.policy_version if request.HasField("policy_version") else None,
            tenant=tenant,
            keep_history=options.keep_history,
            capture_steps=self.captures.steps_for(record.env_id, config_json, max_steps, request.run_id),
            started_ms=captures.now_ms(),
        )
        session.touch()
        if session.keep_history or session.capture_steps:
            await self.store.put_new([(session, [self._start_entry(session, initial.observation)])])
        else:
            await self.store.put(session)
        return rt.CreateSessionResponse(
            session_id=session_id,
            observation=initial.observation,
            tools=record.specs(),
            tools_text=record.tools_text,
            task_text=record.task_text,
            env_id=record.env_id,
            max_steps=max_steps,
            step_timeout_ms=timeout_ms,
        )

    @staticmethod
    def _start_entry(session: Session, observation: str) -> bytes:
        """The entry a session's log starts from (a create's or a reset's): its state when it keeps
        a history, the first observation when its episode is captured."""
        if not session.capture_steps:
            return start_entry(session)
        return history.entry(
            session.step_index,
            session.state if session.keep_history else b"",
            observation=observation,
            reward=session.reward,
            captured=True,
        )

    @staticmethod
    def _config_json(config: dict[str, Any]) -> str:
        """The config as the JSON the jail gets; a config JSON cannot carry is INVALID_ARGUMENT."""
        text, problem = config_json(config)
        if problem is not None:
            raise Refusal(Reason.INVALID_REQUEST, f"bad task: config is not JSON: {problem}")
        return text

    async def _step(self, request: rt.StepRequest) -> rt.StepResponse:
        if len(self.steps_in_flight) >= self.config.max_steps_in_flight:
            ADMISSION_REFUSALS.labels("steps").inc()
            raise Refusal(
                Reason.CAPACITY,
                f"{len(self.steps_in_flight)} steps in flight (max {self.config.max_steps_in_flight}); retry later",
                self.config.step_retry_after_ms,
            )
        tenant = self._tenant()
        self.quotas.admit_step(tenant)
        TENANT_CALLS.labels(tenant, "step").inc()
        token = object()
        self.steps_in_flight.add(token)
        try:
            reply = await self._step_admitted(request)
        finally:
            self.steps_in_flight.discard(token)
        STEPS.labels(STEP_OUTCOMES.get(reply.error.code, "error") if reply.HasField("error") else "ok").inc()
        return reply

    async def _step_admitted(self, request: rt.StepRequest) -> rt.StepResponse:
        session_id = request.session_id
        SESSION_ID.set(session_id[:64])
        # One read of the session per step, under the lock (the step before this one may have
        # changed or ended it); the commit, fenced on the step index, finds a session closed while
        # the step ran (`_not_committed`), so nothing is read again after the worker answers.
        async with self._lock(session_id):
            session = await self._session(session_id)
            if session.done and not (
                request.HasField("step_index") and request.step_index < session.step_index
            ):
                ended = "truncated at max steps" if session.truncated else "done"
                raise Refusal(
                    Reason.SESSION_DONE,
                    f"session {shown(session_id)} is {ended} after {session.step_index} steps; Reset it or open a new one",
                )
            record = self.catalog.code(session.env_id, session.sha256)
            action, error = action_text(request, record.tool_names, self.config.max_action_bytes)
            if request.HasField("step_index") and request.step_index != session.step_index:
                return recorded_reply(session, request.step_index, action)
            if error is None:
                op = sb.Operation(
                    source=sb.SourceRef(sha256=record.sha256),
                    limits=sb.Limits(wall_ms=session.step_timeout_ms),
                    seed=(session.seed + session.step_index + 1) % (1 << 63),
                    step=sb.StepOp(
                        state=session.state,
                        action=action,
                        session_key=session_id,
                        idle_ms=idle_ms(session),
                    ),
                )
                result = await self._execute(op, record, session_id)
                error = step_error(result)
                self.desk.served(session, error)
            session.touch()
            if error is not None:
                if captures.logs(session):  # the captured episode's log shows the step that failed
                    failed = history.entry(
                        session.step_index,
                        b"",
                        action=action or request.action_json[:4096],
                        observation=error.message,
                        reward=session.reward,
                        captured=True,
                        error=rt.StepErrorCode.Name(error.code),
                    )
                    kept = await self.store.commit(
                        session, session.step_index, history_write(self.config, failed)
                    )
                else:
                    kept = await self.store.touch(session, session.step_index)
                if not kept and await self.store.get(session_id) is None:
                    # Closed (or expired) while the step ran. A session another replica moved on
                    # meanwhile still gets the step's own failure, which changed nothing.
                    await self._not_committed(session_id, "step")
                return rt.StepResponse(
                    observation=error.message,
                    reward=session.reward,
                    step_index=session.step_index,
                    error=error,
                )
            started_at = session.step_index
            session.state = result.state
            session.step_index += 1
            session.reward = result.reward
            session.done = result.done
            if not session.done and session.step_index >= session.max_steps:
                session.done = session.truncated = True
            reply = rt.StepResponse(
                observation=result.observation,
                reward=session.reward,
                done=session.done,
                truncated=session.truncated,
                step_index=session.step_index,
            )
            session.last_reply = reply.SerializeToString()
            session.last_action = action_digest(action)
            logged = None
            captured = started_at < session.capture_steps
            if session.keep_history or captured:
                logged = history_write(
                    self.config,
                    history.entry(
                        session.step_index,
                        session.state if session.keep_history else b"",
                        action=action,
                        observation=result.observation,
                        reward=session.reward,
                        done=session.done,
                        truncated=session.truncated,
                        captured=captured,
                    ),
                )
            try:
                committed = await self.store.commit(session, started_at, logged)
            except StoreUnavailable as exc:
                # Unlike any earlier failure, the commit may have happened before the store failed.
                raise Refusal(
                    Reason.OUTCOME_UNKNOWN,
                    f"session {shown(session_id)}: the step's commit failed ({exc}); it may have been "
                    f"applied: resend it with step_index {started_at} to learn its outcome",
                    self.config.retry_after_ms,
                ) from None
            if not committed:
                await self._not_committed(session_id, "step")
            if session.done:
                self.desk.ended(session)
                await self.captures.ended(session)
            if session.truncated:
                # The environment does not know the episode ended: free its process now (the
                # worker ends it by itself when the environment says done).
                self._release(session_id)
            return reply

    async def _not_committed(self, session_id: str, what: str) -> None:
        """Why a step's or reset's fenced commit was refused, as the caller's answer: the session
        was closed (or expired) while it ran, and is not brought back; or another replica applied
        a step to it meanwhile (this one's lease ran out), and this one was not applied."""
        if await self.store.get(session_id) is None:
            raise Refusal(
                Reason.SESSION_NOT_FOUND, f"session {shown(session_id)} was closed during the {what}"
            )
        raise Refusal(
            Reason.STEP_CONFLICT,
            f"session {shown(session_id)} moved on while the {what} ran; the {what} was not applied",
        )

    async def _reset(self, request: rt.ResetRequest) -> rt.ResetResponse:
        async with self._lock(request.session_id):
            session = await self._session(request.session_id)
            record = self.catalog.code(session.env_id, session.sha256)
            op = sb.Operation(
                source=sb.SourceRef(sha256=record.sha256),
                limits=sb.Limits(wall_ms=self.config.create_timeout_ms),
                seed=session.seed,
                reset=sb.ResetOp(state=session.state, config_json=session.config_json),
            )
            result = await self._execute(op, record, request.session_id)
            if result.status != sb.STATUS_OK:
                raise env_failed(result, f"resetting {session.env_id}")
            started_at = session.step_index
            session.state = result.state
            session.step_index = 0
            session.reward = 0.0
            session.done = session.truncated = False
            session.last_reply, session.last_action = b"", ""
            session.touch()
            # Fenced like a step: a replica that stalled past its lease must not roll the session
            # back to step 0 under a client that moved on through another replica.
            # A reset starts the episode, and its history, over.
            logged = (
                history_write(self.config, self._start_entry(session, result.observation), restart=True)
                if session.keep_history or session.capture_steps
                else None
            )
            if not await self.store.commit(session, started_at, logged):
                await self._not_committed(request.session_id, "reset")
            return rt.ResetResponse(observation=result.observation)

    async def _expire(self) -> None:
        expired = await self.store.expire(self.config.session_ttl_s)
        SESSIONS_EXPIRED.inc(len(expired))
        for session_id in expired:
            self._release(session_id)

    async def reaper(self) -> None:
        """Drop idle sessions periodically (and lazily on access, see `_session`)."""
        interval = max(0.05, min(self.config.session_ttl_s / 4, 10.0))
        while True:
            await asyncio.sleep(interval)
            try:
                await self._expire()
                SESSIONS_OPEN.set(await self.store.count())
                for tenant in self.quotas.limits:
                    TENANT_SESSIONS.labels(tenant).set(await self.store.count_of(tenant))
            except StoreUnavailable as exc:  # the store is down now: the next round tries again
                log.warning(
                    "session reaper: the session store is unavailable (%s); next round in %.0f s",
                    exc,
                    interval,
                )
            except Exception:  # a bug must not stop the reaping for good, nor go unseen
                log.exception("session reaper: round failed; next round in %.0f s", interval)

    # ---- RPCs ---------------------------------------------------------------------------------

    @guarded
    async def CreateSession(
        self, request: rt.CreateSessionRequest, context: grpc.aio.ServicerContext
    ) -> rt.CreateSessionResponse:
        return await self._create(request)

    @guarded
    async def Step(self, request: rt.StepRequest, context: grpc.aio.ServicerContext) -> rt.StepResponse:
        return await self._step(request)

    async def _entry(self, step: rt.StepRequest) -> rt.StepResponse | EntryStatus:
        """One step of a BatchStep or StepStream: the response, or the status a unary Step would
        have ended with (its reason and retry-after too)."""
        try:
            return await self._step(step)
        except Exception as exc:
            what = f"a step of session {shown(step.session_id)}"
            return entry_status(exc, what, self.config.retry_after_ms)

    @guarded
    async def BatchStep(
        self, request: rt.BatchStepRequest, context: grpc.aio.ServicerContext
    ) -> rt.BatchStepResponse:
        return await batch_step(request, self._entry, self.config.max_batch)

    async def StepStream(
        self, request_iterator: AsyncIterator[rt.StepStreamRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[rt.StepStreamResponse]:
        # An async generator function itself: gRPC tells streaming handlers apart by that.
        answers = step_stream(
            request_iterator, context, self._entry, self.config.max_batch, lambda: self.draining
        )
        async for answer in answers:
            yield answer

    @guarded
    async def Reset(self, request: rt.ResetRequest, context: grpc.aio.ServicerContext) -> rt.ResetResponse:
        return await self._reset(request)

    @guarded
    async def CloseSession(
        self, request: rt.CloseSessionRequest, context: grpc.aio.ServicerContext
    ) -> rt.CloseSessionResponse:
        return rt.CloseSessionResponse(existed=await self._forget(request.session_id))

    @guarded
    async def GetSession(
        self, request: rt.GetSessionRequest, context: grpc.aio.ServicerContext
    ) -> rt.GetSessionResponse:
        return session_reply(await self._session(request.session_id), self.config.session_ttl_s)

    @guarded
    async def ListEnvs(
        self, request: rt.ListEnvsRequest, context: grpc.aio.ServicerContext
    ) -> rt.ListEnvsResponse:
        return self.catalog.list_envs(request)

    @guarded
    async def GetEnv(self, request: rt.GetEnvRequest, context: grpc.aio.ServicerContext) -> rt.GetEnvResponse:
        return self.catalog.get_env(request.env_id)

    @guarded_stream
    async def Stats(
        self, request: rt.StatsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[rt.StatsResponse]:
        async for entry in self.desk.stats(request):
            yield entry

    @guarded
    async def SampleTasks(
        self, request: rt.SampleTasksRequest, context: grpc.aio.ServicerContext
    ) -> rt.SampleTasksResponse:
        return await self.desk.sample(request)

    @guarded
    async def LiftQuarantine(
        self, request: rt.LiftQuarantineRequest, context: grpc.aio.ServicerContext
    ) -> rt.LiftQuarantineResponse:
        require_operator("LiftQuarantine")
        return await self.desk.lift_quarantine(request)

    @guarded
    async def ForkSession(
        self, request: rt.ForkSessionRequest, context: grpc.aio.ServicerContext
    ) -> rt.ForkSessionResponse:
        return await self.copies.fork(request)

    @guarded
    async def CheckpointSession(
        self, request: rt.CheckpointSessionRequest, context: grpc.aio.ServicerContext
    ) -> rt.CheckpointSessionResponse:
        return await self.copies.checkpoint(request)

    @guarded
    async def RestoreSession(
        self, request: rt.RestoreSessionRequest, context: grpc.aio.ServicerContext
    ) -> rt.RestoreSessionResponse:
        return await self.copies.restore(request)

    @guarded
    async def RunHistory(
        self, request: rt.RunHistoryRequest, context: grpc.aio.ServicerContext
    ) -> rt.RunHistoryResponse:
        return await self.desk.history(request)

    @guarded
    async def SearchEnvs(
        self, request: rt.SearchEnvsRequest, context: grpc.aio.ServicerContext
    ) -> rt.SearchEnvsResponse:
        return await self.desk.search(request)

    @guarded
    async def ListEpisodes(
        self, request: rt.ListEpisodesRequest, context: grpc.aio.ServicerContext
    ) -> rt.ListEpisodesResponse:
        return await self.captures.list(request)

    @guarded
    async def GetEpisode(
        self, request: rt.GetEpisodeRequest, context: grpc.aio.ServicerContext
    ) -> rt.GetEpisodeResponse:
        return await self.captures.get(request)

    @guarded
    async def GetEnvCode(
        self, request: rt.GetEnvCodeRequest, context: grpc.aio.ServicerContext
    ) -> rt.GetEnvCodeResponse:
        require_operator("GetEnvCode")  # the runtime never serves code to trainers
        code = self.catalog.env(request.env_id).source
        return rt.GetEnvCodeResponse(
            env_id=request.env_id,
            code=code,
            code_sha256=hashlib.sha256(code.encode("utf-8", "surrogatepass")).hexdigest(),
        )

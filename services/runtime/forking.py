"""Sessions made from other sessions: forks (`ForkSession`), checkpoints (`CheckpointSession`) and
restores (`RestoreSession`). docs/fork.md says what each is and costs.

Everything here copies bytes the runtime already holds; nothing runs environment code:
- a fork copies the source's last *committed* state (never waiting for a step in flight, which may
  still fail), or with `at_step` the state its history holds for that step (a rewind). Its first
  step runs cold from that state on whatever worker the dispatcher picks: the source's resident
  process is never shared, since it runs under the source's uid and two sessions on one uid could
  signal each other and read each other's /proc;
- a fork keeps the source's seed, so its steps draw what the source's drew (each step's seed is
  the session's seed plus its index), unless `reseed` gives each fork a seed of its own;
- a checkpoint seals the committed session with the deployment's key (checkpoints.py); `close`
  deletes it in the same write as the idempotency entry (suspended: nothing else is held);
- a restore opens a blob, checks its tenant and that the library still holds its code, and puts a
  new session: any replica with the key, after any restart, as often as asked (each restore is an
  independent episode).
New sessions count against the tenant's quota and the runtime's bound all together or not at all.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections.abc import Awaitable, Callable

from codegym.checkpoint.v1 import checkpoint_pb2 as cp
from codegym.errors import Reason, Refusal
from codegym.server.auth import CALLER, OPERATOR
from codegym.server.metrics import ADMISSION_REFUSALS, TENANT_CALLS
from codegym_client.api.runtime.v1 import runtime_service_pb2 as rt
from services.runtime import history
from services.runtime.catalog import Catalog
from services.runtime.checkpoints import Keyring, require_keys, seal, unseal
from services.runtime.config import RuntimeConfig, session_seed
from services.runtime.history import HistoryWrite
from services.runtime.idempotency import Idempotency
from services.runtime.requests import shown
from services.runtime.sessions import Session, SessionStore
from services.runtime.tenancy import Quotas


def described(session: Session) -> rt.ForkedSession:
    return rt.ForkedSession(
        session_id=session.session_id,
        step_index=session.step_index,
        reward=session.reward,
        done=session.done,
        truncated=session.truncated,
        env_id=session.env_id,
        max_steps=session.max_steps,
        step_timeout_ms=session.step_timeout_ms,
    )


def start_entry(session: Session) -> bytes:
    """The history entry a session's log starts from: its state as it stands."""
    return history.entry(
        session.step_index,
        session.state,
        reward=session.reward,
        done=session.done,
        truncated=session.truncated,
    )


def history_write(config: RuntimeConfig, entry: bytes, restart: bool = False) -> HistoryWrite:
    return HistoryWrite(entry, config.history_steps, config.history_entries, restart)


class Copies:
    """The three calls, over the servicer's store, catalog, quotas and key."""

    def __init__(
        self,
        catalog: Catalog,
        store: SessionStore,
        config: RuntimeConfig,
        quotas: Quotas,
        keyring: Keyring | None,
        *,
        session: Callable[[str], Awaitable[Session]],
        expire: Callable[[], Awaitable[None]],
        release: Callable[[str], None],
    ) -> None:
        self.catalog = catalog
        self.store = store
        self.config = config
        self.quotas = quotas
        self.keyring = keyring
        self.idempotency = Idempotency(store, config)
        self._session = session
        self._expire = expire
        self._release = release

    @staticmethod
    def _caller() -> tuple[str, bool]:
        """The caller's tenant, and whether it is an operator."""
        caller = CALLER.get()
        if caller is None:
            return "", False
        return caller.tenant, caller.role == OPERATOR

    async def admit(self, tenant: str, count: int) -> None:
        """`count` new sessions for `tenant`, all or none (CAPACITY with nothing changed)."""
        self.quotas.admit_create(
            tenant,
            await self.store.count_of(tenant) if self.quotas.limit(tenant).sessions else 0,
            self.config.retry_after_ms,
            count,
        )
        bound = self.config.max_sessions
        if await self.store.count() + count > bound:
            await self._expire()
            held = await self.store.count()
            if held + count > bound:
                ADMISSION_REFUSALS.labels("sessions").inc()
                raise Refusal(
                    Reason.CAPACITY,
                    f"session limit reached ({held} open, {count} more asked, max {bound}); close "
                    "finished sessions or retry",
                    self.config.retry_after_ms,
                )

    # ---- fork ---------------------------------------------------------------------------------

    async def fork(self, request: rt.ForkSessionRequest) -> rt.ForkSessionResponse:
        cap = self.config.max_forks
        if not 1 <= request.count <= cap:
            raise Refusal(Reason.INVALID_REQUEST, f"count {request.count}: a fork makes 1 to {cap} sessions")
        if request.HasField("at_step") and request.at_step < 0:
            raise Refusal(Reason.INVALID_REQUEST, f"at_step {request.at_step} is negative")
        tenant, _ = self._caller()
        key = self.idempotency.key(tenant, "fork", request.request_id)
        return await self.idempotency.once(
            key, rt.ForkSessionResponse, lambda: self._fork(request, tenant, key), request.request_id
        )

    async def _fork(self, request: rt.ForkSessionRequest, tenant: str, key: str) -> rt.ForkSessionResponse:
        # The committed session as it stands: a step in flight is not waited for (it may fail).
        source = await self._session(request.session_id)
        entries = await self.store.history(source.session_id) if source.keep_history else []
        items = history.parse(entries)
        base = dataclasses.replace(source)
        if request.HasField("at_step") and request.at_step != source.step_index:
            if not source.keep_history:
                raise Refusal(
                    Reason.NO_HISTORY,
                    f"session {shown(source.session_id)} kept no history: create it with keep_history "
                    "to fork at an earlier step",
                )
            if request.at_step > source.step_index:
                raise Refusal(
                    Reason.INVALID_REQUEST,
                    f"at_step {request.at_step} is past session {shown(source.session_id)}'s "
                    f"{source.step_index} committed steps",
                )
            found = history.find(items, request.at_step)
            if found is None:
                raise Refusal(
                    Reason.NO_HISTORY,
                    f"session {shown(source.session_id)}'s history no longer holds step {request.at_step} "
                    f"(it holds {history.held(items)}; the oldest entries go past --history-steps)",
                )
            base.state, base.step_index, base.reward = found.state, found.step_index, found.reward
            base.done, base.truncated = found.done, found.truncated
            base.last_reply, base.last_action = b"", ""
        inherited = history.up_to(entries, items, base.step_index) if base.keep_history else []
        if base.keep_history and not inherited:
            inherited = [start_entry(base)]
        await self.admit(tenant, request.count)
        TENANT_CALLS.labels(tenant, "fork").inc()
        forks: list[tuple[Session, list[bytes]]] = []
        for _ in range(request.count):
            session_id = secrets.token_hex(16)
            fork = dataclasses.replace(base, session_id=session_id, tenant=tenant, branch=True)
            if request.reseed:
                fork.seed = session_seed(session_id)
            fork.touch()
            forks.append((fork, inherited))
        reply = rt.ForkSessionResponse(
            sessions=[described(fork) for fork, _ in forks], step_index=base.step_index
        )
        await self.store.put_new(forks, self.idempotency.answer(key, reply))
        return reply

    # ---- checkpoint ---------------------------------------------------------------------------

    async def checkpoint(self, request: rt.CheckpointSessionRequest) -> rt.CheckpointSessionResponse:
        require_keys(self.keyring)  # no key: the typed refusal naming the flag, before anything
        tenant, _ = self._caller()
        key = self.idempotency.key(tenant, "checkpoint", request.request_id)
        return await self.idempotency.once(
            key, rt.CheckpointSessionResponse, lambda: self._checkpoint(request, key), request.request_id
        )

    def _sealed(self, session: Session, *, suspended: bool) -> rt.CheckpointSessionResponse:
        """The session sealed. A checkpoint that leaves its session open (`suspended` false) seals a
        branch: the source goes on as the episode, so whatever is restored from it shares its prefix
        and is recorded apart, as a fork is."""
        body = cp.CheckpointBody(
            env_id=session.env_id,
            sha256=session.sha256,
            config_json=session.config_json,
            state=session.state,
            seed=session.seed,
            step_index=session.step_index,
            reward=session.reward,
            done=session.done,
            truncated=session.truncated,
            max_steps=session.max_steps,
            step_timeout_ms=session.step_timeout_ms,
            run_id=session.run_id,
            tenant=session.tenant,
            branch=session.branch or not suspended,
            keep_history=session.keep_history,
            sealed_at=time.time(),
        )
        if session.policy_version is not None:
            body.policy_version = session.policy_version
        if not body.sha256:  # a session from a store written before sessions named their code
            body.sha256 = self.catalog.code(session.env_id, "").sha256
        return rt.CheckpointSessionResponse(
            checkpoint=seal(self.keyring, body), step_index=session.step_index
        )

    async def _checkpoint(
        self, request: rt.CheckpointSessionRequest, key: str
    ) -> rt.CheckpointSessionResponse:
        if not request.close:
            reply = self._sealed(await self._session(request.session_id), suspended=False)
            answer = self.idempotency.answer(key, reply)
            if answer is not None:
                await self.store.remember(answer)
            return reply
        await self._session(request.session_id)
        # Suspending waits for a step in flight: it would otherwise be lost with the session.
        async with self.store.lock(request.session_id):
            session = await self._session(request.session_id)
            reply = self._sealed(session, suspended=True)
            if not await self.store.suspend(session, self.idempotency.answer(key, reply)):
                raise Refusal(
                    Reason.SESSION_NOT_FOUND,
                    f"session {shown(request.session_id)} was closed during the checkpoint",
                )
        self._release(request.session_id)
        return reply

    # ---- restore ------------------------------------------------------------------------------

    async def restore(self, request: rt.RestoreSessionRequest) -> rt.RestoreSessionResponse:
        tenant, operator = self._caller()
        body = unseal(self.keyring, request.checkpoint, self.config.max_checkpoint_bytes)
        if body.tenant != tenant and not operator:
            raise Refusal(
                Reason.BAD_CHECKPOINT, "the checkpoint belongs to another tenant; only it may restore it"
            )
        key = self.idempotency.key(tenant, "restore", request.request_id)
        return await self.idempotency.once(
            key, rt.RestoreSessionResponse, lambda: self._restore(body, key), request.request_id
        )

    async def _restore(self, body: cp.CheckpointBody, key: str) -> rt.RestoreSessionResponse:
        try:
            self.catalog.code(body.env_id, body.sha256)
        except Refusal as exc:
            if exc.reason is not Reason.ENV_NOT_FOUND:
                raise
            raise Refusal(
                Reason.CODE_GONE,
                f"the checkpoint's environment {shown(body.env_id)} with code sha256 {body.sha256[:64]} "
                "is no longer in the library",
            ) from None
        # The session is the blob's tenant's (an operator restores for a tenant).
        await self.admit(body.tenant, 1)
        TENANT_CALLS.labels(body.tenant, "restore").inc()
        session = Session(
            session_id=secrets.token_hex(16),
            env_id=body.env_id,
            config_json=body.config_json,
            state=body.state,
            max_steps=body.max_steps,
            step_timeout_ms=body.step_timeout_ms,
            seed=body.seed,
            step_index=body.step_index,
            reward=body.reward,
            done=body.done,
            truncated=body.truncated,
            sha256=body.sha256,
            run_id=body.run_id,
            policy_version=body.policy_version if body.HasField("policy_version") else None,
            tenant=body.tenant,
            keep_history=body.keep_history,
            branch=body.branch,
        )
        session.touch()
        reply = rt.RestoreSessionResponse(session=described(session))
        entries = [start_entry(session)] if session.keep_history else []
        await self.store.put_new([(session, entries)], self.idempotency.answer(key, reply))
        return reply

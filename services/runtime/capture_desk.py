"""What the runtime does about captured episodes (captures.py): decide at create what a session's
log keeps, make and keep a capture when its episode ends, and answer `ListEpisodes` and
`GetEpisode` for the caller's tenant (an operator: any tenant's).

Keeping a capture never fails a step: the episode's step is committed before, and a store that is
down loses the capture (logged and counted), never the step.
"""

from __future__ import annotations

import logging

from codegym.errors import Reason, Refusal
from codegym.server.auth import CALLER, OPERATOR
from codegym.server.metrics import RECORD_EVENTS
from codegym_client.api.runtime.v1 import runtime_service_pb2 as rt
from services.runtime import captures, history
from services.runtime.captures import CapturePolicy, CaptureStore, Filters
from services.runtime.catalog import Catalog
from services.runtime.episode_record import task_key
from services.runtime.requests import shown
from services.runtime.sessions import Session, SessionStore

log = logging.getLogger(__name__)


def caller_tenant() -> str | None:
    """The tenant whose captures the caller may read; None: every tenant's (an operator, or a
    runtime without access tokens)."""
    caller = CALLER.get()
    if caller is None or caller.role == OPERATOR:
        return None
    return caller.tenant


class CaptureDesk:
    """Captures over the session store's logs and a capture store (None: nothing is captured)."""

    def __init__(
        self, catalog: Catalog, sessions: SessionStore, store: CaptureStore | None, policy: CapturePolicy
    ) -> None:
        self.catalog = catalog
        self.sessions = sessions
        self.store = store
        self.policy = policy if store is not None else CapturePolicy(enabled=False)

    def steps_for(self, env_id: str, config_json: str, max_steps: int, run_id: str) -> int:
        """Session.capture_steps of a new episode."""
        if not self.policy.enabled:
            return 0
        oracle = self.catalog.oracle_steps(env_id, config_json)
        return self.policy.steps_for(max_steps, oracle, run_id)

    async def ended(self, session: Session, closed: bool = False) -> None:
        """The session's episode ended (or, `closed`, it is being closed before its end): keep its
        capture when it is one to keep."""
        if self.store is None or not session.capture_steps:
            return
        if closed and (session.done or not captures.sampled(session)):
            return  # a done episode was captured at its end; an unsampled one is kept only flagged
        if not captures.sampled(session) and not (
            session.reward > 0 and session.step_index < session.capture_steps
        ):
            return  # cannot be flagged: no need to read its log
        try:
            entries = history.parse(await self.sessions.history(session.session_id))
            oracle = self.catalog.oracle_steps(session.env_id, session.config_json)
            capture = captures.make(
                session, entries, task_key(session.env_id, session.config_json), oracle, closed
            )
            if captures.kept(session, capture):
                await self.store.put(capture)
                RECORD_EVENTS.labels("captured").inc()
        except Exception as exc:  # a capture is for reading later, never worth failing a step for
            RECORD_EVENTS.labels("capture_lost").inc()
            log.warning("capture of session %s lost: %s", shown(session.session_id), exc)

    def _store(self) -> CaptureStore:
        if self.store is None:
            raise Refusal(
                Reason.INVALID_REQUEST, "this runtime captures no episodes (it was started with --no-capture)"
            )
        return self.store

    async def list(self, request: rt.ListEpisodesRequest) -> rt.ListEpisodesResponse:
        size = captures.page_size(request.page_size)
        before = captures.read_token(request.page_token)
        filters = Filters(
            tenant=caller_tenant(),
            run_id=request.run_id,
            env_id=request.env_id,
            rewarded=request.rewarded if request.HasField("rewarded") else None,
            flagged_only=request.flagged_only,
            errors_only=request.errors_only,
        )
        found, after = await self._store().page(filters, size, before)
        return rt.ListEpisodesResponse(
            episodes=found, next_page_token=captures.page_token(after) if after is not None else ""
        )

    async def get(self, request: rt.GetEpisodeRequest) -> rt.GetEpisodeResponse:
        if not request.episode_id:
            raise Refusal(Reason.INVALID_REQUEST, "episode_id is empty")
        found = await self._store().get(request.episode_id)
        tenant = caller_tenant()
        if found is None or (tenant is not None and found.summary.tenant != tenant):
            # Another tenant's capture is answered as unknown, never with its content.
            raise Refusal(
                Reason.EPISODE_NOT_FOUND,
                f"no captured episode {shown(request.episode_id)} (not captured, evicted past "
                "--capture-bytes, or unknown)",
            )
        return found

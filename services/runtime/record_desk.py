"""What the runtime does with its episode record: count the steps workers served and the episode
ends it committed, and answer the record's RPCs (`Stats`, `SampleTasks`, `LiftQuarantine`) and
its Prometheus gauges.

Apart from the servicer because none of it is on a session's path: a step only adds to the
recorder's in-memory deltas, and the rest reads the durable record (written first with what this
runtime still holds, so a reader sees every episode this replica committed)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from codegym.errors import Reason, Refusal
from codegym.server.metrics import RECORD_QUARANTINED, RECORD_TASKS
from codegym.threaded import iterate_in_thread
from codegym_client.api.runtime.v1 import runtime_service_pb2 as rt
from services.runtime.catalog import Catalog
from services.runtime.curriculum import Record, pass_rate_bands, quarantine_reason, sample, stats_pages
from services.runtime.episode_record import ENV_SCOPE, EpisodeOutcome, Recorder, task_scope
from services.runtime.sessions import Session

log = logging.getLogger(__name__)

# Step outcomes as counted in codegym_runtime_steps_total: "ok" or the step error's name.
STEP_OUTCOMES = {
    value.number: value.name.removeprefix("STEP_ERROR_CODE_").lower()
    for value in rt.StepErrorCode.DESCRIPTOR.values
}


class RecordDesk:
    """The record's side of the runtime (`recorder` None: started with `--no-record`)."""

    def __init__(self, catalog: Catalog, recorder: Recorder | None, max_batch: int) -> None:
        self.catalog = catalog
        self.recorder = recorder
        self.max_batch = max_batch

    def served(self, session: Session, error: rt.StepError | None) -> None:
        """Count a step a worker ran (an action refused before it is not one)."""
        if self.recorder is None:
            return
        failure = None if error is None else STEP_OUTCOMES.get(error.code, "env_error")
        message = "" if error is None else error.message
        self.recorder.step(session.env_id, session.config_json, session.run_id, failure, message)

    def ended(self, session: Session) -> None:
        """Record a committed episode end (only committed ones: a step that failed or conflicted
        ended nothing, and a session closed before its end is no outcome)."""
        if self.recorder is None:
            return
        # A fork's end is a branch's: counted apart, so the prefix it shares with its source (and
        # its siblings) does not count again in pass rates, the sampler's pools or the sentinel.
        record = self.recorder.branch if session.branch else self.recorder.episode
        record(
            EpisodeOutcome(
                session_id=session.session_id,
                env_id=session.env_id,
                config_json=session.config_json,
                run_id=session.run_id,
                policy_version=session.policy_version,
                reward=session.reward,
                steps=session.step_index,
                ending="truncated" if session.truncated else "done",
            )
        )

    async def flushed(self) -> Recorder:
        """The recorder, with what this runtime holds in memory written to its store."""
        if self.recorder is None:
            raise Refusal(
                Reason.INVALID_REQUEST,
                "this runtime keeps no episode record (it was started with --no-record)",
            )
        await self.recorder.flush()
        return self.recorder

    async def record(self, run_id: str) -> Record:
        """The record as it stands, with what this runtime holds in memory written first."""
        store = (await self.flushed()).store
        everyone = await store.read(task_scope(""))
        run = everyone if not run_id else await store.read(task_scope(run_id))
        return Record(run=run, everyone=everyone, envs=await store.read(ENV_SCOPE))

    async def gauges(self, every_s: float = 30.0) -> None:
        """Refresh the record's Prometheus gauges (bands and totals only: no env or task label)."""
        while True:
            try:
                record = await self.record("")
                for band, count in pass_rate_bands(record.everyone).items():
                    RECORD_TASKS.labels(band).set(count)
                RECORD_QUARANTINED.set(len(record.quarantined()))
            except Exception as exc:  # a store down now is no reason to stop refreshing later
                log.warning("episode record gauges not refreshed: %s", exc)
            await asyncio.sleep(every_s)

    async def stats(self, request: rt.StatsRequest) -> AsyncIterator[rt.StatsResponse]:
        """Every task's (and env's) line, built page by page in a thread: a library of tens of
        thousands must not hold the event loop."""
        record = await self.record(request.run_id)
        path = self.catalog.path
        async for page in iterate_in_thread(lambda: stats_pages(path, record, request)):
            for entry in page:
                yield entry

    async def sample(self, request: rt.SampleTasksRequest) -> rt.SampleTasksResponse:
        if request.n > self.max_batch * 64:
            raise Refusal(Reason.INVALID_REQUEST, f"n {request.n} exceeds {self.max_batch * 64}")
        record = await self.record(request.run_id)
        try:
            return await asyncio.to_thread(sample, self.catalog.path, record, request)
        except ValueError as exc:
            raise Refusal(Reason.INVALID_REQUEST, str(exc)) from None

    async def search(self, request: rt.SearchEnvsRequest) -> rt.SearchEnvsResponse:
        """SearchEnvs: the catalog's page, each environment marked quarantined from the record
        (one read per environment of the page)."""
        page = self.catalog.search(request)
        if self.recorder is not None and page.envs:
            store = (await self.flushed()).store
            for env in page.envs:
                env.quarantined = bool(quarantine_reason(await store.read_one(ENV_SCOPE, env.env_id)))
        return page

    async def lift_quarantine(self, request: rt.LiftQuarantineRequest) -> rt.LiftQuarantineResponse:
        store = (await self.flushed()).store
        env = await store.read_one(ENV_SCOPE, request.env_id)  # the env's record, not the run's tasks
        if not quarantine_reason(env):
            if env is None:
                self.catalog.env(request.env_id)  # ENV_NOT_FOUND for an id the library lacks
            return rt.LiftQuarantineResponse(lifted=False)
        await store.apply({(ENV_SCOPE, request.env_id): {"reset": ["window"], "lifts": 1}}, {})
        log.info("quarantine of %s lifted", request.env_id)
        return rt.LiftQuarantineResponse(lifted=True)

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
from codegym.library.store import Library
from codegym.server.metrics import RECORD_QUARANTINED, RECORD_TASKS
from codegym.threaded import iterate_in_thread
from codegym_client.api.runtime.v1 import runtime_service_pb2 as rt
from codegym_client.curriculum import DEFAULT_MIN_EPISODES, Band
from services.runtime.catalog import Catalog
from services.runtime.curriculum import Record, gauge_bands, is_failing, sample, stats_pages
from services.runtime.episode_record import (
    ALL_RUNS,
    ENV_SCOPE,
    MAX_RUNS,
    EpisodeOutcome,
    Recorder,
    RecordStore,
    task_scope,
)
from services.runtime.sessions import Session
from services.runtime.tallies import BANDS, FAILURE_KINDS, MEASURING, EnvTally, TaskTally, pool_counts
from services.runtime.task_draws import Summaries

log = logging.getLogger(__name__)

# Environments one Stats call may ask for by their share of failed steps (`worst_envs`).
MAX_WORST_ENVS = 1000


def check_stats(request: rt.StatsRequest) -> None:
    """Refuse a Stats request whose options contradict each other, saying which."""
    if request.envs_only and request.tasks_only:
        raise Refusal(Reason.INVALID_REQUEST, "envs_only and tasks_only together leave nothing to list")
    if request.worst_envs and not request.envs_only:
        raise Refusal(Reason.INVALID_REQUEST, "worst_envs lists environments only: give envs_only too")
    if request.worst_envs and request.env_prefix:
        raise Refusal(Reason.INVALID_REQUEST, "worst_envs ranks every environment: give no env_prefix")
    if request.worst_envs > MAX_WORST_ENVS:
        raise Refusal(Reason.INVALID_REQUEST, f"worst_envs {request.worst_envs} exceeds {MAX_WORST_ENVS}")


def failed_share(env: EnvTally) -> float:
    """`tallies.error_score` of a read tally (0 without a failed step)."""
    failed = sum(getattr(env, kind) for kind in FAILURE_KINDS)
    return failed / max(env.steps, failed) if failed else 0.0


# Step outcomes as counted in codegym_runtime_steps_total: "ok" or the step error's name.
STEP_OUTCOMES = {
    value.number: value.name.removeprefix("STEP_ERROR_CODE_").lower()
    for value in rt.StepErrorCode.DESCRIPTOR.values
}


async def failing(store: RecordStore, band: Band) -> frozenset[str]:
    """The tasks every run fails by `band` (rule 2 of curriculum.py), read from the pool index: a
    range of it, and the bodies only when the band asks for other evidence than the index keeps."""
    scope = task_scope("")
    keys = await store.scored(scope, 0.0, band.low)
    if band.min_episodes == DEFAULT_MIN_EPISODES:
        return frozenset(keys)
    if band.min_episodes < DEFAULT_MIN_EPISODES:
        keys += await store.scored(scope, MEASURING, MEASURING)
    bodies = await store.read_many(scope, keys)
    return frozenset(key for key, body in bodies.items() if is_failing(TaskTally.of(body), band))


class RecordDesk:
    """The record's side of the runtime (`recorder` None: started with `--no-record`)."""

    def __init__(self, catalog: Catalog, recorder: Recorder | None, max_batch: int) -> None:
        self.catalog = catalog
        self.recorder = recorder
        self.max_batch = max_batch
        self.summaries = Summaries(catalog.path)

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

    async def record(self, run_id: str, band: Band) -> Record:
        """What a call reads of the record (the run's played tasks, the tasks every run fails by
        `band`, the quarantined environments), with what this runtime holds in memory written
        first. Never a walk of the library or of other runs' tasks."""
        store = (await self.flushed()).store
        run = await store.read(task_scope(run_id))
        return Record(
            run={key: TaskTally.of(body) for key, body in run.items()},
            failing=await failing(store, band),
            quarantined=frozenset(await store.quarantined()),
        )

    async def envs(self, store: RecordStore, request: rt.StatsRequest) -> dict[str, EnvTally]:
        """The environments a Stats call lists, in its order: by id; with `worst_envs`, the
        quarantined and the worst others by their share of failed steps, the worst first."""
        prefix = request.env_prefix
        if request.worst_envs:
            chosen = set(await store.worst_envs(request.worst_envs)) | await store.quarantined()
            tallies = {
                env_id: EnvTally.of(body)
                for env_id, body in (await store.read_many(ENV_SCOPE, chosen)).items()
            }
            return dict(sorted(tallies.items(), key=lambda item: (-failed_share(item[1]), item[0])))
        bodies = await (store.read_prefix(ENV_SCOPE, prefix) if prefix else store.read(ENV_SCOPE))
        return {env_id: EnvTally.of(bodies[env_id]) for env_id in sorted(bodies)}

    async def record_under(self, store: RecordStore, run_id: str, prefix: str, band: Band) -> Record:
        """`record`, of the tasks under an env id prefix only: the run's and every run's rows under
        it (the tasks every run fails among them, by the same rule as `failing`)."""
        run = await store.read_prefix(task_scope(run_id), prefix)
        everyone = run if not run_id else await store.read_prefix(task_scope(""), prefix)
        return Record(
            run={key: TaskTally.of(body) for key, body in run.items()},
            failing=frozenset(key for key, body in everyone.items() if is_failing(TaskTally.of(body), band)),
            quarantined=frozenset(await store.quarantined()),
        )

    async def gauges(self, every_s: float = 30.0) -> None:
        """Refresh the record's Prometheus gauges (bands and totals only: no env or task label)
        from the counts the store keeps: a few reads, whatever the record's size. Summarizes the
        library for the sampler first, once (`Summaries.warm`)."""
        try:
            await asyncio.to_thread(self.summaries.warm)
        except Exception as exc:  # the sampler summarizes on its first call instead
            log.warning("library not summarized for the sampler: %s", exc)
        while True:
            try:
                store = (await self.flushed()).store
                bands = gauge_bands(await store.counts(task_scope("")))
                for band in BANDS:
                    RECORD_TASKS.labels(band).set(bands.get(band, 0))
                RECORD_QUARANTINED.set(len(await store.quarantined()))
            except Exception as exc:  # a store down now is no reason to stop refreshing later
                log.warning("episode record gauges not refreshed: %s", exc)
            await asyncio.sleep(every_s)

    async def stats(self, request: rt.StatsRequest) -> AsyncIterator[rt.StatsResponse]:
        """Every task's (and env's) line, built page by page in a thread: a library of tens of
        thousands must not hold the event loop. What is read follows what is asked: no task of the
        record for `envs_only`, and for an `env_prefix` only the record's keys under it (one
        environment's page reads its own rows, not the record's tens of thousands)."""
        check_stats(request)
        store = (await self.flushed()).store
        prefix = request.env_prefix
        if request.envs_only:
            record = Record(run={}, failing=frozenset(), quarantined=frozenset())  # no task is shown
        elif prefix:
            record = await self.record_under(store, request.run_id, prefix, Band())
        else:
            record = await self.record(request.run_id, Band())
        envs = {} if request.tasks_only else await self.envs(store, request)
        path = self.catalog.path
        async for page in iterate_in_thread(lambda: stats_pages(path, record, envs, request)):
            for entry in page:
                yield entry

    async def sample(self, request: rt.SampleTasksRequest) -> rt.SampleTasksResponse:
        if request.n > self.max_batch * 64:
            raise Refusal(Reason.INVALID_REQUEST, f"n {request.n} exceeds {self.max_batch * 64}")
        try:
            band = Band.of(request.low, request.high, request.min_episodes)
            record = await self.record(request.run_id, band)
            return await asyncio.to_thread(sample, self.catalog.path, record, request, self.summaries)
        except ValueError as exc:
            raise Refusal(Reason.INVALID_REQUEST, str(exc)) from None

    async def history(self, request: rt.RunHistoryRequest) -> rt.RunHistoryResponse:
        """The run's pools, groups and pool moves by policy version, and its pools now with its
        played tasks' recent pass rates (the counts the record keeps); a run the record does not
        hold is refused by name."""
        store = (await self.flushed()).store
        counts = await store.counts(task_scope(request.run_id))
        pools = pool_counts(counts)
        library_tasks = await asyncio.to_thread(self.library_tasks)
        points = await store.history(request.run_id)
        if not points and (request.run_id or ALL_RUNS) not in await store.runs():
            raise Refusal(
                Reason.INVALID_REQUEST,
                f"no run {request.run_id!r} is recorded (a run is named by create_session(run_id=...); "
                f"the record keeps the last {MAX_RUNS} runs)",
            )
        return rt.RunHistoryResponse(
            points=[
                rt.RunHistoryPoint(
                    policy_version=p.version,
                    at=p.at,
                    played=p.played,
                    learnable=p.learnable,
                    mastered=p.mastered,
                    unsolved=p.unsolved,
                    groups=p.groups,
                    multi_episode_groups=p.multi_episode_groups,
                    zero_variance_groups=p.zero_variance_groups,
                    moves=[
                        rt.PoolMove(from_pool=name.partition(">")[0], to_pool=name.partition(">")[2], tasks=n)
                        for name, n in p.moves.items()
                    ],
                )
                for p in points
            ],
            now=rt.RunHistoryPoint(
                played=sum(pools.values()),
                learnable=pools["learnable"],
                mastered=pools["mastered"],
                unsolved=pools["unsolved"],
            ),
            recent_pass_rates=gauge_bands(counts),
            library_tasks=library_tasks,
        )

    def library_tasks(self) -> int:
        """The library's tasks, from its summary for the sampler (kept until the file changes)."""
        with Library(self.catalog.path, read_only=True) as library:
            return len(self.summaries.of(library, "").ids)

    async def search(self, request: rt.SearchEnvsRequest) -> rt.SearchEnvsResponse:
        """SearchEnvs: the catalog's page, each environment marked quarantined from the record (its
        set of quarantined environments: a few, never the library)."""
        page = self.catalog.search(request)
        if self.recorder is not None and page.envs:
            quarantined = await (await self.flushed()).store.quarantined()
            for env in page.envs:
                env.quarantined = env.env_id in quarantined
        return page

    async def lift_quarantine(self, request: rt.LiftQuarantineRequest) -> rt.LiftQuarantineResponse:
        store = (await self.flushed()).store
        env = await store.read_one(ENV_SCOPE, request.env_id)  # the env's record, not the run's tasks
        if not EnvTally.of(env).quarantine_reason():
            if env is None:
                self.catalog.env(request.env_id)  # ENV_NOT_FOUND for an id the library lacks
            return rt.LiftQuarantineResponse(lifted=False)
        await store.apply({(ENV_SCOPE, request.env_id): {"reset": ["window"], "lifts": 1}}, {})
        log.info("quarantine of %s lifted", request.env_id)
        return rt.LiftQuarantineResponse(lifted=True)

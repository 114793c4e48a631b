"""The record of served episodes: what each task configuration and each environment has done.

The runtime sees every episode's end, across every trainer process, and survives restarts, so it
keeps this record (issue: a curriculum from served episodes). What is recorded:

- an `EpisodeOutcome` for every episode that ended by itself: the environment said done, or the
  step cap truncated it. Infrastructure failures never end an episode (the step is retried or
  fails UNAVAILABLE with nothing applied), and a session closed before its end is not an outcome:
  neither counts;
- each served step, per environment, with its failure kind when it failed (the environment's
  error, a time-out, a sandbox limit): the evidence of an environment's health.

It is bounded by construction: per task and run a `Tally` of counters plus a window of the last
`TASK_WINDOW` outcomes and the task's groups of its `GROUP_VERSIONS` latest policy versions; per
environment counters, a window of the last `ENV_WINDOW` steps and a few examples; per run its
counts of its last `HISTORY_KEEP` policy versions; at most `MAX_RUNS` runs (the least recently seen
goes first). Never every episode.

Recording costs the step path a dict update: `Recorder` folds outcomes into deltas in memory and a
background task merges them into the store (`record_store.py`) about once a second. A delta is a
JSON object of a tally's fields, merged by the tally's declaration (`tallies.py`: counters add,
windows keep their last marks, lists their last items), the same in Python (SQLite) and Lua
(Redis), so both stores keep one format.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from codegym.server.metrics import RECORD_EVENTS
from services.runtime.tallies import EnvTally, HistoryPoint, TaskTally, group_of, merge

log = logging.getLogger(__name__)

# Runs kept; past this the run seen least recently is dropped from the record.
MAX_RUNS = 256
# Scope of the tallies of every run together.
ALL_RUNS = "*"
# Deltas held in memory before a flush is due at once (each is a distinct task or environment).
MAX_PENDING_KEYS = 20_000
FLUSH_EVERY_S = 1.0


@dataclass(frozen=True, slots=True)
class EpisodeOutcome:
    """One finished episode: what the record is made of."""

    session_id: str
    env_id: str
    config_json: str
    run_id: str
    policy_version: int | None
    reward: float
    steps: int
    ending: str  # "done" | "truncated"

    @property
    def passed(self) -> bool:
        return self.reward > 0

    @property
    def task_key(self) -> str:
        return task_key(self.env_id, self.config_json)


def task_key(env_id: str, config_json: str) -> str:
    """A task's key in the record: its env id and canonical config (env ids hold no '@')."""
    return f"{env_id}@{config_json}"


def task_scope(run_id: str) -> str:
    return f"task:{run_id or ALL_RUNS}"


ENV_SCOPE = "env"
# Sessions played by hand in the console: recorded for their own run only, never in the all-runs
# record that sampling reads.
CONSOLE_RUN = "console"


def run_scopes(run_id: str) -> set[str]:
    """The task scopes an outcome of `run_id` is recorded in: its run's and all runs'."""
    if run_id == CONSOLE_RUN:
        return {task_scope(run_id)}
    return {task_scope(run_id), task_scope("")}


def schema_of(scope: str) -> str:
    """The tally a scope's bodies are: an environment's or a task's."""
    return EnvTally.SCHEMA if scope == ENV_SCOPE else TaskTally.SCHEMA


def run_of(scope: str) -> str | None:
    """The run a task scope is of (ALL_RUNS for every run's); None for the environments'."""
    return scope.removeprefix("task:") if scope.startswith("task:") else None


class RecordStore(Protocol):
    """Where the record lives: a file beside the library, or Redis beside the sessions."""

    async def apply(self, deltas: dict[tuple[str, str], dict[str, Any]], runs: dict[str, float]) -> None:
        """Merge each (scope, key)'s delta; note when each run was last seen (and drop the oldest
        runs past `MAX_RUNS`)."""
        ...

    async def read(self, scope: str) -> dict[str, dict[str, Any]]:
        """Every key of a scope with its merged body."""
        ...

    async def read_many(self, scope: str, keys: Iterable[str]) -> dict[str, dict[str, Any]]:
        """The bodies of `keys` in a scope (keys without one left out)."""
        ...

    async def read_one(self, scope: str, key: str) -> dict[str, Any] | None: ...

    async def read_prefix(self, scope: str, prefix: str) -> dict[str, dict[str, Any]]:
        """The keys of a scope that start with `prefix` (a task key starts with its env id), with
        their bodies: what one environment's page reads, never the whole scope."""
        ...

    async def scored(self, scope: str, low: float, high: float) -> list[str]:
        """The keys of a task scope whose pool score (`tallies.pool_score`) is in [low, high]."""
        ...

    async def counts(self, scope: str) -> dict[str, int]:
        """A task scope's tasks by class (`tallies.CLASS_RANGES`), as kept: never a walk."""
        ...

    async def quarantined(self) -> set[str]:
        """The environments quarantined now."""
        ...

    async def worst_envs(self, n: int) -> list[str]:
        """The `n` environments with the highest share of failed steps (`tallies.error_score`), the
        worst first: a range of an index, whatever the record holds."""
        ...

    async def runs(self) -> set[str]:
        """The runs the record holds (ALL_RUNS among them once any episode was recorded)."""
        ...

    async def history(self, run: str) -> list[HistoryPoint]:
        """The run's pools and counts by policy version, oldest first (at most `HISTORY_KEEP`)."""
        ...

    async def close(self) -> None: ...


class Recorder:
    """Folds outcomes and steps into deltas in memory; `run()` merges them into the store.

    What is held is bounded by the number of distinct tasks and environments touched since the
    last flush; past `MAX_PENDING_KEYS` a flush is due at once, and if the store cannot take it
    (down) the deltas are dropped, counted in `codegym_record_events_total{event="dropped"}` and
    logged: the record is evidence for a sampler, never worth holding steps for.
    """

    def __init__(self, store: RecordStore, oracle_steps: Callable[[str, str], int]) -> None:
        self.store = store
        self.oracle_steps = oracle_steps
        self.deltas: dict[tuple[str, str], dict[str, Any]] = {}
        self.runs: dict[str, float] = {}
        self.due = asyncio.Event()
        self.flushed = 0

    def _delta(self, scope: str, key: str, delta: dict[str, Any]) -> None:
        held = self.deltas.get((scope, key))
        self.deltas[(scope, key)] = merge(schema_of(scope), {} if held is None else held, delta)
        if len(self.deltas) >= MAX_PENDING_KEYS:
            self.due.set()

    def step(
        self, env_id: str, config_json: str, run_id: str, failure: str | None, message: str = ""
    ) -> None:
        """A served step (a step the runtime rejected before any worker ran it is not one)."""
        mark = "." if failure is None else ("l" if failure == "sandbox_limit" else "x")
        env: dict[str, Any] = {"steps": 1, "window": mark}
        if failure is not None:
            env[failure] = 1
            env["recent_errors"] = [message[:300]]
            key = task_key(env_id, config_json)
            for scope in run_scopes(run_id):
                self._delta(scope, key, {failure: 1})
            RECORD_EVENTS.labels("failed_step").inc()
        self._delta(ENV_SCOPE, env_id, env)

    def episode(self, outcome: EpisodeOutcome) -> None:
        """A finished episode (done or truncated)."""
        delta: dict[str, Any] = {
            "episodes": 1,
            "passes": int(outcome.passed),
            "steps": outcome.steps,
            outcome.ending: 1,
            "recent": "1" if outcome.passed else "0",
        }
        if outcome.policy_version is not None:
            delta["version"] = outcome.policy_version
        for scope in run_scopes(outcome.run_id):
            # The episode's (task, policy version) group: in its run's body only (a version is a
            # run's; every run's together would mix them), never for a reward that is no number.
            grouped = (
                outcome.policy_version is not None
                and scope != task_scope("")
                and math.isfinite(outcome.reward)
            )
            extra = {"groups": [group_of(outcome.policy_version or 0, outcome.reward)]} if grouped else {}
            self._delta(scope, outcome.task_key, {**delta, **extra})
        env: dict[str, Any] = {"episodes": 1, "passes": int(outcome.passed)}
        oracle = self.oracle_steps(outcome.env_id, outcome.config_json) if outcome.passed else 0
        if oracle and outcome.steps * 4 < oracle:
            env["shortcuts"] = 1
            env["shortcut_sessions"] = [outcome.session_id]
            RECORD_EVENTS.labels("shortcut").inc()
        self._delta(ENV_SCOPE, outcome.env_id, env)
        self.runs[outcome.run_id or ALL_RUNS] = time.time()
        RECORD_EVENTS.labels("passed" if outcome.passed else "failed").inc()

    def branch(self, outcome: EpisodeOutcome) -> None:
        """A finished branch (a fork's episode): counted apart from episodes (`branches`,
        `branch_passes`), never in the pass rates, the recent window or the shortcut sentinel,
        which a prefix shared by several branches would otherwise weigh several times."""
        delta = {"branches": 1, "branch_passes": int(outcome.passed)}
        for scope in run_scopes(outcome.run_id):
            self._delta(scope, outcome.task_key, dict(delta))
        self._delta(ENV_SCOPE, outcome.env_id, dict(delta))
        self.runs[outcome.run_id or ALL_RUNS] = time.time()
        RECORD_EVENTS.labels("branch").inc()

    async def flush(self) -> None:
        """Merge what is held into the store. What the store did not take (down: a Redis restart)
        is held again, ahead of what came meanwhile, and goes with the next flush; only past
        `MAX_PENDING_KEYS` entries is it dropped and counted."""
        if not self.deltas and not self.runs:
            return
        deltas, self.deltas = self.deltas, {}
        runs, self.runs = self.runs, {}
        self.due.clear()
        try:
            await self.store.apply(deltas, runs)
            self.flushed += len(deltas)
        except Exception as exc:  # the store is down or refused: evidence for a sampler, never a step
            for key, later in self.deltas.items():
                deltas[key] = merge(schema_of(key[0]), deltas[key], later) if key in deltas else later
            self.deltas = deltas
            self.runs = {**runs, **self.runs}
            if len(self.deltas) > MAX_PENDING_KEYS:
                RECORD_EVENTS.labels("dropped").inc(len(self.deltas))
                log.warning(
                    "episode record: %d entries dropped, the store is down (%s)", len(self.deltas), exc
                )
                self.deltas, self.runs = {}, {}
            else:
                log.warning("episode record: %d entries held until the store is back (%s)", len(deltas), exc)

    async def run(self, every_s: float = FLUSH_EVERY_S) -> None:
        """Flush about every `every_s` (at once when the deltas fill up), until cancelled."""
        try:
            while True:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.due.wait(), every_s)
                await self.flush()
        finally:
            await asyncio.shield(self.flush())

"""Which tasks still teach: pools from the episode record, the sampler, and what Stats reports.

A task's pool, for a run, from the strongest evidence there is:
1. the run's own episodes (at least `min_episodes`): its pass rate over the last `POOL_WINDOW`
   episodes (two GRPO groups of 8) puts it in `unsolved` (<= low), `mastered` (>= high) or
   `learnable`; a task the run has played fewer times is `learnable` (still being measured). The
   window is short on purpose: a task the policy has just mastered gives all-pass groups (no
   advantage) for as long as older failures keep it in the band, so it leaves the band one group
   after its first all-pass group, not four;
2. every run's episodes, when they all fail it (at least `min_episodes`, rate <= low): `unsolved`;
3. the published prior (CodeGym's Qwen2.5-32B Bo4 pass rate, kept with the task), by the same
   bounds: what seeds the record before any run has played the task;
4. otherwise `unseen`.
An environment whose steps fail above `QUARANTINE_RATE` (environment errors and time-outs, over
its last steps) puts every task of it in `quarantined`: never sampled until an operator lifts it.

The sampler fills most of a choice from `learnable` and a share (`explore`) from `unseen`, caps
the tasks of one environment, and fills any shortfall from what is left (retired pools last).
Within a pool, tasks whose GRPO group is likelier to have rewards that differ go first (weighted,
not sorted: a task at a pass rate of 0.9 still gets its turns, less often than one at 0.5). The
pools are derived from the durable record every call, so they persist with it; the same seed and
record give the same choice. Everything here is plain computation over the record and a
read-only library, run in a thread so the event loop keeps serving steps.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from codegym.library.records import TaskRecord
from codegym.library.store import Library
from codegym_client.api.runtime.v1 import runtime_service_pb2 as rt
from services.runtime.episode_record import FAILURE_KINDS, task_key

# Quarantine: at least this many of an environment's recent steps, this share of them failed.
QUARANTINE_MIN_STEPS = 20
QUARANTINE_RATE = 0.5
# The share of a choice spent on tasks the run has not played. Small on purpose: an unplayed task
# drawn across a library is as likely as the library's mix to give a zero-variance group; the
# share the learnable pool cannot fill goes to unplayed tasks anyway (the fill order below).
DEFAULT_EXPLORE = 0.05
# Episodes of a task's recent window its pool is decided by (`TASK_WINDOW` are kept).
POOL_WINDOW = 16
# Episodes of one GRPO group, as the sampler weighs tasks (CodeGym's and most trainers' 8).
GROUP = 8
DEFAULT_MIN_EPISODES = 4
DEFAULT_PER_ENV_CAP = 2
# Pools in the order a shortfall is filled from.
FILL_ORDER = ("learnable", "unseen", "mastered", "unsolved")
# The published pass rate that seeds the record, most preferred first.
PRIOR_SCORES = ("qwen32b_Bo4_score", "qwen32b_Bo8_score")


@dataclass(frozen=True)
class Band:
    """The learnable band (pass rate strictly between `low` and `high`) and the evidence it needs."""

    low: float = 0.0
    high: float = 1.0
    min_episodes: int = DEFAULT_MIN_EPISODES

    @classmethod
    def of(cls, low: float, high: float, min_episodes: int) -> Band:
        if low == 0 and high == 0:
            high = 1.0
        if not (0.0 <= low < high <= 1.0):
            raise ValueError(f"the band needs 0 <= low < high <= 1, got low={low} high={high}")
        return cls(low, high, min_episodes or DEFAULT_MIN_EPISODES)

    def place(self, rate: float) -> str:
        if rate <= self.low:
            return "unsolved"
        if rate >= self.high:
            return "mastered"
        return "learnable"


def prior_of(scores: dict[str, float]) -> float | None:
    """The published pass rate a task starts from, if it has one."""
    for name in PRIOR_SCORES:
        if name in scores:
            return float(scores[name])
    return None


def recent_rate(tally: dict[str, Any], last: int = 0) -> tuple[int, float]:
    """(episodes in the recent window, or its `last` ones, and their pass rate)."""
    window = str(tally.get("recent", ""))[-last:] if last else str(tally.get("recent", ""))
    return len(window), (window.count("1") / len(window)) if window else 0.0


def pool_of(
    run: dict[str, Any] | None, everyone: dict[str, Any] | None, prior: float | None, band: Band
) -> tuple[str, float, float]:
    """The task's pool for a run, the pass rate it was placed by (see the module doc), and the
    run's pass rate as the sampler estimates it (the window's, smoothed toward one half by one
    pass and one failure: 16 passes of 16 is not a certainty)."""
    if run and int(run.get("episodes", 0)) > 0:
        seen, rate = recent_rate(run, POOL_WINDOW)
        estimate = (rate * seen + 1) / (seen + 2)
        if seen >= band.min_episodes:
            return band.place(rate), rate, estimate
        return "learnable", rate, estimate
    if everyone and int(everyone.get("episodes", 0)) >= band.min_episodes:
        seen, rate = recent_rate(everyone, POOL_WINDOW)
        if seen >= band.min_episodes and rate <= band.low:
            return "unsolved", rate, rate
    if prior is not None:
        return band.place(prior), prior, prior
    return "unseen", 0.0, 0.5


def informative(rate: float, group: int = GROUP) -> float:
    """The chance a GRPO group of `group` episodes at this pass rate has rewards that differ: the
    groups that teach (all equal, the advantage is zero)."""
    return 1.0 - rate**group - (1.0 - rate) ** group


def quarantine_reason(env: dict[str, Any] | None) -> str:
    """Why an environment is quarantined ("" when it is not), from its recent steps."""
    if not env:
        return ""
    window = str(env.get("window", ""))
    failed = window.count("x")
    if len(window) < QUARANTINE_MIN_STEPS or failed < QUARANTINE_RATE * len(window):
        return ""
    errors, timeouts = int(env.get("env_error", 0)), int(env.get("step_timeout", 0))
    return (
        f"{failed} of its last {len(window)} steps failed (environment errors or time-outs); "
        f"{errors} environment errors and {timeouts} time-outs in {int(env.get('steps', 0))} steps served"
    )


@dataclass(frozen=True)
class Record:
    """The record as one call reads it: the run's tallies, every run's, and the environments'."""

    run: dict[str, dict[str, Any]]
    everyone: dict[str, dict[str, Any]]
    envs: dict[str, dict[str, Any]]

    def quarantined(self) -> dict[str, str]:
        reasons = {env_id: quarantine_reason(body) for env_id, body in self.envs.items()}
        return {env_id: why for env_id, why in reasons.items() if why}


@dataclass(frozen=True)
class Candidate:
    ability: str
    env_id: str
    pool: str
    rate: float
    episodes: int
    estimate: float = 0.5


def candidate(task: TaskRecord, record: Record, band: Band, quarantined: Mapping[str, str]) -> Candidate:
    """The task as the sampler sees it for the run: its pool and the rates it was placed by."""
    key = task_key(task.env_id, task.config_json)
    run = record.run.get(key)
    episodes = int(run.get("episodes", 0)) if run else 0
    if task.env_id in quarantined:
        return Candidate(task.ability, task.env_id, "quarantined", 0.0, episodes)
    pool, rate, estimate = pool_of(run, record.everyone.get(key), prior_of(task.scores), band)
    return Candidate(task.ability, task.env_id, pool, rate, episodes, estimate)


def candidates(library: Library, record: Record, band: Band, prefix: str) -> Iterator[Candidate]:
    quarantined = record.quarantined()
    for task in library.iter_tasks(prefix):
        yield candidate(task, record, band, quarantined)


def sample(
    library_path: str | Path,
    record: Record,
    request: rt.SampleTasksRequest,
) -> rt.SampleTasksResponse:
    """`request.n` tasks for the run (see the module doc). Raises ValueError for a bad band."""
    band = Band.of(request.low, request.high, request.min_episodes)
    explore = request.explore if request.HasField("explore") else DEFAULT_EXPLORE
    if not 0.0 <= explore <= 1.0:
        raise ValueError(f"explore must be between 0 and 1, got {explore}")
    pools: dict[str, list[Candidate]] = {}
    with Library(library_path, read_only=True) as library:
        for candidate in candidates(library, record, band, request.env_prefix):
            pools.setdefault(candidate.pool, []).append(candidate)
    n = request.n
    envs = {c.env_id for pool in FILL_ORDER for c in pools.get(pool, [])}
    cap = request.per_env_cap or max(DEFAULT_PER_ENV_CAP, math.ceil(n / max(1, len(envs))))
    rng = random.Random(request.seed)
    per_env: Counter[str] = Counter()
    chosen: list[Candidate] = []
    taken: set[str] = set()

    def take(pool: str, wanted: int) -> None:
        """Up to `wanted` of a pool, in a random order weighted by how likely each task's group is
        to teach (`informative`: a task near a pass rate of one half before one near 0 or 1), by
        Efraimidis and Spirakis' keys: each item's u ** (1 / weight), largest first."""
        items = pools.get(pool, [])
        keys = [rng.random() ** (1.0 / max(1e-6, informative(c.estimate))) for c in items]
        order = sorted(range(len(items)), key=lambda i: keys[i], reverse=True)
        for i in order:
            if wanted <= 0:
                return
            c = items[i]
            if c.ability in taken or per_env[c.env_id] >= cap:
                continue
            chosen.append(c)
            taken.add(c.ability)
            per_env[c.env_id] += 1
            wanted -= 1

    explored = round(n * explore)
    take("unseen", explored)
    take("learnable", n - len(chosen))
    for pool in FILL_ORDER:
        take(pool, n - len(chosen))
    return rt.SampleTasksResponse(
        tasks=[
            rt.SampledTask(
                ability=c.ability, env_id=c.env_id, pool=c.pool, pass_rate=c.rate, episodes=c.episodes
            )
            for c in chosen
        ],
        pools={pool: len(items) for pool, items in pools.items()},
    )


def _counts(body: dict[str, Any], names: tuple[str, ...]) -> dict[str, int]:
    return {name: int(body[name]) for name in names if body.get(name)}


def task_stats(task: TaskRecord, record: Record, band: Band, quarantined: Mapping[str, str]) -> rt.TaskStats:
    key = task_key(task.env_id, task.config_json)
    body = record.run.get(key) or {}
    episodes = int(body.get("episodes", 0))
    passes = int(body.get("passes", 0))
    seen, recent = recent_rate(body)
    prior = prior_of(task.scores)
    stats = rt.TaskStats(
        ability=task.ability,
        env_id=task.env_id,
        episodes=episodes,
        passes=passes,
        pass_rate=passes / episodes if episodes else 0.0,
        recent_episodes=seen,
        recent_pass_rate=recent,
        mean_steps=int(body.get("steps", 0)) / episodes if episodes else 0.0,
        oracle_steps=task.solve_fc_round,
        endings=_counts(body, ("done", "truncated")),
        step_errors=_counts(body, FAILURE_KINDS),
        pool=candidate(task, record, band, quarantined).pool,
        last_policy_version=int(body.get("version", 0)),
        branches=int(body.get("branches", 0)),
        branch_passes=int(body.get("branch_passes", 0)),
    )
    if prior is not None:
        stats.prior_pass_rate = prior
    return stats


def env_stats(env_id: str, body: dict[str, Any]) -> rt.EnvStats:
    episodes = int(body.get("episodes", 0))
    passes = int(body.get("passes", 0))
    reason = quarantine_reason(body)
    return rt.EnvStats(
        env_id=env_id,
        episodes=episodes,
        passes=passes,
        pass_rate=passes / episodes if episodes else 0.0,
        steps=int(body.get("steps", 0)),
        step_errors=_counts(body, FAILURE_KINDS),
        quarantined=bool(reason),
        quarantine_reason=reason,
        shortcut_episodes=int(body.get("shortcuts", 0)),
        shortcut_sessions=[str(s) for s in body.get("shortcut_sessions", [])],
        recent_errors=[str(m) for m in body.get("recent_errors", [])],
        branches=int(body.get("branches", 0)),
        branch_passes=int(body.get("branch_passes", 0)),
    )


def stats_pages(
    library_path: str | Path, record: Record, request: rt.StatsRequest, page: int = 512
) -> Iterator[list[rt.StatsResponse]]:
    """Stats entries a page at a time: each task of the library (unless envs only), then each
    environment the record knows (of the prefix). Streamed, so 80,000 tasks are never held."""
    band = Band()
    quarantined = record.quarantined()
    entries: list[rt.StatsResponse] = []
    if not request.envs_only:
        with Library(library_path, read_only=True) as library:
            for task in library.iter_tasks(request.env_prefix):
                if request.played_only and task_key(task.env_id, task.config_json) not in record.run:
                    continue
                entries.append(rt.StatsResponse(task=task_stats(task, record, band, quarantined)))
                if len(entries) >= page:
                    yield entries
                    entries = []
    for env_id in sorted(record.envs):
        if env_id.startswith(request.env_prefix):
            entries.append(rt.StatsResponse(env=env_stats(env_id, record.envs[env_id])))
            if len(entries) >= page:
                yield entries
                entries = []
    if entries:
        yield entries


def pass_rate_bands(everyone: dict[str, dict[str, Any]]) -> Counter[str]:
    """Tasks played by any run, by recent pass-rate band (for the Prometheus gauge)."""
    bands: Counter[str] = Counter()
    for body in everyone.values():
        seen, rate = recent_rate(body)
        if not seen:
            continue
        if rate == 0:
            bands["0"] += 1
        elif rate == 1:
            bands["1"] += 1
        else:
            bands[f"{math.floor(rate * 4) / 4:.2f}-{math.floor(rate * 4) / 4 + 0.25:.2f}"] += 1
    return bands

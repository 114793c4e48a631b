"""Which tasks still teach: pools from the episode record, the sampler, and what Stats reports.

A task's pool, for a run, from the strongest evidence there is:
1. the run's own episodes (at least `min_episodes`): its pass rate over the last `POOL_WINDOW`
   episodes (two GRPO groups of 8) puts it in `unsolved` (<= low), `mastered` (>= high) or
   `learnable` (`Band.place`); a task the run has played fewer times is `learnable` (still being
   measured). The window is short on purpose: a task the policy has just mastered gives all-pass
   groups (no advantage) for as long as older failures keep it in the band, so it leaves the band
   one group after its first all-pass group, not four;
2. every run's episodes, when they all fail it (at least `min_episodes`, rate <= low): `unsolved`;
3. the published prior (CodeGym's Qwen2.5-32B Bo4 pass rate, kept with the task), by the same
   bounds: what seeds the record before any run has played the task;
4. otherwise `unseen`.
An environment whose steps fail above `QUARANTINE_RATE` (environment errors and time-outs, over
its last steps) puts every task of it in `quarantined`: never sampled until an operator lifts it.

The sampler fills most of a choice from `learnable` and a share (`explore`) from `unseen`, caps
the tasks of one environment, and fills any shortfall from what is left (retired pools last).
Within a pool, tasks whose GRPO group is likelier to have rewards that differ go first (weighted,
not sorted: a task at a pass rate of 0.9 still gets its turns, less often than one at 0.5).

What a call costs follows what it asks, not the library's size: the tasks the record knows (the
run's played ones, those every run fails, those of quarantined environments) are placed exactly;
the rest, library-sized, are counted by prior from a summary of the library (`task_draws.py`) and
drawn at random by row id, skipping what the record knows. A drawn task stands for its pool's
undrawn ones: its weighted key is the largest of that many keys (`u ** (1 / (weight * r))` for `r`
tasks of its pool per task drawn), so the known tasks compete with the whole pool, not with a
sample of it. The same seed, record and library give the same choice. Everything here is plain
computation over the record and a read-only library, run in a thread so the event loop keeps
serving steps.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from codegym.library.records import TaskRecord
from codegym.library.store import Library
from codegym_client.abilities import make_ability
from codegym_client.api.runtime.v1 import runtime_service_pb2 as rt
from codegym_client.curriculum import Band, Pool
from services.runtime.episode_record import task_key
from services.runtime.tallies import FAILURE_KINDS, POOL_WINDOW, EnvTally, TaskTally
from services.runtime.task_draws import Summaries, prior_of

# The share of a choice spent on tasks the run has not played. Small on purpose: an unplayed task
# drawn across a library is as likely as the library's mix to give a zero-variance group; the
# share the learnable pool cannot fill goes to unplayed tasks anyway (the fill order below).
DEFAULT_EXPLORE = 0.05
# Episodes of one GRPO group, as the sampler weighs tasks (CodeGym's and most trainers' 8).
GROUP = 8
DEFAULT_PER_ENV_CAP = 2
# Pools in the order a shortfall is filled from.
FILL_ORDER: tuple[Pool, ...] = ("learnable", "unseen", "mastered", "unsolved")
# Tasks of the library drawn per task asked for (at least `MIN_DRAW`); a pool the draw leaves
# short is drawn again, four times larger.
DRAW_PER_TASK = 2
MIN_DRAW = 512


@dataclass(frozen=True)
class Record:
    """The record as one call reads it: the run's played tasks (every run's, for the run ""), the
    tasks every run fails (by the call's band), and the quarantined environments."""

    run: dict[str, TaskTally]
    failing: frozenset[str]
    quarantined: frozenset[str]


@dataclass(frozen=True)
class Candidate:
    ability: str
    env_id: str
    pool: Pool
    rate: float
    episodes: int
    estimate: float = 0.5


def pool_of(
    run: TaskTally | None, failing: bool, prior: float | None, band: Band
) -> tuple[Pool, float, float]:
    """The task's pool for a run, the pass rate it was placed by (see the module doc), and the
    run's pass rate as the sampler estimates it (the window's, smoothed toward one half by one
    pass and one failure: 16 passes of 16 is not a certainty)."""
    if run is not None and run.episodes > 0:
        seen, rate = run.recent_rate(POOL_WINDOW)
        estimate = (rate * seen + 1) / (seen + 2)
        if seen >= band.min_episodes:
            return band.place(rate), rate, estimate
        return "learnable", rate, estimate
    if failing:
        return "unsolved", 0.0, 0.0
    if prior is not None:
        return band.place(prior), prior, prior
    return "unseen", 0.0, 0.5


def is_failing(everyone: TaskTally, band: Band) -> bool:
    """Whether every run's episodes of a task fail it, by the band's evidence (rule 2)."""
    seen, rate = everyone.recent_rate(POOL_WINDOW)
    return everyone.episodes >= band.min_episodes and seen >= band.min_episodes and rate <= band.low


def informative(rate: float, group: int = GROUP) -> float:
    """The chance a GRPO group of `group` episodes at this pass rate has rewards that differ: the
    groups that teach (all equal, the advantage is zero)."""
    return 1.0 - rate**group - (1.0 - rate) ** group


def candidate(task: TaskRecord, record: Record, band: Band) -> Candidate:
    """The task as the sampler sees it for the run: its pool and the rates it was placed by."""
    key = task_key(task.env_id, task.config_json)
    run = record.run.get(key)
    episodes = run.episodes if run else 0
    if task.env_id in record.quarantined:
        return Candidate(task.ability, task.env_id, "quarantined", 0.0, episodes)
    pool, rate, estimate = pool_of(run, key in record.failing, prior_of(task.scores), band)
    return Candidate(task.ability, task.env_id, pool, rate, episodes, estimate)


def under(keys: Iterable[str], prefix: str) -> list[tuple[str, str]]:
    """(env id, config) of each task key whose env id starts with `prefix`."""
    out = []
    for key in keys:
        env_id, _, config = key.partition("@")
        if env_id.startswith(prefix):
            out.append((env_id, config))
    return out


@dataclass
class Pools:
    """What the sampler chooses from: each pool's candidates with their weighted keys, and each
    pool's size (the drawn candidates stand for more)."""

    items: dict[str, list[tuple[float, Candidate]]]
    sizes: Counter[str]
    envs: int  # environments with a task that is not quarantined
    undrawn: Counter[str]  # tasks of each pool the draw left out


def pools_for(
    library: Library,
    summary_of: Summaries,
    record: Record,
    band: Band,
    prefix: str,
    draw: int,
    rng: random.Random,
) -> Pools:
    """The candidates of a choice: every task the record knows, and `draw` tasks drawn at random
    from the rest of the library (module doc)."""
    summary = summary_of.of(library, prefix)
    known: list[TaskRecord] = [
        task for _, task in library.find_tasks(under({*record.run, *record.failing}, prefix))
    ]
    known_keys = {task_key(t.env_id, t.config_json) for t in known}
    held: list[TaskRecord] = []  # tasks of quarantined environments the record does not know
    quarantined_envs = 0
    for env_id in sorted(e for e in record.quarantined if e.startswith(prefix)):
        tasks = library.tasks_of(env_id)
        quarantined_envs += bool(tasks)
        held += [t for t in tasks if task_key(t.env_id, t.config_json) not in known_keys]
    placed = [candidate(task, record, band) for task in [*known, *held]]
    sizes: Counter[str] = Counter(c.pool for c in placed)
    # The rest by prior: the summary's counts less the tasks placed above.
    rest = Counter(summary.priors)
    rest.subtract(prior_of(t.scores) for t in [*known, *held])
    rest_sizes: Counter[str] = Counter()
    for prior, count in rest.items():
        rest_sizes[band.place(prior) if prior is not None else "unseen"] += max(0, count)
    sizes.update(rest_sizes)
    drawn: list[Candidate] = []
    skip = known_keys | {task_key(t.env_id, t.config_json) for t in held}
    priors = summary.draw(rng, draw)
    for row_id, env_id, config, published in library.task_heads(priors):
        if env_id in record.quarantined or task_key(env_id, config) in skip:
            continue
        pool, rate, estimate = pool_of(None, False, priors[row_id], band)
        drawn.append(Candidate(make_ability(env_id, published), env_id, pool, rate, 0, estimate))
    stands_for: Counter[str] = Counter(c.pool for c in drawn)
    items: dict[str, list[tuple[float, Candidate]]] = {}
    for c in placed:
        items.setdefault(c.pool, []).append((weighted_key(rng, c, 1.0), c))
    for c in drawn:
        r = max(1.0, rest_sizes[c.pool] / stands_for[c.pool])
        items.setdefault(c.pool, []).append((weighted_key(rng, c, r), c))
    undrawn = Counter({pool: rest_sizes[pool] - stands_for[pool] for pool in rest_sizes})
    return Pools(items, sizes, summary.envs - quarantined_envs, +undrawn)


def weighted_key(rng: random.Random, c: Candidate, r: float) -> float:
    """Efraimidis and Spirakis' key, u ** (1 / weight), for a candidate standing for `r` tasks
    like it: the largest of `r` such keys (module doc). Larger first."""
    return rng.random() ** (1.0 / (max(1e-6, informative(c.estimate)) * r))


def choose(pools: Pools, n: int, explore: float, per_env_cap: int) -> tuple[list[Candidate], set[str]]:
    """Up to `n` of the pools (module doc): `explore` of them unseen, then learnable, then the
    fill order; at most `per_env_cap` (0: the default) per environment. Also the pools that could
    not give all that was wanted of them."""
    cap = per_env_cap or max(DEFAULT_PER_ENV_CAP, math.ceil(n / max(1, pools.envs)))
    per_env: Counter[str] = Counter()
    chosen: list[Candidate] = []
    taken: set[str] = set()
    short: set[str] = set()

    def take(pool: str, wanted: int) -> None:
        """Up to `wanted` of a pool, largest key first, within the per-environment cap."""
        for _, c in sorted(pools.items.get(pool, []), key=lambda item: item[0], reverse=True):
            if wanted <= 0:
                return
            if c.ability in taken or per_env[c.env_id] >= cap:
                continue
            chosen.append(c)
            taken.add(c.ability)
            per_env[c.env_id] += 1
            wanted -= 1
        if wanted > 0:
            short.add(pool)

    take("unseen", round(n * explore))
    take("learnable", n - len(chosen))
    for pool in FILL_ORDER:
        take(pool, n - len(chosen))
    return chosen, short


def sample(
    library_path: str | Path,
    record: Record,
    request: rt.SampleTasksRequest,
    summaries: Summaries | None = None,
) -> rt.SampleTasksResponse:
    """`request.n` tasks for the run (see the module doc). Raises ValueError for a bad band."""
    band = Band.of(request.low, request.high, request.min_episodes)
    explore = request.explore if request.HasField("explore") else DEFAULT_EXPLORE
    if not 0.0 <= explore <= 1.0:
        raise ValueError(f"explore must be between 0 and 1, got {explore}")
    n = request.n
    draw = max(MIN_DRAW, DRAW_PER_TASK * n)
    with Library(library_path, read_only=True) as library:
        summary_of = summaries or Summaries(library_path)
        while True:
            rng = random.Random(request.seed)
            pools = pools_for(library, summary_of, record, band, request.env_prefix, draw, rng)
            chosen, short = choose(pools, n, explore, request.per_env_cap)
            # A pool that gave less than wanted of it while part of it was left undrawn: what
            # the whole pool would have given is not known, so draw more, from the same seed.
            if not any(pools.undrawn[pool] for pool in short):
                break
            draw *= 4
    return rt.SampleTasksResponse(
        tasks=[
            rt.SampledTask(
                ability=c.ability, env_id=c.env_id, pool=c.pool, pass_rate=c.rate, episodes=c.episodes
            )
            for c in chosen
        ],
        pools={pool: size for pool, size in pools.sizes.items() if size},
    )


def _counts(tally: TaskTally | EnvTally, names: Iterable[str]) -> dict[str, int]:
    return {name: int(getattr(tally, name)) for name in names if getattr(tally, name)}


def task_stats(task: TaskRecord, record: Record, band: Band) -> rt.TaskStats:
    key = task_key(task.env_id, task.config_json)
    tally = record.run.get(key) or TaskTally()
    seen, recent = tally.recent_rate()
    prior = prior_of(task.scores)
    stats = rt.TaskStats(
        ability=task.ability,
        env_id=task.env_id,
        episodes=tally.episodes,
        passes=tally.passes,
        pass_rate=tally.passes / tally.episodes if tally.episodes else 0.0,
        recent_episodes=seen,
        recent_pass_rate=recent,
        mean_steps=tally.steps / tally.episodes if tally.episodes else 0.0,
        oracle_steps=task.solve_fc_round,
        endings=_counts(tally, ("done", "truncated")),
        step_errors=_counts(tally, FAILURE_KINDS),
        pool=candidate(task, record, band).pool,
        last_policy_version=tally.version,
        branches=tally.branches,
        branch_passes=tally.branch_passes,
    )
    if prior is not None:
        stats.prior_pass_rate = prior
    return stats


def env_stats(env_id: str, tally: EnvTally) -> rt.EnvStats:
    reason = tally.quarantine_reason()
    return rt.EnvStats(
        env_id=env_id,
        episodes=tally.episodes,
        passes=tally.passes,
        pass_rate=tally.passes / tally.episodes if tally.episodes else 0.0,
        steps=tally.steps,
        step_errors=_counts(tally, FAILURE_KINDS),
        quarantined=bool(reason),
        quarantine_reason=reason,
        shortcut_episodes=tally.shortcuts,
        shortcut_sessions=list(tally.shortcut_sessions),
        recent_errors=list(tally.recent_errors),
        branches=tally.branches,
        branch_passes=tally.branch_passes,
    )


def stats_pages(
    library_path: str | Path,
    record: Record,
    envs: dict[str, EnvTally],
    request: rt.StatsRequest,
    page: int = 512,
) -> Iterator[list[rt.StatsResponse]]:
    """Stats entries a page at a time: each task of the library (only those the run played with
    `played_only`: read by key, never by walking the library), then each environment of `envs`
    (of the prefix), in its order. Streamed, so 80,000 tasks are never held."""
    band = Band()
    entries: list[rt.StatsResponse] = []
    if not request.envs_only:
        with Library(library_path, read_only=True) as library:
            if request.played_only:
                found = library.find_tasks(under(record.run, request.env_prefix))
                tasks: Iterable[TaskRecord] = (task for _, task in found)
            else:
                tasks = library.iter_tasks(request.env_prefix)
            for task in tasks:
                entries.append(rt.StatsResponse(task=task_stats(task, record, band)))
                if len(entries) >= page:
                    yield entries
                    entries = []
    for env_id in envs:  # in the caller's order
        if env_id.startswith(request.env_prefix):
            entries.append(rt.StatsResponse(env=env_stats(env_id, envs[env_id])))
            if len(entries) >= page:
                yield entries
                entries = []
    if entries:
        yield entries


def gauge_bands(counts: dict[str, int]) -> dict[str, int]:
    """Tasks played by any run, by recent pass-rate band (the Prometheus gauge), from the counts
    the store keeps (`tallies.CLASS_RANGES`)."""
    return {name.removeprefix("band:"): n for name, n in counts.items() if name.startswith("band:")}

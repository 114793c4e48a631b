"""A pool of jails: hands out idle jails, replaces dead ones, keeps serving while one restarts.

Steps of a session go to the jail that holds the session resident (its live env in a process of
that jail) while that jail is up; everything else goes to any idle jail. The session-to-jail map
is only a hint: a jail that no longer holds the session serves the step cold.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import shutil
import time
from pathlib import Path
from typing import get_args

from codegym.inside.messages import Cold, EvictionReason, Request, Result
from codegym.inside.settings import JailSettings
from codegym.server.metrics import (
    CACHE_BYTES,
    CACHE_CAPACITY,
    CACHE_ENTRIES,
    CACHE_EVENTS,
    COLD_STEPS,
    EVICTIONS,
    JAILS_ALIVE,
    JAILS_RESTARTED,
    RESIDENT_BUDGET_BYTES,
    RESIDENT_CAPACITY,
    RESIDENT_COST_BYTES,
    RESIDENT_IDLE_SECONDS,
    RESIDENT_STEPS,
    RESIDENTS,
    SANDBOX_OPERATION_SECONDS,
    SANDBOX_OPERATIONS,
    SANDBOX_QUEUE_DEPTH,
    SANDBOX_RETRIES,
)
from sandbox_worker.jail import Jail, JailDied, make_workdir
from sandbox_worker.limits import detect_cgroups, isolation_summary
from sandbox_worker.residency import Lateness, Residency, default_budget_mb, sample_cost
from sandbox_worker.scheduling import COLD, OTHER, RESIDENT, JailScheduler
from sandbox_worker.settings import COST_SAMPLE_S, JailLimits

log = logging.getLogger(__name__)


def maybe_outside_fault(result: Result) -> bool:
    """A failure the request's own code may not have caused: worth one cold retry.

    Killed by a signal (SIGKILL from the OOM killer, any signal from outside the session) or a
    jail that died mid-request. Exceptions, limits the process hit itself (MemoryError, CPU,
    output) and wall-clock timeouts are the environment's answer: a timeout retried would double
    the wait the caller agreed to.
    """
    status = result.get("status")
    if status == "killed" or result.get("jail_died"):
        return True
    return status == "crashed" and int(result.get("exit_code") or 0) > 128


# Sessions remembered per worker (a hint each; the oldest are forgotten first).
AFFINITY_SIZE = 100_000
EVICTION_REASONS: frozenset[str] = frozenset(get_args(EvictionReason))
COLD_CAUSES: frozenset[str] = frozenset(get_args(Cold))


def priority(request: Request, pinned: bool) -> int:
    """Steps of sessions this worker holds first, other steps next, everything else last."""
    if request.get("op") == "release":
        return RESIDENT  # frees memory, costs nothing
    if request.get("op") == "step":
        return RESIDENT if pinned else COLD
    return OTHER


class JailPool:
    def __init__(
        self,
        size: int,
        limits: JailLimits | None = None,
        *,
        resident_memory_mb: int = 0,
        resident_cap: int = 0,
        resident_idle_s: float = 0.0,
        admit_idle_s: float = JailSettings.admit_idle_s,
        cost_sample_s: float = COST_SAMPLE_S,
        code_cache_mb: int = JailSettings.code_cache_bytes >> 20,
        immortal_preloads: bool = JailSettings.immortalize,
    ) -> None:
        """`resident_memory_mb`: memory the worker spends on resident sessions (0: a default from
        the memory it may use); `resident_cap`: most residents per jail whatever the budget (0:
        what the budget holds at the least a resident costs); `resident_idle_s`: how long a
        resident may sit idle (0: derived from its measured cost, `Residency.idle_s`);
        `cost_sample_s`: how often what a resident costs is measured again; `immortal_preloads`:
        whether the zygotes make their preloads immortal (`codegym.inside.immortal`)."""
        self.cost_sample_s = cost_sample_s
        self.size = size
        self.limits = limits or JailLimits()
        self.residency = Residency.for_budget(
            resident_memory_mb or default_budget_mb(), size, resident_cap, resident_idle_s
        )
        # Told to every jail once, at its start: they hold for every operation.
        self.settings = JailSettings(
            resident_cap=self.residency.ceiling,
            resident_idle_s=self.residency.hold_s(),
            admit_idle_s=admit_idle_s,
            resident_memory_mb=self.residency.jail_budget_bytes // (1024 * 1024),
            code_cache_bytes=code_cache_mb * 1024 * 1024,
            immortalize=immortal_preloads,
        )
        self.cgroups = detect_cgroups()
        self.isolation = isolation_summary(self.cgroups)
        self.workdir: Path = make_workdir()
        self.jails: list[Jail] = []
        self.scheduler = JailScheduler(lambda idle: min(idle, key=lambda i: self.pinned[i]))
        self.affinity: collections.OrderedDict[str, int] = collections.OrderedDict()
        self.pinned: collections.Counter[int] = collections.Counter()
        # When each pinned session's jail last answered it (the same sessions as `affinity`), and
        # how late steps have come lately beyond their sessions' think time.
        self.answered: dict[str, float] = {}
        self.lateness = Lateness()
        # Resident sessions each jail said it holds in its last answer.
        self.residents: dict[int, int] = {}
        # (entries, bytes) of each jail's compiled-code cache, as its last answer said.
        self.code_caches: dict[int, tuple[int, int]] = {}
        self.resident_steps = 0
        self._ids = itertools.count(1)
        self.replaced = 0
        self.operations = 0
        self._closed = False
        self._restarts: set[asyncio.Task[None]] = set()
        self._sampler: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if not self.cgroups:
            log.warning("cgroups are not writable here: jails are limited by rlimits only")
        self.jails = [
            Jail(i, self.limits, self.cgroups, self.workdir, self.settings) for i in range(self.size)
        ]
        try:
            await asyncio.gather(*(j.start() for j in self.jails))
        except BaseException:
            # A failed start leaves nothing behind: no jail running, no work folder in /tmp.
            await self.close()
            raise
        for index in range(self.size):
            self.scheduler.up(index)
        JAILS_ALIVE.set_function(lambda: self.alive)
        SANDBOX_QUEUE_DEPTH.set_function(lambda: self.scheduler.depth)
        RESIDENTS.set_function(lambda: sum(self.residents.values()))
        RESIDENT_CAPACITY.set_function(lambda: self.residency.cap() * self.size)
        RESIDENT_COST_BYTES.set_function(lambda: self.residency.cost_bytes)
        RESIDENT_IDLE_SECONDS.set_function(self.residency.idle_s)
        RESIDENT_BUDGET_BYTES.set(self.residency.budget_bytes)
        CACHE_CAPACITY.labels("jail_code").set(self.settings.code_cache_bytes * self.size)
        CACHE_ENTRIES.labels("jail_code").set_function(lambda: sum(e for e, _ in self.code_caches.values()))
        CACHE_BYTES.labels("jail_code").set_function(lambda: sum(b for _, b in self.code_caches.values()))
        self._sampler = asyncio.get_running_loop().create_task(self._sample_costs())
        log.info(
            "%d jails ready (%s); resident budget %d MiB: %d sessions per jail at %.1f MiB each until "
            "measured, kept for sessions stepping within %.0f s",
            self.size,
            self.isolation,
            self.residency.budget_bytes >> 20,
            self.residency.cap(),
            self.residency.cost_bytes / (1 << 20),
            self.residency.idle_s(),
        )

    async def _sample_costs(self) -> None:
        """Measure what a resident session costs, now and then, off the event loop."""
        while not self._closed:
            await asyncio.sleep(self.cost_sample_s)
            pids = [j.pid for j in self.jails if j.pid is not None and j.alive]
            try:
                cost = await asyncio.to_thread(sample_cost, pids)
            except Exception:  # a measurement is never worth a worker
                log.exception("measuring resident sessions failed")
                continue
            self.residency.measured(cost)

    @property
    def alive(self) -> int:
        return sum(1 for j in self.jails if j.alive)

    async def execute(self, request: Request, wall_ms: int, idle_ms: int = 0) -> Result:
        """Run a request on a jail (the session's, for its steps), once more when it failed in a way
        its own code may not have caused.

        A process killed by a signal (the jail's cgroup OOM killer picks the largest process, which
        may be a neighbour's victim), a jail that died under it: the request runs again, cold from
        the state it carries (the resident copy is gone after any failure), on whatever jail is
        free. Only the same failure twice is the environment's own; one that kills itself every
        time still gets its error, once.

        `idle_ms`: how long a step's session sat idle before it, by the runtime's clock (0:
        unknown), to measure how late steps reach their jail (`Lateness`).
        """
        result = await self._execute_once(request, wall_ms, idle_ms)
        if request.get("op") != "release" and maybe_outside_fault(result):
            log.info(
                "retrying %s cold after %s: %s",
                request.get("op"),
                result.get("status"),
                result.get("message"),
            )
            SANDBOX_RETRIES.labels(str(request.get("op", "")), str(result.get("status", ""))).inc()
            result = await self._execute_once(request, wall_ms)
        return result

    async def _execute_once(self, request: Request, wall_ms: int, idle_ms: int = 0) -> Result:
        session = str(request.get("session") or "")
        home = self.affinity.get(session) if session else None
        jail = self.jails[await self.scheduler.acquire(home, priority(request, home is not None))]
        answered = self.answered.get(session) if session and idle_ms > 0 else None
        if answered is not None:
            self.lateness.saw(time.monotonic() - answered - idle_ms / 1000)
        request = {
            **request,
            "id": next(self._ids),
            "cap": self.residency.cap(),
            "resident_idle_ms": int(self.residency.hold_s(self.lateness.value()) * 1000),
        }
        op = str(request.get("op", ""))
        started = time.perf_counter()
        try:
            result = await jail.execute(request, wall_ms)
        except JailDied as exc:
            log.warning("%s; replacing it", exc)
            self._replace(jail)
            SANDBOX_OPERATIONS.labels(op, "crashed").inc()
            return {
                "status": "crashed",
                "message": f"the jail serving this request died: {exc}",
                "jail_died": True,
            }
        except BaseException:
            # Cancelled mid-request: the jail's pipe may hold a half-read answer; never reuse it.
            self._replace(jail)
            raise
        self.operations += 1
        SANDBOX_OPERATIONS.labels(op, str(result.get("status", ""))).inc()
        SANDBOX_OPERATION_SECONDS.labels(op).observe(time.perf_counter() - started)
        self._account(jail.index, result, home)
        if session:
            self._pin(session, jail.index if result.pop("held", False) else None)
            self.resident_steps += bool(result.get("from_resident"))
        self.scheduler.release(jail.index)
        return result

    def _account(self, index: int, result: Result, home: int | None) -> None:
        """What the jail said about its residents: how many it holds, why a step ran cold, what it
        ended since its last answer."""
        residents = result.pop("residents", None)
        if isinstance(residents, int):
            self.residents[index] = residents
        evictions = result.pop("evictions", None)
        if isinstance(evictions, dict):
            for reason, count in evictions.items():
                if isinstance(count, int) and reason in EVICTION_REASONS:
                    EVICTIONS.labels(reason).inc(count)
        cache = result.pop("code_cache", None)
        if isinstance(cache, dict):
            self.code_caches[index] = (int(cache.get("entries", 0)), int(cache.get("bytes", 0)))
            for event in ("hit", "miss", "eviction"):
                if isinstance(cache.get(event), int) and cache[event] > 0:
                    CACHE_EVENTS.labels("jail_code", event).inc(cache[event])
        cold = result.pop("cold", None)
        if result.get("from_resident"):
            RESIDENT_STEPS.inc()
        elif cold in COLD_CAUSES:
            # Absent from a jail this worker had it in: it was evicted (or the jail restarted).
            cause = "evicted" if cold == "absent" and home is not None else cold
            COLD_STEPS.labels("new" if cause == "absent" else cause).inc()

    def sparse(self, session: str) -> None:
        """A step of `session` that runs one-shot, its session stepping further apart than a
        resident may sit idle (`Residency.worth_a_process`): any process a jail held for it has
        gone idle, or soon will, so its steps no longer go to that jail."""
        self._pin(session, None)
        COLD_STEPS.labels("sparse").inc()

    def _pin(self, session: str, index: int | None) -> None:
        old = self.affinity.pop(session, None)
        if old is not None:
            self.pinned[old] -= 1
            del self.answered[session]
        if index is None:
            return
        self.affinity[session] = index
        self.answered[session] = time.monotonic()
        self.pinned[index] += 1
        if len(self.affinity) > AFFINITY_SIZE:
            forgotten, dropped = self.affinity.popitem(last=False)
            self.pinned[dropped] -= 1
            del self.answered[forgotten]

    def _replace(self, jail: Jail) -> None:
        self.scheduler.down(jail.index)
        self.residents.pop(jail.index, None)
        self.code_caches.pop(jail.index, None)
        if self._closed:
            return
        task = asyncio.get_running_loop().create_task(self._restart(jail))
        self._restarts.add(task)
        task.add_done_callback(self._restarts.discard)

    async def _restart(self, jail: Jail) -> None:
        await jail.kill()
        delay = 0.1
        while not self._closed:
            try:
                await jail.start()
            except JailDied as exc:
                log.error("restarting jail %d failed: %s", jail.index, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            self.replaced += 1
            JAILS_RESTARTED.inc()
            self.scheduler.up(jail.index)
            return

    async def close(self) -> None:
        self._closed = True
        if self._sampler is not None:
            self._sampler.cancel()
        for task in list(self._restarts):
            task.cancel()
        await asyncio.gather(*(j.kill() for j in self.jails))
        with contextlib.suppress(OSError):
            shutil.rmtree(self.workdir)

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
from typing import Any

from codegym.metrics import (
    JAILS_ALIVE,
    JAILS_RESTARTED,
    RESIDENT_STEPS,
    SANDBOX_OPERATION_SECONDS,
    SANDBOX_OPERATIONS,
    SANDBOX_RETRIES,
)
from sandbox_worker.inside.settings import JailSettings
from sandbox_worker.jail import Jail, JailDied, make_workdir
from sandbox_worker.limits import JailLimits, detect_cgroups, isolation_summary

log = logging.getLogger(__name__)


def maybe_outside_fault(result: dict[str, Any]) -> bool:
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


class JailPool:
    def __init__(
        self,
        size: int,
        limits: JailLimits | None = None,
        *,
        resident_cap: int = JailSettings.resident_cap,
        resident_idle_s: float = JailSettings.resident_idle_s,
    ) -> None:
        self.size = size
        self.limits = limits or JailLimits()
        # Told to every jail once, at its start: they hold for every operation.
        self.settings = JailSettings(resident_cap=resident_cap, resident_idle_s=resident_idle_s)
        self.cgroups = detect_cgroups()
        self.isolation = isolation_summary(self.cgroups)
        self.workdir: Path = make_workdir()
        self.jails: list[Jail] = []
        self._free = asyncio.Condition()
        self._busy: set[int] = set()
        self._ready: set[int] = set()
        self.affinity: collections.OrderedDict[str, int] = collections.OrderedDict()
        self.pinned: collections.Counter[int] = collections.Counter()
        self.resident_steps = 0
        self._ids = itertools.count(1)
        self.replaced = 0
        self.operations = 0
        self._closed = False
        self._restarts: set[asyncio.Task[None]] = set()

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
        self._ready = set(range(self.size))
        JAILS_ALIVE.set_function(lambda: self.alive)
        log.info("%d jails ready (%s)", self.size, self.isolation)

    @property
    def alive(self) -> int:
        return sum(1 for j in self.jails if j.alive)

    async def execute(self, request: dict[str, Any], wall_ms: int) -> dict[str, Any]:
        """Run a request on a jail (the session's, for its steps), once more when it failed in a way
        its own code may not have caused.

        A process killed by a signal (the jail's cgroup OOM killer picks the largest process, which
        may be a neighbour's victim), a jail that died under it: the request runs again, cold from
        the state it carries (the resident copy is gone after any failure), on whatever jail is
        free. Only the same failure twice is the environment's own; one that kills itself every
        time still gets its error, once.
        """
        result = await self._execute_once(request, wall_ms)
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

    async def _execute_once(self, request: dict[str, Any], wall_ms: int) -> dict[str, Any]:
        session = str(request.get("session") or "")
        jail = await self._acquire(self.affinity.get(session) if session else None)
        request = {**request, "id": next(self._ids)}
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
        if result.get("resident"):
            RESIDENT_STEPS.inc()
        if session:
            kept = result.get("status") == "ok" and request.get("op") != "release"
            self._pin(session, jail.index if kept else None)
            self.resident_steps += bool(result.get("resident"))
        await self._release(jail)
        return result

    def _pin(self, session: str, index: int | None) -> None:
        old = self.affinity.pop(session, None)
        if old is not None:
            self.pinned[old] -= 1
        if index is None:
            return
        self.affinity[session] = index
        self.pinned[index] += 1
        if len(self.affinity) > AFFINITY_SIZE:
            _, dropped = self.affinity.popitem(last=False)
            self.pinned[dropped] -= 1

    async def _acquire(self, want: int | None) -> Jail:
        """The wanted jail when it is up (waiting while it is busy), else the idle jail with fewest sessions."""
        async with self._free:
            while True:
                if want is not None and want in self._ready:
                    if want not in self._busy:
                        self._busy.add(want)
                        return self.jails[want]
                else:
                    idle = [i for i in self._ready if i not in self._busy]
                    if idle:
                        index = min(idle, key=lambda i: self.pinned[i])
                        self._busy.add(index)
                        return self.jails[index]
                await self._free.wait()

    async def _release(self, jail: Jail) -> None:
        async with self._free:
            self._busy.discard(jail.index)
            self._free.notify_all()

    def _replace(self, jail: Jail) -> None:
        self._ready.discard(jail.index)
        self._busy.discard(jail.index)
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
            async with self._free:
                self._ready.add(jail.index)
                self._free.notify_all()
            return

    async def close(self) -> None:
        self._closed = True
        for task in list(self._restarts):
            task.cancel()
        await asyncio.gather(*(j.kill() for j in self.jails))
        with contextlib.suppress(OSError):
            shutil.rmtree(self.workdir)

"""A pool of jails: hands out idle jails, replaces dead ones, keeps serving while one restarts."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import shutil
from pathlib import Path
from typing import Any

from sandbox_worker.jail import Jail, JailDied, make_workdir
from sandbox_worker.limits import JailLimits, detect_cgroups, isolation_summary

log = logging.getLogger(__name__)


class JailPool:
    def __init__(self, size: int, limits: JailLimits | None = None) -> None:
        self.size = size
        self.limits = limits or JailLimits()
        self.cgroups = detect_cgroups()
        self.isolation = isolation_summary(self.cgroups)
        self.workdir: Path = make_workdir()
        self.jails: list[Jail] = []
        self._idle: asyncio.Queue[Jail] = asyncio.Queue()
        self._ids = itertools.count(1)
        self.replaced = 0
        self.operations = 0
        self._closed = False
        self._restarts: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        if not self.cgroups:
            log.warning("cgroups are not writable here: jails are limited by rlimits only")
        self.jails = [Jail(i, self.limits, self.cgroups, self.workdir) for i in range(self.size)]
        await asyncio.gather(*(j.start() for j in self.jails))
        for jail in self.jails:
            self._idle.put_nowait(jail)
        log.info("%d jails ready (%s)", self.size, self.isolation)

    @property
    def alive(self) -> int:
        return sum(1 for j in self.jails if j.alive)

    async def execute(self, request: dict[str, Any], wall_ms: int) -> dict[str, Any]:
        """Run a request on the next idle jail. A dying jail yields a CRASHED/TIMEOUT result, not an error."""
        jail = await self._idle.get()
        request = {**request, "id": next(self._ids)}
        try:
            result = await jail.execute(request, wall_ms)
        except JailDied as exc:
            log.warning("%s; replacing it", exc)
            self._replace(jail)
            return {"status": "crashed", "message": f"the jail serving this request died: {exc}"}
        except BaseException:
            # Cancelled mid-request: the jail's pipe may hold a half-read answer; never reuse it.
            self._replace(jail)
            raise
        self.operations += 1
        self._idle.put_nowait(jail)
        return result

    def _replace(self, jail: Jail) -> None:
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
            self._idle.put_nowait(jail)
            return

    async def close(self) -> None:
        self._closed = True
        for task in list(self._restarts):
            task.cancel()
        await asyncio.gather(*(j.kill() for j in self.jails))
        with contextlib.suppress(OSError):
            shutil.rmtree(self.workdir)

"""A sandbox worker process: a jail pool behind a grpc.aio server, drained on SIGTERM."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

from codegym.errors import add_lenient
from codegym.inside.settings import JailSettings
from codegym.sandbox.v1 import sandbox_service_pb2 as pb
from codegym.server.grpcutil import ManagedServer
from sandbox_worker.limits import DEFAULT_LIMITS, MAX_LIMITS, JailLimits, RequestLimits
from sandbox_worker.pool import COST_SAMPLE_S, JailPool
from sandbox_worker.service import SandboxServicer

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["SandboxService"].full_name


class SandboxWorker:
    """Owns the pool and the server; `start()` returns once every jail is up and the port is bound."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        jails: int = 2,
        jail_limits: JailLimits | None = None,
        defaults: RequestLimits = DEFAULT_LIMITS,
        maximum: RequestLimits = MAX_LIMITS,
        max_pending: int = 0,
        resident_memory_mb: int = 0,
        resident_cap: int = 0,
        resident_idle_s: float = JailSettings.resident_idle_s,
        admit_idle_s: float = JailSettings.admit_idle_s,
        resident_sample_s: float = COST_SAMPLE_S,
        code_cache_mb: int = JailSettings.code_cache_bytes >> 20,
        source_cache_mb: int = 64,
    ) -> None:
        self.pool = JailPool(
            jails,
            jail_limits,
            resident_memory_mb=resident_memory_mb,
            resident_cap=resident_cap,
            resident_idle_s=resident_idle_s,
            admit_idle_s=admit_idle_s,
            cost_sample_s=resident_sample_s,
            code_cache_mb=code_cache_mb,
        )
        self.servicer = SandboxServicer(
            self.pool,
            defaults=defaults,
            maximum=maximum,
            max_pending=max_pending,
            source_cache_bytes=source_cache_mb * 1024 * 1024,
        )
        self.managed = ManagedServer([SERVICE_NAME], host=host, port=port)
        add_lenient(self.servicer, self.managed.server, pb.DESCRIPTOR.services_by_name["SandboxService"], pb)

    @property
    def address(self) -> str:
        return self.managed.address

    async def start(self) -> None:
        await self.pool.start()
        await self.managed.start()
        log.info("sandbox worker on %s with %d jails (%s)", self.address, self.pool.size, self.pool.isolation)

    def banner(self) -> str:
        return f"sandbox worker listening on {self.address} ({self.pool.size} jails, {self.pool.isolation})"

    async def stop(self, grace_s: float = 5.0) -> None:
        self.servicer.draining = True
        await self.managed.drain(grace_s, lambda: len(self.servicer.pending))
        await self.pool.close()


@contextlib.asynccontextmanager
async def worker_target(target: str, jails: int = 2) -> AsyncIterator[str]:
    """`target` itself, or (when empty) the address of a worker started here for the duration."""
    if target:
        yield target
        return
    worker = SandboxWorker(jails=jails)
    await worker.start()
    try:
        yield worker.address
    finally:
        await worker.stop(grace_s=0)

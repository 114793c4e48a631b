"""A sandbox worker process: a jail pool behind a grpc.aio server, drained on SIGTERM."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

from codegym.errors import add_lenient
from codegym.sandbox.v1 import sandbox_service_pb2 as pb
from codegym.server.auth import ServerAuth
from codegym.server.grpcutil import ManagedServer
from sandbox_worker.pool import JailPool
from sandbox_worker.service import SandboxServicer
from sandbox_worker.settings import MAX_LIMITS, SandboxSettings

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["SandboxService"].full_name


class SandboxWorker:
    """Owns the pool and the server; `start()` returns once every jail is up and the port is bound."""

    def __init__(self, settings: SandboxSettings, *, auth: ServerAuth | None = None) -> None:
        """`auth`: what `settings.access` loads to, when the caller holds it already (in memory)."""
        self.settings = settings
        self.pool = JailPool(
            settings.jails,
            settings.jail,
            resident_memory_mb=settings.resident_memory_mb,
            resident_cap=settings.resident_cap,
            resident_idle_s=settings.resident_idle_s,
            admit_idle_s=settings.admit_idle_s,
            cost_sample_s=settings.resident_sample_s,
            code_cache_mb=settings.code_cache_mb,
            immortal_preloads=not settings.mortal_preloads,
        )
        self.servicer = SandboxServicer(
            self.pool,
            defaults=settings.defaults,
            maximum=MAX_LIMITS,
            max_pending=settings.max_pending,
            source_cache_bytes=settings.source_cache_mb * 1024 * 1024,
        )
        self.managed = ManagedServer(
            [SERVICE_NAME],
            host=settings.host,
            port=settings.port,
            auth=ServerAuth.load(settings.access) if auth is None else auth,
        )
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
    # A private worker on loopback, for this process alone: it takes no tokens.
    worker = SandboxWorker(SandboxSettings(port=0, jails=jails), auth=ServerAuth())
    await worker.start()
    try:
        yield worker.address
    finally:
        await worker.stop(grace_s=0)

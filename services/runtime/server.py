"""A runtime process: the library read on demand, a session store, a channel to the sandbox workers."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from codegym.server.auth import ServerAuth
from codegym.server.grpcutil import ManagedServer
from codegym_client.api.runtime.v1 import runtime_service_pb2 as rt
from services.dispatcher import SandboxDispatcher
from services.runtime.captures import CaptureStore
from services.runtime.catalog import Catalog
from services.runtime.checkpoints import Keyring
from services.runtime.episode_record import Recorder, RecordStore
from services.runtime.service import RuntimeServicer, add_to_server
from services.runtime.sessions import HistoryBounds, InMemorySessionStore, SessionStore
from services.runtime.settings import RuntimeSettings
from services.runtime.tenancy import Quotas

log = logging.getLogger(__name__)
SERVICE_NAME = rt.DESCRIPTOR.services_by_name["RuntimeService"].full_name


class RuntimeServer:
    """Build inside the running event loop (grpc.aio objects bind to it)."""

    def __init__(
        self,
        settings: RuntimeSettings,
        *,
        auth: ServerAuth | None = None,
        store: SessionStore | None = None,
        record: RecordStore | None = None,
        checkpoint_keys: Keyring | None = None,
        captures: CaptureStore | None = None,
    ) -> None:
        """`auth`: what `settings.access` loads to, when the caller holds it already (in memory);
        `store`: the session store (default: Redis when `settings.sessions` names it, else this
        process's memory); `record`: where the episode record is kept (None: no record, `--no-record`);
        `checkpoint_keys`: the deployment's checkpoint keys (default: the files `settings` names;
        none: checkpoints are refused); `captures`: where captured episodes are kept (default: this
        process's memory; none with `--no-capture`)."""
        auth = ServerAuth.load(settings.access) if auth is None else auth
        self.settings = settings
        self.catalog = Catalog(settings.library, cache_bytes=settings.env_cache_mb * 1024 * 1024)
        self.dispatcher = SandboxDispatcher(settings.sandbox, access=settings.calls.access())
        self.recorder = None if record is None else Recorder(record, self.catalog.oracle_steps)
        self.servicer = RuntimeServicer(
            self.catalog,
            store or session_store(settings),
            self.dispatcher,
            settings.config,
            self.recorder,
            Quotas(auth.limits),
            checkpoint_keys or Keyring.load(settings.checkpoint_key, settings.checkpoint_primary),
            None if settings.config.no_capture else captures or memory_captures(settings),
        )
        self._background: list[asyncio.Task[None]] = []
        self.managed = ManagedServer([SERVICE_NAME], host=settings.host, port=settings.port, auth=auth)
        add_to_server(self.servicer, self.managed.server)
        self._reaper: asyncio.Task[None] | None = None

    @property
    def address(self) -> str:
        return self.managed.address

    async def start(self) -> None:
        await self.managed.start()
        self._reaper = asyncio.get_running_loop().create_task(self.servicer.reaper())
        if self.recorder is not None:
            loop = asyncio.get_running_loop()
            self._background = [
                loop.create_task(self.recorder.run()),
                loop.create_task(self.servicer.desk.gauges()),
            ]
        log.info("runtime on %s serving %d environments", self.address, len(self.catalog))

    def banner(self) -> str:
        return f"runtime listening on {self.address} ({len(self.catalog)} environments)"

    async def stop(self, grace_s: float = 5.0) -> None:
        # New calls are refused by gRPC as the drain starts; steps sent on open StepStream calls
        # are refused by the servicer (nothing applied, the client sends them elsewhere).
        self.servicer.draining = True
        await self.managed.drain(grace_s)
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        for task in self._background:  # the recorder writes what it holds as it stops
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.recorder is not None:
            await self.recorder.store.close()
        if self.servicer.captures.store is not None:
            await self.servicer.captures.store.close()
        await self.dispatcher.close()
        close = getattr(self.servicer.store, "close", None)
        if close is not None:
            await close()
        self.catalog.close()


def session_store(settings: RuntimeSettings) -> SessionStore:
    """Sessions in Redis, shared by the replicas, when `--sessions` names it; else in this process."""
    history = HistoryBounds(settings.config.history_steps, settings.config.history_entries)
    if not settings.sessions:
        return InMemorySessionStore(history)
    from services.runtime.redis_store import RedisSessionStore

    return RedisSessionStore(
        settings.sessions, settings.config.session_ttl_s, lease_s=settings.step_lease_s, history=history
    )


def memory_captures(settings: RuntimeSettings) -> CaptureStore:
    """Captured episodes kept in this process (a runtime given no store for them)."""
    from services.runtime.capture_store import SqliteCaptureStore

    return SqliteCaptureStore(":memory:", settings.config.capture_bytes)

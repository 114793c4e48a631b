"""A runtime process: the library read on demand, a session store, a channel to the sandbox workers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from pathlib import Path

from codegym.server.auth import configured
from codegym.server.grpcutil import ManagedServer
from codegym_client.api.runtime.v1 import runtime_service_pb2 as rt
from services.dispatcher import SandboxDispatcher
from services.runtime.captures import CaptureStore
from services.runtime.catalog import Catalog
from services.runtime.checkpoints import Keyring
from services.runtime.episode_record import Recorder, RecordStore
from services.runtime.service import RuntimeConfig, RuntimeServicer, add_to_server
from services.runtime.sessions import HistoryBounds, InMemorySessionStore, SessionStore
from services.runtime.tenancy import Quotas

log = logging.getLogger(__name__)
SERVICE_NAME = rt.DESCRIPTOR.services_by_name["RuntimeService"].full_name


class RuntimeServer:
    """Build inside the running event loop (grpc.aio objects bind to it)."""

    def __init__(
        self,
        library: str | Path,
        sandbox: str | Sequence[str],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        config: RuntimeConfig | None = None,
        store: SessionStore | None = None,
        env_cache_mb: int = 32,
        record: RecordStore | None = None,
        checkpoint_keys: Keyring | None = None,
        captures: CaptureStore | None = None,
    ) -> None:
        """`record`: where the episode record is kept (None: no record, `--no-record`);
        `checkpoint_keys`: the deployment's checkpoint keys (None: checkpoints are refused);
        `captures`: where captured episodes are kept (None: in memory, unless the config's
        capture rate is below 0, `--no-capture`)."""
        config = config or RuntimeConfig()
        self.catalog = Catalog(library, cache_bytes=env_cache_mb * 1024 * 1024)
        self.dispatcher = SandboxDispatcher(sandbox)
        self.recorder = None if record is None else Recorder(record, self.catalog.oracle_steps)
        self.servicer = RuntimeServicer(
            self.catalog,
            store or InMemorySessionStore(HistoryBounds(config.history_steps, config.history_entries)),
            self.dispatcher,
            config,
            self.recorder,
            Quotas(configured().limits),
            checkpoint_keys,
            captures if captures is not None or config.capture_rate < 0 else memory_captures(config),
        )
        self._background: list[asyncio.Task[None]] = []
        self.managed = ManagedServer([SERVICE_NAME], host=host, port=port)
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


def memory_captures(config: RuntimeConfig) -> CaptureStore:
    """Captures kept in this process (a runtime with no record file or Redis to keep them in)."""
    from services.runtime.capture_store import SqliteCaptureStore

    return SqliteCaptureStore(":memory:", config.capture_bytes)

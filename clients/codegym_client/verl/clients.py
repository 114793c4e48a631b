"""The runtime clients verl's agent loops and tools share. No verl here.

verl builds an agent loop per row and a tool instance per call, not one per process, so a client
made by each would open a channel per row: `shared_client` keeps one `AsyncRuntimeClient` per
target and running event loop instead (a gRPC aio channel belongs to its loop).
"""

from __future__ import annotations

import asyncio
import threading
import weakref

from codegym_client.async_client import AsyncRuntimeClient

__all__ = ["shared_client"]

_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, AsyncRuntimeClient]] = (
    weakref.WeakKeyDictionary()
)
_clients_lock = threading.Lock()


def shared_client(target: str, timeout_s: float = 60.0) -> AsyncRuntimeClient:
    """One `AsyncRuntimeClient` per target and running event loop (a gRPC aio channel belongs to
    its loop): verl builds an agent loop, and a tool instance, per row or call, not per process."""
    loop = asyncio.get_running_loop()
    with _clients_lock:
        clients = _clients.setdefault(loop, {})
        client = clients.get(target)
        if client is None:
            client = clients[target] = AsyncRuntimeClient(target, timeout_s=timeout_s)
        return client

"""The runtime clients, and the outage clocks, verl's agent loops and tools share. No verl here.

verl builds an agent loop per row and a tool instance per call, not one per process, so a client
made by each would open a channel per row: `shared_client` keeps one `AsyncRuntimeClient` per
target and running event loop instead (a gRPC aio channel belongs to its loop). Likewise an outage
is waited out once by all the episodes of a process, not once per episode: `shared_outage` keeps
one `Outage` clock per target and wait (as TRL's spec keeps one for its environments).
"""

from __future__ import annotations

import asyncio
import threading
import weakref

from codegym_client.async_client import AsyncRuntimeClient
from codegym_client.outages import DEFAULT_OUTAGE_WAIT_S, Outage

__all__ = ["shared_client", "shared_outage"]

_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, AsyncRuntimeClient]] = (
    weakref.WeakKeyDictionary()
)
_clients_lock = threading.Lock()
_outages: dict[tuple[str, float], Outage] = {}


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


def shared_outage(target: str, wait_s: float = DEFAULT_OUTAGE_WAIT_S) -> Outage:
    """One `Outage` clock per target and wait, for the process: the calls of all its episodes (the
    agent loops' and the tools') wait an outage of that runtime out once, counted from the first
    call it failed; once the wait is over, each call is sent once until one is answered."""
    key = (target, max(0.0, float(wait_s)))
    with _clients_lock:
        outage = _outages.get(key)
        if outage is None:
            outage = _outages[key] = Outage(key[1])
        return outage

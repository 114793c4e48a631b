"""What the services' web front ends (the OpenEnv gateway, the console) share: the tenant they name
on their own calls to the runtime, and serving an ASGI app with uvicorn on a socket bound here.

A front end calls the runtime on one token, its own (`service`); without more, the runtime's
per-tenant quotas and session ownership would see one tenant for every person or OpenEnv client
behind it. So each call made for a caller carries the caller's tenant in `codegym-tenant` metadata,
which the runtime honours from service and operator tokens only (`codegym.server.auth.forwarded`)
and runs the call as that tenant's trainer.

The tenant travels in a context variable set around each call (`playing_for`) and read by client
interceptors, because the runtime client's methods take no metadata and a close runs long after the
request that opened the episode: each call names the tenant of the connection it is made for.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import socket
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import grpc
import uvicorn

from codegym.server.auth import TENANT_METADATA

# The tenant the runtime calls being made are for ("": no access tokens, nothing named).
PLAYING_FOR: contextvars.ContextVar[str] = contextvars.ContextVar("codegym_playing_for", default="")


@contextlib.contextmanager
def playing_for(tenant: str) -> Iterator[None]:
    """Runtime calls made inside the block name `tenant` (none when it is "")."""
    reset = PLAYING_FOR.set(tenant)
    try:
        yield
    finally:
        PLAYING_FOR.reset(reset)


class ForwardTenant(grpc.aio.UnaryUnaryClientInterceptor):
    """Adds `codegym-tenant: <tenant>` to every unary call made inside `playing_for(tenant)`."""

    async def intercept_unary_unary(
        self,
        continuation: Callable[[grpc.aio.ClientCallDetails, Any], Awaitable[Any]],
        client_call_details: grpc.aio.ClientCallDetails,
        request: Any,
    ) -> Any:
        tenant = PLAYING_FOR.get()
        if tenant:
            metadata = grpc.aio.Metadata(*tuple(client_call_details.metadata or ()))
            metadata.add(TENANT_METADATA, tenant)
            client_call_details = client_call_details._replace(metadata=metadata)
        return await continuation(client_call_details, request)


class ForwardTenantStream(grpc.aio.UnaryStreamClientInterceptor):
    """The same on every server-streamed call (the console reads `Stats`)."""

    async def intercept_unary_stream(
        self,
        continuation: Callable[[grpc.aio.ClientCallDetails, Any], Awaitable[Any]],
        client_call_details: grpc.aio.ClientCallDetails,
        request: Any,
    ) -> Any:
        tenant = PLAYING_FOR.get()
        if tenant:
            metadata = grpc.aio.Metadata(*tuple(client_call_details.metadata or ()))
            metadata.add(TENANT_METADATA, tenant)
            client_call_details = client_call_details._replace(metadata=metadata)
        return await continuation(client_call_details, request)


class QuietServer(uvicorn.Server):
    """uvicorn's server without its signal handling (which re-raises SIGTERM after a graceful stop):
    `serve` stops it on SIGTERM and SIGINT through the loop, and the process exits 0."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


async def serve_announced(server: QuietServer, sock: socket.socket, line: Callable[[str], str]) -> None:
    """Serve `server` on `sock` until it exits; once it is up, print `line("HOST:PORT")` with the
    address it is bound to: the announcement `codegym up`, the tests and the benches wait for."""
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.01)
    if server.started:
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        print(line(f"{shown}:{port}"), flush=True)
    await task

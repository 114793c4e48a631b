"""The gateway names its caller's tenant on its own calls to the runtime.

The gateway calls the runtime on one token, its own (`service`); without more, the runtime's
per-tenant quotas and session ownership would see one tenant for every OpenEnv client. So each call
made for a connection carries the connection's tenant in `codegym-tenant` metadata, which the
runtime honours from service and operator tokens only (`codegym.server.auth.forwarded`) and runs the call
as that tenant's trainer.

The tenant travels in a context variable set around each call (`playing_for`) and read by a client
interceptor, because the runtime client's methods take no metadata and a close runs long after the
request that opened the episode: each call names the tenant of the connection it is made for.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import grpc

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
    """Adds `codegym-tenant: <tenant>` to every unary call made inside `playing_for(tenant)` (the
    gateway's calls to the runtime are all unary: create, step, close, get_env)."""

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

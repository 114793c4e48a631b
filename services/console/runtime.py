"""The console's calls to the runtime, made for the person signed in.

The console calls on one token, its own (`CODEGYM_TOKEN`: the service token under `codegym up
--auth` and in k8s), as the OpenEnv gateway does, and names a trainer's tenant on each call
(`codegym-tenant` metadata, which the runtime honours from service and operator tokens only), so the
runtime's quotas, session ownership and capture visibility are the trainer's. An operator's calls
name no tenant: they run as the console's own identity, which sees every tenant.

The tenant travels in the gateway's context variable (`services.openenv.forwarding.playing_for`);
the gateway's interceptor covers unary calls, and `ForwardTenantStream` here the one streamed call
the console makes (`Stats`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from codegym.server.auth import TENANT_METADATA
from codegym_client.async_client import AsyncRuntimeClient
from services.openenv.forwarding import PLAYING_FOR, ForwardTenant, playing_for

__all__ = ["ForwardTenantStream", "connect", "playing_for"]


class ForwardTenantStream(grpc.aio.UnaryStreamClientInterceptor):
    """`codegym-tenant: <tenant>` on every server-streamed call made inside `playing_for(tenant)`."""

    async def intercept_unary_stream(
        self,
        continuation: Callable[[grpc.aio.ClientCallDetails, Any], Awaitable[Any]],
        client_call_details: grpc.aio.ClientCallDetails,
        request: Any,
    ) -> AsyncIterator[Any] | Any:
        tenant = PLAYING_FOR.get()
        if tenant:
            metadata = grpc.aio.Metadata(*tuple(client_call_details.metadata or ()))
            metadata.add(TENANT_METADATA, tenant)
            client_call_details = client_call_details._replace(metadata=metadata)
        return await continuation(client_call_details, request)


def connect(target: str, timeout_s: float = 30.0) -> AsyncRuntimeClient:
    """A runtime client whose calls name the tenant of `playing_for`; make it in the event loop."""
    return AsyncRuntimeClient(
        target, timeout_s=timeout_s, interceptors=[ForwardTenant(), ForwardTenantStream()]
    )

"""Server plumbing shared by every service: options, health, reflection, drain, access.

Channels (the clients' side: load balancing, retries, message sizes) come from the one channel
factory, `codegym_client.channels`, which trainers install too; what only servers need stays here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from codegym.server.auth import AuthInterceptor, ServerAuth, check_bind
from codegym.server.metrics import MetricsInterceptor
from codegym_client.channels import MAX_MESSAGE_BYTES, Access, sync_channel

log = logging.getLogger(__name__)

HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
# How often a drain looks whether the servicer's calls have finished.
DRAIN_POLL_S = 0.02

SERVER_OPTIONS: list[tuple[str, Any]] = [
    # Two servers must never share a port by accident (gRPC sets SO_REUSEPORT by default).
    ("grpc.so_reuseport", 0),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # Recycle connections so that clients using round_robin over DNS pick up new replicas.
    ("grpc.max_connection_age_ms", 5 * 60 * 1000),
    ("grpc.max_connection_age_grace_ms", 30 * 1000),
    ("grpc.keepalive_time_ms", 60 * 1000),
    ("grpc.http2.min_ping_interval_without_data_ms", 10 * 1000),
]


def wait_serving(
    address: str, service: str = "", timeout_s: float = 30.0, access: Access | None = None
) -> None:
    """Block until `address` answers SERVING on `grpc.health.v1` (for `service`, "" = the server).

    Health takes no token; `access` (default: the environment's) only says whether to speak TLS."""
    deadline = time.monotonic() + timeout_s
    access = access or Access.from_env()
    plain = Access(tls=access.tls, tls_ca=access.tls_ca)
    with sync_channel(address, [HEALTH_SERVICE], retry=False, access=plain) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    raise TimeoutError(f"{address} is not serving after {timeout_s:.0f}s")


class ManagedServer:
    """A grpc.aio server with health and reflection that drains on SIGTERM/SIGINT.

    `auth` (the server's settings loaded, `codegym.server.settings.Access.load`; None: no tokens, no
    TLS): the access tokens every call but health and reflection must carry, and the TLS certificate the
    port serves. With `auth.health_port`, a second, plain-text port serves health alone (probes).
    """

    def __init__(
        self,
        service_names: Sequence[str],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        auth: ServerAuth | None = None,
    ) -> None:
        auth = auth or ServerAuth()
        check_bind(host, auth)
        interceptors: list[grpc.aio.ServerInterceptor] = [MetricsInterceptor()]
        if auth.enabled:  # after the metrics: a refused call is counted with its code
            interceptors.append(AuthInterceptor(auth.tokens))
        self.auth = auth
        self.server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=interceptors)
        self.health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = list(service_names)
        reflection.enable_server_reflection(
            [
                *self.service_names,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ],
            self.server,
        )
        self.port = bind(self.server, host, port, auth)
        self.address = f"{host}:{self.port}" if ":" not in host else f"[{host}]:{self.port}"
        self.probes: grpc.aio.Server | None = None
        if auth.health_port >= 0:
            self.probes = grpc.aio.server(options=SERVER_OPTIONS)
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.probes)
            self.health_port = bind(self.probes, host, auth.health_port, ServerAuth())
        self._stopped = asyncio.Event()

    @property
    def tls(self) -> bool:
        return self.auth.tls_cert is not None

    async def start(self) -> None:
        await self.server.start()
        if self.probes is not None:
            await self.probes.start()
        for name in ["", *self.service_names]:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def drain(self, grace_s: float = 10.0, in_flight: Callable[[], int] | None = None) -> None:
        """Stop taking new calls (NOT_SERVING for load balancers), let running calls finish.

        With `in_flight` (the calls the servicer holds, which refuses new ones itself while it
        drains), the server keeps accepting until they are done or the grace is spent: a caller
        that had not yet seen NOT_SERVING gets the servicer's typed refusal (UNAVAILABLE with its
        reason: send it elsewhere) instead of the CANCELLED of a server shutting down, which
        cannot say whether the call ran.
        """
        deadline = time.monotonic() + grace_s
        await self.health.enter_graceful_shutdown()
        if in_flight is not None:
            while in_flight() and time.monotonic() < deadline:
                await asyncio.sleep(DRAIN_POLL_S)
        await self.server.stop(max(0.0, deadline - time.monotonic()))
        if self.probes is not None:
            await self.probes.stop(0)
        self._stopped.set()

    async def wait_for_signal(self) -> None:
        """Return on SIGTERM or SIGINT (the caller then drains and stops)."""
        stop = asyncio.Event()
        self.install_signal_handlers(stop.set)
        await stop.wait()

    def install_signal_handlers(self, on_signal: Any) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, on_signal)

    async def wait(self) -> None:
        await self._stopped.wait()


def bind(server: grpc.aio.Server, host: str, port: int, auth: ServerAuth) -> int:
    """Add `host:port` to `server` (TLS with `auth`'s certificate); the port bound."""
    address = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
    try:
        if auth.tls_cert is not None and auth.tls_key is not None:
            credentials = grpc.ssl_server_credentials([(auth.tls_key, auth.tls_cert)])
            bound = server.add_secure_port(address, credentials)
        else:
            bound = server.add_insecure_port(address)
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise OSError(f"cannot bind {address}: address in use or not available")
    return bound

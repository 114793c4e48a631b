"""Server plumbing shared by every service: options, health, reflection, drain.

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

from codegym.metrics import MetricsInterceptor
from codegym_client.channels import MAX_MESSAGE_BYTES

log = logging.getLogger(__name__)

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


def wait_serving(address: str, service: str = "", timeout_s: float = 30.0) -> None:
    """Block until `address` answers SERVING on `grpc.health.v1` (for `service`, "" = the server)."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
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
    """A grpc.aio server with health and reflection that drains on SIGTERM/SIGINT."""

    def __init__(self, service_names: Sequence[str], *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=[MetricsInterceptor()])
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
        try:
            self.port = self.server.add_insecure_port(f"{host}:{port}")
        except RuntimeError:
            self.port = 0
        if self.port == 0:
            raise OSError(f"cannot bind {host}:{port}: address in use or not available")
        self.address = f"{host}:{self.port}" if ":" not in host else f"[{host}]:{self.port}"
        self._stopped = asyncio.Event()

    async def start(self) -> None:
        await self.server.start()
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

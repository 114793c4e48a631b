"""Server and channel helpers shared by every service: health, reflection, drain, retries.

Load balancing, retries and connection recycling are configuration (a service config and channel
options), not code, so every client and server in the project gets them the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import time
from collections.abc import Iterable, Sequence
from typing import Any

import grpc

# Health checking and reflection are imported where servers (and the health wait) use them: a
# trainer's client install has grpcio and protobuf only, and channels need nothing more.

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 16 * 1024 * 1024
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


def service_config(
    service_names: Iterable[str],
    *,
    retry: bool = True,
    timeout_s: float | None = None,
    health_service: str | None = None,
    no_retry: Iterable[tuple[str, str]] = (),
) -> str:
    """`round_robin` over all resolved addresses; retry on UNAVAILABLE.

    `no_retry` names (service, method) pairs that must not be retried by the channel (calls that
    change state and are not idempotent). With `health_service`, the channel watches each backend's
    `grpc.health.v1` status and sends nothing to one that is draining or down.
    """
    method: dict[str, Any] = {"name": [{"service": name} for name in service_names]}
    if retry:
        method["retryPolicy"] = {
            "maxAttempts": 5,
            "initialBackoff": "0.05s",
            "maxBackoff": "1s",
            "backoffMultiplier": 2,
            "retryableStatusCodes": ["UNAVAILABLE"],
        }
    if timeout_s is not None:
        method["timeout"] = f"{timeout_s}s"
    methods = [method]
    exact = [{"service": service, "method": name} for service, name in no_retry]
    if exact:
        plain: dict[str, Any] = {"name": exact}
        if timeout_s is not None:
            plain["timeout"] = f"{timeout_s}s"
        methods.append(plain)
    config: dict[str, Any] = {"loadBalancingConfig": [{"round_robin": {}}], "methodConfig": methods}
    if health_service is not None:
        config["healthCheckConfig"] = {"serviceName": health_service}
    return json.dumps(config)


def target_for(addresses: str | Sequence[str]) -> str:
    """One channel target for one or many `host:port` addresses (static list → `ipv4:`/`ipv6:` URI)."""
    items = [
        a.strip() for a in (addresses.split(",") if isinstance(addresses, str) else addresses) if a.strip()
    ]
    if not items:
        raise ValueError("no address given")
    if len(items) == 1 and ("://" in items[0] or items[0].startswith("dns:")):
        return items[0]
    if all(a.startswith("[") for a in items):
        return "ipv6:" + ",".join(items)
    if all(a.split(":")[0].replace(".", "").isdigit() for a in items):
        return "ipv4:" + ",".join(items)
    if len(items) == 1:
        return f"dns:///{items[0]}"
    raise ValueError("several addresses must be IP literals; use one dns:/// name for a headless service")


def channel_options(
    service_names: Iterable[str],
    *,
    retry: bool = True,
    health_service: str | None = None,
    no_retry: Iterable[tuple[str, str]] = (),
) -> list[tuple[str, Any]]:
    config = service_config(service_names, retry=retry, health_service=health_service, no_retry=no_retry)
    return [
        ("grpc.service_config", config),
        ("grpc.enable_retries", 1 if retry else 0),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        # A restarted backend is found again within a second or two (the default backoff grows to 2 min).
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 2000),
    ]


def aio_channel(
    addresses: str | Sequence[str],
    service_names: Iterable[str],
    *,
    retry: bool = True,
    health_service: str | None = None,
    no_retry: Iterable[tuple[str, str]] = (),
) -> grpc.aio.Channel:
    options = channel_options(service_names, retry=retry, health_service=health_service, no_retry=no_retry)
    return grpc.aio.insecure_channel(target_for(addresses), options=options)


def sync_channel(
    addresses: str | Sequence[str],
    service_names: Iterable[str],
    *,
    retry: bool = True,
    health_service: str | None = None,
    no_retry: Iterable[tuple[str, str]] = (),
) -> grpc.Channel:
    options = channel_options(service_names, retry=retry, health_service=health_service, no_retry=no_retry)
    return grpc.insecure_channel(target_for(addresses), options=options)


def wait_serving(address: str, service: str = "", timeout_s: float = 30.0) -> None:
    """Block until `address` answers SERVING on `grpc.health.v1` (for `service`, "" = the server)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

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
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        from grpc_health.v1.health import aio as health_aio
        from grpc_reflection.v1alpha import reflection

        from codegym.metrics import MetricsInterceptor

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
        from grpc_health.v1 import health_pb2

        await self.server.start()
        for name in ["", *self.service_names]:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def drain(self, grace_s: float = 10.0) -> None:
        """Stop taking new calls (NOT_SERVING for load balancers), let running calls finish."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
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

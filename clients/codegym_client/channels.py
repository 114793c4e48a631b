"""The one channel factory: every client of a CodeGym server gets its channel here.

Load balancing, retries and connection recycling are configuration (a service config and channel
options), not code, so the trainers' runtime clients and the servers' channels to each other (the
runtime and verification to sandbox workers, the pipeline to its services) behave the same way.
Only grpcio is needed: a trainer's install has grpcio and protobuf and nothing else.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

import grpc

__all__ = [
    "HEALTH_CHECK",
    "HEALTH_REQUEST",
    "MAX_MESSAGE_BYTES",
    "PROBE_TIMEOUT_S",
    "aio_channel",
    "channel_options",
    "service_config",
    "sync_channel",
    "target_for",
    "target_text",
]

# The largest message either side sends or takes (servers set the same, codegym/grpcutil.py).
MAX_MESSAGE_BYTES = 16 * 1024 * 1024

# grpc.health.v1's HealthCheckRequest for the whole server is the empty message: sent as raw bytes
# on a channel's `unary_unary(HEALTH_CHECK)`, so a client needs no health-checking package. The
# method is outside every channel's retry policy: a probe fails at once, with its cause.
HEALTH_REQUEST = b""
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
PROBE_TIMEOUT_S = 1.0


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


def target_text(target: str | Sequence[str]) -> str:
    """The addresses as a user gave them, for messages."""
    return target if isinstance(target, str) else ",".join(target)


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

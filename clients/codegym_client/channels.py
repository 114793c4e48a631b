"""The one channel factory: every client of a CodeGym server gets its channel here.

Load balancing, retries and connection recycling are configuration (a service config and channel
options), not code, so the trainers' runtime clients and the servers' channels to each other (the
runtime and verification to sandbox workers, the pipeline to its services) behave the same way.
Only grpcio is needed: a trainer's install has grpcio and protobuf and nothing else.

Access: every channel sends the caller's access token (`CODEGYM_TOKEN`, or `Access(token=...)`) as
`authorization: Bearer ...` call credentials, and speaks TLS when the target is `grpcs://HOST:PORT`
or a CA is given (`CODEGYM_TLS_CA`: the PEM file that signed the servers' certificates). gRPC sends
call credentials only over a channel that protects them: TLS, or a loopback connection (local
credentials); a token bound for another host in plain text is refused here, before any call.
"""

from __future__ import annotations

import ipaddress
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from codegym_client.defaults import TLS_CA_ENV, TOKEN_ENV

__all__ = [
    "HEALTH_CHECK",
    "HEALTH_REQUEST",
    "MAX_MESSAGE_BYTES",
    "PROBE_TIMEOUT_S",
    "TLS_CA_ENV",
    "TLS_SCHEME",
    "TOKEN_ENV",
    "Access",
    "aio_channel",
    "channel_options",
    "service_config",
    "sync_channel",
    "target_for",
    "target_text",
]

# The largest message either side sends or takes (servers set the same, codegym/server/grpcutil.py).
MAX_MESSAGE_BYTES = 16 * 1024 * 1024

# grpc.health.v1's HealthCheckRequest for the whole server is the empty message: sent as raw bytes
# on a channel's `unary_unary(HEALTH_CHECK)`, so a client needs no health-checking package. The
# method is outside every channel's retry policy: a probe fails at once, with its cause.
HEALTH_REQUEST = b""
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
PROBE_TIMEOUT_S = 1.0

# A target written `grpcs://HOST:PORT` is reached over TLS (the system's roots without a CA file).
TLS_SCHEME = "grpcs://"


@dataclass(frozen=True)
class Access:
    """How a client proves who it is (`token`) and checks whom it talks to (`tls`, `tls_ca`)."""

    token: str = ""
    tls: bool = False
    tls_ca: bytes | None = None

    @classmethod
    def from_env(cls, token: str | None = None, tls_ca: str | Path | None = None) -> Access:
        """The given values, else `CODEGYM_TOKEN` and `CODEGYM_TLS_CA` (a CA turns TLS on)."""
        token = os.environ.get(TOKEN_ENV, "") if token is None else token
        ca_path = os.environ.get(TLS_CA_ENV, "") if tls_ca is None else str(tls_ca)
        return cls.from_values(token, ca_path)

    @classmethod
    def from_values(cls, token: str, ca_path: str | Path) -> Access:
        """A token as given ("" sends none) and a CA file ("" = no TLS unless the target asks)."""
        if not ca_path:
            return cls(token=token.strip())
        try:
            ca = Path(ca_path).read_bytes()
        except OSError as exc:
            raise ValueError(f"cannot read the TLS CA {ca_path} ({TLS_CA_ENV} or --tls-ca): {exc}") from None
        return cls(token=token.strip(), tls=True, tls_ca=ca)

    def credentials(self, target: str) -> grpc.ChannelCredentials | None:
        """The channel's credentials for `target` (None: a plain channel, no token to send)."""
        calls = grpc.access_token_call_credentials(self.token) if self.token else None
        if self.tls:
            secure = grpc.ssl_channel_credentials(root_certificates=self.tls_ca)
        elif calls is None:
            return None
        elif is_loopback(target):
            secure = grpc.local_channel_credentials(grpc.LocalConnectionType.LOCAL_TCP)
        else:
            raise ValueError(
                f"an access token is sent only over TLS or to a loopback address, not in plain text to "
                f"{target}: give the CA of its certificate ({TLS_CA_ENV} or --tls-ca), or write "
                f"{TLS_SCHEME}HOST:PORT"
            )
        return secure if calls is None else grpc.composite_channel_credentials(secure, calls)


def is_loopback(target: str) -> bool:
    """Whether every address of a channel target, or a host to bind, is this machine's (127.0.0.0/8,
    ::1, localhost)."""
    body = target
    for prefix in ("ipv4:", "ipv6:", "dns:///", "dns:"):
        if body.startswith(prefix):
            body = body[len(prefix) :]
            break
    hosts = []
    for item in body.split(","):
        if item.startswith("["):
            host = item[1:].split("]", 1)[0]  # [::1]:50051 or [::1]
        else:
            host = item.rsplit(":", 1)[0] if item.count(":") == 1 else item
        hosts.append(host)
    for host in hosts:
        if host == "localhost":
            continue
        try:
            if not ipaddress.ip_address(host).is_loopback:
                return False
        except ValueError:
            return False
    return bool(hosts)


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


def tls_requested(addresses: str | Sequence[str]) -> bool:
    """Whether the target is written `grpcs://...` (every address of a list, or its first)."""
    first = addresses.split(",")[0] if isinstance(addresses, str) else (addresses[0] if addresses else "")
    return first.strip().startswith(TLS_SCHEME)


def target_for(addresses: str | Sequence[str]) -> str:
    """One channel target for one or many `host:port` addresses (static list → `ipv4:`/`ipv6:` URI)."""
    items = [
        a.strip().removeprefix(TLS_SCHEME)
        for a in (addresses.split(",") if isinstance(addresses, str) else addresses)
        if a.strip()
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


def secure_target(
    addresses: str | Sequence[str], access: Access | None
) -> tuple[str, grpc.ChannelCredentials | None]:
    """The channel target and its credentials (None: plain) for `access` (None: from the environment)."""
    access = access or Access.from_env()
    if tls_requested(addresses) and not access.tls:
        access = Access(token=access.token, tls=True, tls_ca=access.tls_ca)
    target = target_for(addresses)
    return target, access.credentials(target)


def aio_channel(
    addresses: str | Sequence[str],
    service_names: Iterable[str],
    *,
    retry: bool = True,
    health_service: str | None = None,
    no_retry: Iterable[tuple[str, str]] = (),
    access: Access | None = None,
    interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
) -> grpc.aio.Channel:
    options = channel_options(service_names, retry=retry, health_service=health_service, no_retry=no_retry)
    target, credentials = secure_target(addresses, access)
    chain = list(interceptors) or None
    if credentials is None:
        return grpc.aio.insecure_channel(target, options=options, interceptors=chain)
    return grpc.aio.secure_channel(target, credentials, options=options, interceptors=chain)


def sync_channel(
    addresses: str | Sequence[str],
    service_names: Iterable[str],
    *,
    retry: bool = True,
    health_service: str | None = None,
    no_retry: Iterable[tuple[str, str]] = (),
    access: Access | None = None,
) -> grpc.Channel:
    options = channel_options(service_names, retry=retry, health_service=health_service, no_retry=no_retry)
    target, credentials = secure_target(addresses, access)
    if credentials is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, credentials, options=options)

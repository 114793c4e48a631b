"""Run the OpenEnv gateway with uvicorn on a socket bound here (port 0 picks one), and print
`openenv gateway listening on HOST:PORT` once it serves (the process helpers wait for it).

SIGTERM (or Ctrl-C) drains first (`Gateway.drain`): no new sockets or episodes, the open ones
step to their end for up to `--grace-s`, then the rest are closed and the process exits 0. A
second Ctrl-C stops at once; a second SIGTERM changes nothing (the grace is already bounded).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Mapping

import uvicorn

from codegym.server.auth import Identity, ServerAuth
from services.fronting import QuietServer, bind, serve_announced
from services.openenv.gateway import Gateway, GatewayConfig
from services.openenv.settings import GatewaySettings


def uvicorn_config(
    gateway: Gateway, log_level: str = "warning", tls: tuple[str, str] | None = None
) -> uvicorn.Config:
    """uvicorn's settings for the gateway; `tls` (certificate, key: PEM files) serves HTTPS and WSS,
    as a gateway reached beyond this machine must when its callers send access tokens."""
    config = gateway.config
    cert, key = tls or (None, None)
    return uvicorn.Config(
        gateway.app,
        ws="websockets-sansio",
        ws_max_size=config.transport_max_bytes,
        ws_ping_interval=config.ping_interval_s,
        ws_ping_timeout=config.ping_timeout_s,
        ws_per_message_deflate=False,
        lifespan="on",
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=10,
        ssl_certfile=cert,
        ssl_keyfile=key,
    )


def gateway_config(settings: GatewaySettings, tokens: Mapping[str, Identity]) -> GatewayConfig:
    """What the gateway runs with: its settings, the tokens they loaded to, and how it calls the runtime."""
    return GatewayConfig(
        runtime=settings.runtime,
        max_sessions=settings.max_sessions,
        idle_timeout_s=settings.idle_timeout_s,
        ping_interval_s=settings.ping_interval_s if settings.ping_interval_s > 0 else None,
        ping_timeout_s=settings.ping_timeout_s if settings.ping_timeout_s > 0 else None,
        max_message_bytes=settings.max_message_bytes,
        env=settings.env,
        grace_s=settings.grace_s,
        tokens=tokens,
        access=settings.calls.access(),
    )


async def serve(settings: GatewaySettings, auth: ServerAuth | None = None) -> None:
    """Serve until SIGTERM or Ctrl-C; `auth`: what `settings.access` loads to, when the caller holds
    it already (in memory)."""
    auth = ServerAuth.load(settings.access) if auth is None else auth
    config = gateway_config(settings, auth.tokens)
    host, port = settings.host, settings.port
    tls = (settings.access.tls_cert, settings.access.tls_key) if settings.access.tls_cert else None
    gateway = Gateway(config)
    server = QuietServer(uvicorn_config(gateway, tls=tls))
    sock = bind(host, port)
    loop = asyncio.get_running_loop()
    draining: list[asyncio.Task[None]] = []

    async def drain_then_exit() -> None:
        try:
            await gateway.drain(config.grace_s)
        finally:
            server.should_exit = True

    def on_signal(sig: int) -> None:
        if not draining:
            draining.append(loop.create_task(drain_then_exit()))
        elif sig == signal.SIGINT:  # a second Ctrl-C: no more grace
            server.should_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, on_signal, sig)
    scheme = "https" if tls else "http"
    await serve_announced(
        server, sock, lambda at: f"openenv gateway listening on {at} ({scheme}; runtime {config.runtime})"
    )

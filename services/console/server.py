"""Run the console with uvicorn on a socket bound here (port 0 picks one), and print
`codegym console listening on HOST:PORT` once it serves (the process helpers wait for it).
TLS (a certificate and its key, PEM) as the OpenEnv gateway serves it; SIGTERM and Ctrl-C stop it
(it holds nothing a restart would lose but transcripts and logins)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Mapping

import uvicorn

from codegym.server.auth import Identity, ServerAuth
from services.console.app import Console
from services.console.config import ConsoleConfig
from services.console.settings import ConsoleSettings
from services.fronting import QuietServer, bind, serve_announced


def console_config(settings: ConsoleSettings, tokens: Mapping[str, Identity]) -> ConsoleConfig:
    """What the console runs with: its settings, the tokens they loaded to, and how it calls the runtime."""
    return ConsoleConfig(
        runtime=settings.target,
        tokens=tokens,
        tls=bool(settings.access.tls_cert),
        grafana_url=settings.grafana_url,
        page_size=settings.page_size,
        access=settings.calls.access(),
        tls_ca=settings.calls.tls_ca,
    )


async def serve(settings: ConsoleSettings, auth: ServerAuth | None = None) -> None:
    config = console_config(settings, auth.tokens if auth is not None else {})
    console = Console(config)
    host, port = settings.host, settings.port
    tls = (settings.access.tls_cert, settings.access.tls_key) if settings.access.tls_cert else None
    cert, key = tls or (None, None)
    server = QuietServer(
        uvicorn.Config(
            console.app,
            lifespan="on",
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=5,
            ssl_certfile=cert,
            ssl_keyfile=key,
        )
    )
    sock = bind(host, port)
    loop = asyncio.get_running_loop()

    def stop() -> None:
        server.should_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop)
    scheme = "https" if tls else "http"
    await serve_announced(
        server,
        sock,
        lambda at: f"codegym console listening on {at} ({scheme}://{at}/; runtime {config.runtime})",
    )

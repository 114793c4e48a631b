"""`codegym serve openenv`: the OpenEnv gateway (HTTP and WebSockets in front of a runtime). Its
options are `GatewaySettings`'s (`services/openenv/settings.py`): the gRPC servers' tokens file,
checked on HTTP, and `--token`, what it sends the runtime."""

from __future__ import annotations

import argparse

from codegym.server.settings import from_args
from codegym_cli.serve_setup import add_server, run_server, start
from services.openenv.settings import GatewaySettings


def _serve_openenv(args: argparse.Namespace) -> int:
    settings = from_args(GatewaySettings, args)
    auth = start(settings.access, settings.host, settings.log_level, settings.output, settings.calls)
    from services.openenv.server import serve

    run_server(lambda: serve(settings, auth))
    return 0


def add_parser(servers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return add_server(
        servers,
        "openenv",
        GatewaySettings,
        _serve_openenv,
        help="OpenEnv gateway: OpenEnv's WebSocket protocol (TRL, verifiers, SkyRL) in front of a runtime",
        description="Stateless gateway: each WebSocket (/ws) holds at most one runtime session, closed "
        "with the socket, on a second reset, or after --idle-timeout-s without a message. Example: "
        "codegym serve openenv --runtime 127.0.0.1:50051 --port 8000",
    )

"""The OpenEnv gateway's settings (`GatewaySettings`), each option declared once. Its access is the
gRPC servers' (the same tokens file, checked on HTTP as `Authorization: Bearer`) without the probes'
port: its probes (/health, /live) are HTTP on its own port. Standard library only, for `codegym --help`."""

from __future__ import annotations

from dataclasses import dataclass

from codegym.server.settings import Calls, Output, ServerAccess, host, log_level, nested, option, port

OPENENV_PORT = 8000


@dataclass(frozen=True)
class GatewaySettings:
    """Everything `codegym serve openenv` is told; `services.openenv.server.serve` takes it."""

    runtime: str = option(
        "",
        "--runtime",
        "runtime address HOST:PORT, several comma-separated (replicas sharing sessions in Redis), or a "
        "dns:/// name: the gateway balances over them and skips one that is down",
        required=True,
    )
    host: str = host()
    port: int = port(OPENENV_PORT)
    max_sessions: int = option(
        0,
        "--max-sessions",
        "sessions this gateway holds at once, then CAPACITY_REACHED (0 = no cap of its own: the "
        "runtime's session cap, its --max-sessions, is the limit; a session being closed never counts)",
    )
    idle_timeout_s: float = option(
        900.0,
        "--idle-timeout-s",
        "close a socket and its session after this long without a message (0 = never)",
    )
    ping_interval_s: float = option(30.0, "--ping-interval-s", "WebSocket keep-alive ping interval (0 = off)")
    ping_timeout_s: float = option(
        120.0,
        "--ping-timeout-s",
        "close a socket whose pong is this late (0 = never); long generations keep answering pings",
    )
    max_message_bytes: int = option(
        1 << 20,
        "--max-message-bytes",
        "larger messages get a VALIDATION_ERROR (frames over 16 MiB close the socket)",
    )
    env: str = option(
        "",
        "--env",
        "serve one environment (ENV_ID), as an OpenEnv server does: its tools are listed before any "
        "reset, and a reset naming no task plays its task config number seed %% count (verifiers' "
        "OpenEnvEnv); resets may still name any environment",
    )
    grace_s: float = option(
        30.0,
        "--grace-s",
        "on SIGTERM (a rolling update): refuse new sockets and episodes (/health answers 503), let open "
        "episodes step to their end for this long, then close the rest and exit",
    )
    log_level: str = log_level()
    output: Output = nested(Output)
    access: ServerAccess = nested(ServerAccess)
    calls: Calls = nested(Calls)

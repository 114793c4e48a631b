"""`codegym serve openenv`: the OpenEnv gateway (HTTP and WebSockets in front of a runtime).

Its access options are its own (`--tokens`, `--insecure`, here; `--token` from the client options
every command with `--runtime` takes): it checks trainers' tokens on HTTP, not gRPC."""

from __future__ import annotations

import argparse

from codegym_cli.serve_setup import configure_logs, run_server, server_auth, start_metrics


def _serve_openenv(args: argparse.Namespace) -> int:
    auth = server_auth(
        args
    )  # the gRPC servers' tokens (--tokens, --token); the runtime is called with --token
    start_metrics(args)
    from services.openenv.gateway import GatewayConfig
    from services.openenv.server import serve

    configure_logs(args.log_level, args.log_format)
    config = GatewayConfig(
        runtime=args.runtime,
        max_sessions=args.max_sessions,
        idle_timeout_s=args.idle_timeout_s,
        ping_interval_s=args.ping_interval_s if args.ping_interval_s > 0 else None,
        ping_timeout_s=args.ping_timeout_s if args.ping_timeout_s > 0 else None,
        max_message_bytes=args.max_message_bytes,
        env=args.env,
        grace_s=args.grace_s,
        tokens=auth.tokens,
    )
    tls = (args.tls_cert, args.tls_key) if args.tls_cert else None  # both read above, or refused
    run_server(lambda: serve(config, args.host, args.port, tls))
    return 0


def add_parser(servers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """The gateway's options: its runtimes, its sockets' limits and its access tokens."""
    openenv = servers.add_parser(
        "openenv",
        help="OpenEnv gateway: OpenEnv's WebSocket protocol (TRL, verifiers, SkyRL) in front of a runtime",
        description="Stateless gateway: each WebSocket (/ws) holds at most one runtime session, closed "
        "with the socket, on a second reset, or after --idle-timeout-s without a message. Example: "
        "codegym serve openenv --runtime 127.0.0.1:50051 --port 8000",
    )
    openenv.add_argument(
        "--runtime",
        required=True,
        help="runtime address HOST:PORT, several comma-separated (replicas sharing sessions in Redis), "
        "or a dns:/// name: the gateway balances over them and skips one that is down",
    )
    openenv.add_argument("--host", default="127.0.0.1", help="address to bind")
    openenv.add_argument("--port", type=int, default=8000, help="port (0 = any free port)")
    openenv.add_argument(
        "--max-sessions",
        type=int,
        default=0,
        help="sessions this gateway holds at once, then CAPACITY_REACHED (0 = no cap of its own: the "
        "runtime's session cap, its --max-sessions, is the limit; a session being closed never counts)",
    )
    openenv.add_argument(
        "--idle-timeout-s",
        type=float,
        default=900.0,
        help="close a socket and its session after this long without a message (0 = never)",
    )
    openenv.add_argument(
        "--ping-interval-s", type=float, default=30.0, help="WebSocket keep-alive ping interval (0 = off)"
    )
    openenv.add_argument(
        "--ping-timeout-s",
        type=float,
        default=120.0,
        help="close a socket whose pong is this late (0 = never); long generations keep answering pings",
    )
    openenv.add_argument(
        "--max-message-bytes",
        type=int,
        default=1 << 20,
        help="larger messages get a VALIDATION_ERROR (frames over 16 MiB close the socket)",
    )
    openenv.add_argument(
        "--env",
        default="",
        help="serve one environment (ENV_ID), as an OpenEnv server does: its tools are listed before any "
        "reset, and a reset naming no task plays its task config number seed %% count (verifiers' "
        "OpenEnvEnv); resets may still name any environment",
    )
    openenv.add_argument(
        "--grace-s",
        type=float,
        default=30.0,
        help="on SIGTERM (a rolling update): refuse new sockets and episodes (/health answers 503), "
        "let open episodes step to their end for this long, then close the rest and exit",
    )
    openenv.add_argument("--log-level", default="INFO", help="logging level")
    openenv.add_argument(
        "--tokens",
        default=None,
        help="access tokens this gateway takes as `Authorization: Bearer TOKEN` (a trainer's or an "
        "operator's), the gRPC servers' file ($CODEGYM_TOKENS_FILE when not given); --token adds one "
        "operator token and is what the gateway sends the runtime. Without either, every caller is served",
    )
    openenv.add_argument(
        "--tls-cert",
        default="",
        help="serve HTTPS and WSS with this certificate (PEM; with --tls-key): tokens sent beyond this "
        "machine must not travel in plain text. The probes (/health, /live) are then HTTPS too",
    )
    openenv.add_argument("--tls-key", default="", help="the TLS certificate's private key (PEM)")
    openenv.add_argument(
        "--insecure",
        action="store_true",
        help="bind an address other than loopback without access tokens (refused otherwise)",
    )
    openenv.set_defaults(func=_serve_openenv)
    return openenv

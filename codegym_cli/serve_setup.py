"""What every `codegym serve` server shares: its event loop, access settings, logs and metrics.

The options named here are added to each server's parser by serve.register, in one loop,
so every server takes them alike."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from codegym.server.auth import ServerAuth


def run_server(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run a server's main coroutine on uvloop where installed (about a tenth less CPU per step
    for the runtime and the workers in bench/runtime_bench.py), else on asyncio's own loop.

    Once the coroutine has returned (the server drained and stopped) the process is bound to end
    within `procs.EXIT_WAIT_S`, whatever the teardown after it does (`procs.exit_within`)."""
    from codegym.procs import exit_within

    async def then_exit() -> None:
        outcome = 1
        try:
            await main()
            outcome = 0
        finally:
            exit_within(code=outcome)

    try:
        import uvloop
    except ImportError:
        asyncio.run(then_exit())
        return
    uvloop.run(then_exit())


def configure_logs(level: str, fmt: str) -> None:
    from codegym.server.logs import configure

    configure(level, fmt)


def server_auth(args: argparse.Namespace) -> ServerAuth:
    """A server's access settings from its flags (`--tokens`, `--token`, `--tls-cert`/`--tls-key`,
    `--insecure`, and `--health-port` where it has one); refuses a non-loopback bind without tokens
    here, before anything starts."""
    from codegym.server.auth import ServerAuth, check_bind

    try:
        auth = ServerAuth.from_settings(
            token=args.token,
            tokens_file=args.tokens,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            insecure=args.insecure,
            health_port=getattr(args, "health_port", -1),
        )
    except ValueError as exc:
        raise SystemExit(f"codegym serve: {exc}") from None
    check_bind(args.host, auth)
    return auth


def configure_access(args: argparse.Namespace) -> None:
    """`server_auth` for every gRPC server this process builds."""
    from codegym.server.auth import configure

    configure(server_auth(args))


def add_access_arguments(parser: argparse.ArgumentParser) -> None:
    from codegym_cli.access import add_client_arguments

    add_client_arguments(parser)
    parser.add_argument(
        "--tokens",
        default=None,
        help='access tokens this server takes: a JSON file {"tokens": {TOKEN: {"tenant": NAME, "role": '
        "trainer|operator|service}}} ($CODEGYM_TOKENS_FILE when not given); --token adds one operator token. "
        "Without either, every caller is served",
    )
    parser.add_argument(
        "--tls-cert", default="", help="serve TLS with this certificate (PEM; with --tls-key)"
    )
    parser.add_argument("--tls-key", default="", help="the TLS certificate's private key (PEM)")
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="bind an address other than loopback without access tokens (refused otherwise)",
    )
    parser.add_argument(
        "--health-port",
        type=int,
        default=-1,
        help="also serve grpc.health.v1 alone, in plain text, on this port (Kubernetes probes cannot "
        "speak TLS; -1 = off)",
    )


def start_metrics(args: argparse.Namespace) -> None:
    """`--metrics-port`: Prometheus /metrics on the server's host (-1: off, 0: any free port)."""
    if args.metrics_port < 0:
        return
    from codegym.server.metrics import serve_metrics

    port = serve_metrics(args.metrics_port, args.host)
    print(f"metrics on {args.host}:{port}", flush=True)


def add_sandbox_target(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--sandbox",
        required=True,
        help="sandbox workers: HOST:PORT[,HOST:PORT...] (IP literals) or one dns:///NAME:PORT",
    )


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """`--log-format` and `--metrics-port`, which every server takes, the gateway included."""
    parser.add_argument(
        "--log-format",
        choices=("text", "json"),
        default="text",
        help="log lines for people or one JSON object each",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=-1,
        help="serve Prometheus /metrics on this port (-1 = off, 0 = any)",
    )

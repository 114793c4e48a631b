"""`codegym serve verification`: checks generated code in sandbox workers, over gRPC."""

from __future__ import annotations

import argparse

from codegym_cli.serve_setup import (
    add_sandbox_target,
    configure_access,
    configure_logs,
    run_server,
    start_metrics,
)


def _serve_verification(args: argparse.Namespace) -> int:
    configure_access(args)
    start_metrics(args)
    from codegym.server.serving import serve
    from services.verification.service import VerificationServer

    configure_logs(args.log_level, args.log_format)

    async def main() -> None:
        server = VerificationServer(args.sandbox, host=args.host, port=args.port)
        await serve(server)

    run_server(main)
    return 0


def add_parser(servers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """The server's options: where the workers are, where to listen."""
    verification = servers.add_parser(
        "verification",
        help="verification: checks generated environments, unit tests and solve() candidates in sandboxes",
        description="Runs every piece of generated code in the sandbox workers given with --sandbox "
        "(CheckEnvironment, ValidateUnitTests, CheckSolvability, CheckShortcuts); thresholds are request "
        "fields. Example: codegym serve verification --sandbox 127.0.0.1:50061,127.0.0.1:50062",
    )
    add_sandbox_target(verification)
    verification.add_argument("--host", default="127.0.0.1", help="address to bind")
    verification.add_argument("--port", type=int, default=50081, help="port (0 = any free port)")
    verification.add_argument("--log-level", default="INFO", help="logging level")
    verification.set_defaults(func=_serve_verification)
    return verification

"""`codegym serve verification`: checks generated code in sandbox workers, over gRPC. Its options
are `VerificationSettings`'s (`services/verification/settings.py`)."""

from __future__ import annotations

import argparse

from codegym.server.settings import from_args
from codegym_cli.serve_setup import add_server, run_server, start
from services.verification.settings import VerificationSettings


def _serve_verification(args: argparse.Namespace) -> int:
    settings = from_args(VerificationSettings, args)
    auth = start(settings.access, settings.host, settings.log_level, settings.output, settings.calls)
    from codegym.server.serving import serve
    from services.verification.service import VerificationServer

    async def main() -> None:
        await serve(VerificationServer(settings, auth=auth))

    run_server(main)
    return 0


def add_parser(servers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return add_server(
        servers,
        "verification",
        VerificationSettings,
        _serve_verification,
        help="verification: checks generated environments, unit tests and solve() candidates in sandboxes",
        description="Runs every piece of generated code in the sandbox workers given with --sandbox "
        "(CheckEnvironment, ValidateUnitTests, CheckSolvability, CheckShortcuts); thresholds are request "
        "fields. Example: codegym serve verification --sandbox 127.0.0.1:50061,127.0.0.1:50062",
    )

"""`codegym serve synthesis`: environments, unit tests and solve() candidates from an LLM, over gRPC.
Its options are `SynthesisSettings`'s (`services/synthesis/settings.py`)."""

from __future__ import annotations

import argparse

from codegym.server.settings import from_args
from codegym_cli.serve_setup import add_server, run_server, start
from services.synthesis.settings import SynthesisSettings


def _serve_synthesis(args: argparse.Namespace) -> int:
    settings = from_args(SynthesisSettings, args)
    auth = start(settings.access, settings.host, settings.log_level, settings.output)
    from codegym.server.serving import serve
    from services.synthesis.service import SynthesisServer
    from services.synthesis.stages import StageDefaults

    try:
        StageDefaults.overridden(settings.stages.overrides)  # a bad --stage, said before anything starts
    except ValueError as exc:
        raise SystemExit(f"codegym serve synthesis: {exc}") from None

    async def main() -> None:
        await serve(SynthesisServer(settings, auth=auth))

    run_server(main)
    return 0


def add_parser(servers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return add_server(
        servers,
        "synthesis",
        SynthesisSettings,
        _serve_synthesis,
        help="synthesis: environments, unit tests and solve() candidates from an LLM",
    )

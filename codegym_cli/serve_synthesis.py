"""`codegym serve synthesis`: environments, unit tests and solve() candidates from an LLM, over gRPC."""

from __future__ import annotations

import argparse

from codegym_cli.serve_setup import configure_access, configure_logs, run_server, start_metrics


def _serve_synthesis(args: argparse.Namespace) -> int:
    configure_access(args)
    start_metrics(args)
    from pathlib import Path

    from codegym.server.serving import serve
    from codegym_cli.synthesize import settings_from, stage_defaults
    from services.synthesis.service import SynthesisServer

    configure_logs(args.log_level, args.log_format)
    defaults = stage_defaults(args.stage)

    async def main() -> None:
        out = Path(args.out)
        server = SynthesisServer(
            settings_from(args),
            out,
            cache_path=Path(args.cache) if args.cache else None,
            defaults=defaults,
            host=args.host,
            port=args.port,
        )
        await serve(server)

    run_server(main)
    return 0


def add_parser(servers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """The server's options; the LLM's are `codegym synthesize`'s."""
    from codegym_cli.synthesize import add_llm_arguments

    synthesis = servers.add_parser(
        "synthesis",
        help="synthesis: environments, unit tests and solve() candidates from an LLM",
    )
    synthesis.add_argument("--host", default="127.0.0.1", help="address to bind")
    synthesis.add_argument("--port", type=int, default=50071, help="port (0 = any free port)")
    synthesis.add_argument(
        "--out", default="synthesis-out", help="folder for SynthesizeStream runs and the cache"
    )
    synthesis.add_argument("--cache", default="", help="response cache (default OUT/llm_cache.db)")
    add_llm_arguments(synthesis)
    synthesis.add_argument("--log-level", default="INFO", help="logging level")
    synthesis.set_defaults(func=_serve_synthesis)
    return synthesis

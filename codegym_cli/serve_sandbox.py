"""`codegym serve sandbox`: the sandbox worker, which runs untrusted environment code in nsjail
jails. Its options are `SandboxSettings`'s (`sandbox_worker/settings.py`)."""

from __future__ import annotations

import argparse

from codegym.server.settings import from_args
from codegym_cli.serve_setup import add_server, run_server, start
from sandbox_worker.settings import MAX_LIMITS, SandboxSettings


def _serve_sandbox(args: argparse.Namespace) -> int:
    from sandbox_worker.limits import unreachable_by_jails

    unreachable = unreachable_by_jails()  # said in one line, not as nsjail's failed mount
    if unreachable:
        raise SystemExit(f"codegym serve sandbox: {unreachable}")
    settings = from_args(SandboxSettings, args)
    auth = start(settings.access, settings.host, settings.log_level, settings.output)
    from codegym.server.serving import serve
    from sandbox_worker.server import SandboxWorker

    async def main() -> None:
        # grpc.aio objects bind to the running loop: build the worker inside it.
        await serve(SandboxWorker(settings, auth=auth))

    run_server(main)
    return 0


def add_parser(servers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return add_server(
        servers,
        "sandbox",
        SandboxSettings,
        _serve_sandbox,
        help="sandbox worker: runs untrusted environment code in nsjail jails",
        description="Stateless gRPC executor of untrusted environment code. Limits below are per request "
        f"defaults; a request may ask for more up to wall {MAX_LIMITS.wall_ms} ms, CPU {MAX_LIMITS.cpu_ms} ms, "
        f"memory {MAX_LIMITS.memory_mb} MiB, output {MAX_LIMITS.output_bytes} bytes.",
    )

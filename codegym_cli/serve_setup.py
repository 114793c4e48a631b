"""What every `codegym serve` server shares: its event loop, its access loaded, logs and metrics.

Each server's options are declared once, on its settings object (`SandboxSettings`,
`RuntimeSettings`, ...: `codegym.server.settings`); `add_server` puts them on its parser."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from codegym.server.settings import add_arguments

if TYPE_CHECKING:
    from codegym.server.auth import ServerAuth
    from codegym.server.settings import Calls, Output, ServerAccess


def add_server(
    servers: argparse._SubParsersAction,
    name: str,
    settings: type,
    run: Callable[[argparse.Namespace], int],
    **parser: Any,
) -> argparse.ArgumentParser:
    """`codegym serve NAME`, its options those of `settings`, run by `run`."""
    command = servers.add_parser(name, **parser)
    add_arguments(settings, command)
    command.set_defaults(func=run)
    return command


def run_server(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run a server's main coroutine on uvloop where installed (about a tenth less CPU per step
    for the runtime and the workers in bench/runtime_bench.py), else on asyncio's own loop.

    Once the coroutine has returned (the server drained and stopped) the process is bound to end
    within `procs.EXIT_WAIT_S`, whatever the teardown after it does (`procs.exit_within`)."""
    import asyncio

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


def start(
    access: ServerAccess, host: str, level: str, output: Output, calls: Calls | None = None
) -> ServerAuth:
    """Before a server is built: its access loaded, and what it sends to the servers it calls
    (`calls`) read (a file that cannot be read, or a non-loopback bind without tokens, refused here
    in one line), its logs set up, its metrics served."""
    from codegym.server.auth import ServerAuth, check_bind
    from codegym.server.logs import configure

    try:
        auth = ServerAuth.load(access)
        if calls is not None:
            calls.access()  # the CA file read now, not as a traceback from the server's constructor
    except ValueError as exc:
        raise SystemExit(f"codegym serve: {exc}") from None
    check_bind(host, auth)
    if output.metrics_port >= 0:  # -1: off, 0: any free port
        from codegym.server.metrics import serve_metrics

        port = serve_metrics(output.metrics_port, host)
        print(f"metrics on {host}:{port}", flush=True)
    configure(level, output.log_format)
    return auth

"""Start our servers as real processes on loopback port 0, and stop them by pid.

The lifecycle itself (pdeathsig, the ready line, draining, stopping) is `codegym.procs`, shared
with `codegym up` and the benchmarks; this only spells a `codegym` subcommand and merges its
stderr into the text tests inspect.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from codegym import procs


class ServerProcess(procs.ServerProcess):
    """`codegym ARGS...` (e.g. `serve sandbox --port 0`) until its `listening on` line."""

    def __init__(self, args: list[str], timeout: float = 60.0, python: str = sys.executable) -> None:
        super().__init__(procs.codegym_command(args, python), name=" ".join(args[:2]), timeout_s=timeout)


class Redis(procs.RedisServer):
    """A redis-server on loopback; with `folder`, an append-only file there (a restart on the same
    port and folder keeps the sessions)."""

    def __init__(self, folder: Path | None = None, port: int = 0) -> None:
        super().__init__("127.0.0.1", port=port, folder=folder)


@contextmanager
def running(args: list[str]) -> Iterator[ServerProcess]:
    server = ServerProcess(args)
    try:
        yield server
    finally:
        server.stop()

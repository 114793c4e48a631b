"""One server lifecycle for every server of the project (runtime, sandbox worker, synthesis,
verification): build it inside the running loop, `start()`, announce, run until SIGTERM or SIGINT,
then `stop()`, which drains (NOT_SERVING first, running calls finish, new ones are refused).

The announcement is the line process supervisors wait for (`codegym up`, the tests, the benches):
`<what> listening on HOST:PORT (...)`.
"""

from __future__ import annotations

import gc
from typing import Protocol

from codegym.server.grpcutil import ManagedServer


class Server(Protocol):
    managed: ManagedServer

    @property
    def address(self) -> str: ...

    async def start(self) -> None: ...

    async def stop(self, grace_s: float = 5.0) -> None: ...

    def banner(self) -> str:
        """`<what> listening on <address> (<details>)`."""
        ...


def settle_heap() -> None:
    """Take what the server built at start (modules, the library, descriptors, its jails' and
    channels' objects) out of the garbage collector's sight: a full collection walks every tracked
    object, and one over a started server's heap stalls every call in flight for tens of
    milliseconds. Later collections only walk what was allocated since. The benches' load
    generator calls it too, before it measures."""
    gc.collect()
    gc.freeze()


async def serve(server: Server, grace_s: float = 5.0) -> None:
    """Run `server` until SIGTERM/SIGINT, then drain for at most `grace_s`."""
    await server.start()
    settle_heap()
    try:
        print(server.banner(), flush=True)
        await server.managed.wait_for_signal()
    finally:
        await server.stop(grace_s)

"""A gRPC failure as grpc raises it, for tests of how the client reads one."""

from __future__ import annotations

import grpc


class RawError(grpc.RpcError):
    """A status as grpc raises it, with the trailers we choose (no trailer: what an older server, or
    the way to the server, answers: no reason)."""

    def __init__(self, code: grpc.StatusCode, trailers: tuple[tuple[str, str], ...] = ()) -> None:
        self._code, self._trailers = code, trailers

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return "details"

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._trailers

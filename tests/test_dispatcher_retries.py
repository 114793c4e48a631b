"""One layer retries: an operation a worker keeps answering UNAVAILABLE is sent `attempts` times
in all (the dispatcher's own back-off), not `attempts` times the channel's retry policy.

The worker here is a stand-in for a broken one: a gRPC server on loopback that answers every call
UNAVAILABLE and counts the calls it received (what a real worker does when it is draining).
"""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from codegym.sandbox.v1 import sandbox_service_pb2 as sb
from codegym.sandbox.v1 import sandbox_service_pb2_grpc as sb_grpc
from services.dispatcher import SandboxDispatcher, SandboxUnavailable


class Unavailable(sb_grpc.SandboxServiceServicer):
    def __init__(self) -> None:
        self.calls = 0

    async def refuse(self, context: grpc.aio.ServicerContext) -> Any:
        self.calls += 1
        await context.abort(grpc.StatusCode.UNAVAILABLE, "draining")

    async def Execute(
        self, request: sb.ExecuteRequest, context: grpc.aio.ServicerContext
    ) -> sb.ExecuteResponse:
        return await self.refuse(context)

    async def ExecuteBatch(
        self, request: sb.ExecuteBatchRequest, context: grpc.aio.ServicerContext
    ) -> sb.ExecuteBatchResponse:
        return await self.refuse(context)


@pytest.mark.parametrize("batch", [False, True])
async def test_an_unavailable_worker_gets_each_operation_attempts_times_in_all(batch: bool) -> None:
    worker = Unavailable()
    server = grpc.aio.server()
    sb_grpc.add_SandboxServiceServicer_to_server(worker, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    dispatcher = SandboxDispatcher(f"127.0.0.1:{port}", attempts=3)
    op = sb.Operation(source=sb.SourceRef(sha256="0" * 64), run_script=sb.RunScriptOp())
    try:
        with pytest.raises(SandboxUnavailable):
            if batch:
                await dispatcher.execute_batch([op], {"0" * 64: "pass"})
            else:
                await dispatcher.execute(op, "pass")
    finally:
        await dispatcher.close()
        await server.stop(0)
    assert worker.calls == 3

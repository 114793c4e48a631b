"""Sending operations to sandbox workers.

One gRPC channel with `round_robin` over every worker address (or one `dns:///` name), client-side
health checking so draining workers get no new calls, and retries on UNAVAILABLE. Retrying is safe
because every operation is a pure function of (source, state, input, seed): a step lost with a
worker gives the same result when re-run on another one.

Sources travel by sha256 first; a worker that has not seen one answers SOURCE_NEEDED and the
operation is resent once with the code.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Sequence

import grpc

from codegym.grpcutil import aio_channel
from codegym.sandbox.v1 import sandbox_service_pb2 as sb
from codegym.sandbox.v1 import sandbox_service_pb2_grpc as sb_grpc

log = logging.getLogger(__name__)
SANDBOX_SERVICE = sb.DESCRIPTOR.services_by_name["SandboxService"].full_name
# Time a call may take beyond the operation's own wall limit (queueing, transport, jail restart).
DEADLINE_SLACK_S = 5.0
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


class SandboxUnavailable(RuntimeError):
    """No worker could run the operation (all down, or overloaded past the retry budget)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class SandboxDispatcher:
    """Runs operations on whichever worker the channel picks. Create inside the running loop."""

    def __init__(self, addresses: str | Sequence[str], *, attempts: int = 6) -> None:
        self.channel = aio_channel(addresses, [SANDBOX_SERVICE], health_service=SANDBOX_SERVICE)
        self.stub = sb_grpc.SandboxServiceStub(self.channel)
        self.attempts = attempts

    async def close(self) -> None:
        await self.channel.close()

    async def execute(self, op: sb.Operation, source: str) -> sb.OperationResult:
        """Run `op` (whose `source.sha256` is set); `source` is sent only if a worker asks for it."""
        result = await self._call(op)
        if result.status == sb.STATUS_SOURCE_NEEDED:
            with_code = sb.Operation()
            with_code.CopyFrom(op)
            with_code.source.code = source
            result = await self._call(with_code)
        return result

    async def _call(self, op: sb.Operation) -> sb.OperationResult:
        wall_s = (op.limits.wall_ms or 5000) / 1000
        delay = 0.05
        last: grpc.aio.AioRpcError | None = None
        for attempt in range(self.attempts):
            try:
                response = await self.stub.Execute(
                    sb.ExecuteRequest(operation=op), timeout=wall_s + DEADLINE_SLACK_S, wait_for_ready=True
                )
                return response.result
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in RETRYABLE:
                    raise
                last = exc
                log.warning(
                    "sandbox call failed (%s: %s), attempt %d", exc.code().name, exc.details(), attempt + 1
                )
                await asyncio.sleep(delay * (1 + random.random()))
                delay = min(delay * 2, 1.0)
        assert last is not None
        raise SandboxUnavailable(
            last.code(), f"sandbox workers unavailable after {self.attempts} attempts: {last.details()}"
        )

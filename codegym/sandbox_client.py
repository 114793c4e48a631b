"""Sending operations to sandbox workers (shared by the runtime and verification services).

One gRPC channel with `round_robin` over every worker address (or one `dns:///` name), client-side
health checking so draining workers get no new calls, and retries on UNAVAILABLE. Retrying is safe
because every operation is a pure function of (source, state, input, seed): a step lost with a
worker gives the same result when re-run on another one.

Sources travel by sha256 first; a worker that has not seen one answers SOURCE_NEEDED and the
operation is resent once with the code.

`execute_batch` serves verification's matrices (candidates × tests): it cuts a list of operations
into `ExecuteBatch` calls of bounded size, keeps several in flight so round_robin spreads them over
every worker, and returns results in order.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import grpc

from codegym.grpcutil import aio_channel
from codegym.sandbox.v1 import sandbox_service_pb2 as sb
from codegym.sandbox.v1 import sandbox_service_pb2_grpc as sb_grpc

log = logging.getLogger(__name__)
SANDBOX_SERVICE = sb.DESCRIPTOR.services_by_name["SandboxService"].full_name
# Time a call may take beyond the operation's own wall limit (queueing, transport, jail restart).
DEADLINE_SLACK_S = 5.0
T = TypeVar("T")
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

    async def execute_batch(
        self, ops: Sequence[sb.Operation], sources: dict[str, str], *, chunk: int = 8, in_flight: int = 4
    ) -> list[sb.OperationResult]:
        """Run independent operations (sources by sha256, `sources` maps sha256 to code); in order.

        Chunks go out `in_flight` at a time, so two workers with two jails each stay busy while a
        caller that stops early (verification) wastes at most the chunks already sent.
        """
        results: list[sb.OperationResult | None] = [None] * len(ops)
        limit = asyncio.Semaphore(in_flight)

        async def run(start: int) -> None:
            part = list(ops[start : start + chunk])
            # The chunk's first operation carries the code: the worker caches it before the rest.
            first = sb.Operation()
            first.CopyFrom(part[0])
            if not first.source.code and first.source.sha256 in sources:
                first.source.code = sources[first.source.sha256]
            part[0] = first
            async with limit:
                answers = await self._call_batch(part)
                missing = [i for i, r in enumerate(answers) if r.status == sb.STATUS_SOURCE_NEEDED]
                if missing:
                    resend = []
                    for i in missing:
                        op = sb.Operation()
                        op.CopyFrom(part[i])
                        op.source.code = sources[op.source.sha256]
                        resend.append(op)
                    for i, result in zip(missing, await self._call_batch(resend), strict=True):
                        answers[i] = result
            for i, result in enumerate(answers):
                results[start + i] = result

        await asyncio.gather(*(run(start) for start in range(0, len(ops), chunk)))
        return [r for r in results if r is not None]

    async def _call_batch(self, ops: list[sb.Operation]) -> list[sb.OperationResult]:
        wall_s = max((op.limits.wall_ms or 5000) for op in ops) / 1000
        # Operations of one call share the worker's jails: allow for them running one after another.
        timeout = wall_s * max(1, len(ops)) + DEADLINE_SLACK_S
        request = sb.ExecuteBatchRequest(operations=ops)
        response = await self._retrying(
            lambda: self.stub.ExecuteBatch(request, timeout=timeout, wait_for_ready=True)
        )
        return list(response.results)

    async def _call(self, op: sb.Operation) -> sb.OperationResult:
        wall_s = (op.limits.wall_ms or 5000) / 1000
        request = sb.ExecuteRequest(operation=op)
        response = await self._retrying(
            lambda: self.stub.Execute(request, timeout=wall_s + DEADLINE_SLACK_S, wait_for_ready=True)
        )
        return response.result

    async def _retrying(self, call: Callable[[], Awaitable[T]]) -> T:
        delay = 0.05
        last: grpc.aio.AioRpcError | None = None
        for attempt in range(self.attempts):
            try:
                return await call()
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

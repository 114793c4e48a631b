"""Sending operations to sandbox workers (shared by the runtime and verification services).

One gRPC channel with `round_robin` over every worker address (or one `dns:///` name), client-side
health checking so draining workers get no new calls, and retries on UNAVAILABLE (here, with
back-off, `attempts` sends in all: the channel itself does not retry). Retrying is safe
because every operation is a pure function of (source, state, input, seed): a step lost with a
worker gives the same result when re-run on another one.

Sources travel by sha256 first; a worker that has not seen one answers SOURCE_NEEDED and the
operation is resent once with the code (a create carries its code from the start: see
`RuntimeServicer._execute`).

Session affinity: with several worker addresses, operations that carry a session key go to the
session's worker, chosen by rendezvous hashing over the workers not known to be down, over a
direct channel per worker, because that worker holds the session resident (its live env in a jail
process) and serves its next step with no fork and no unpickling. They travel on one long-lived
stream per worker (services/worker_stream.py): a message on an open stream costs the worker about
half the CPU of a unary call. A stream that breaks fails what it carried UNAVAILABLE, which is
what marks a worker down here. A pinned worker that is down
or overloaded hands the session to the next worker in its hash order (which then serves it cold);
the session moves back once the first worker answers again. A single address (or one `dns:///`
name, where the workers are not known one by one) uses the round_robin channel only.

`execute_batch` serves verification's matrices (candidates × tests): it cuts a list of operations
into `ExecuteBatch` calls of bounded size, keeps several in flight so round_robin spreads them over
every worker, and returns results in order.

Access: the calls carry this process's own access token (`CODEGYM_TOKEN`, or `access`): the
runtime's or verification's service identity, which workers that take tokens require (a trainer's
token is refused there). A worker's refusal of it (UNAUTHENTICATED, PERMISSION_DENIED) is never
retried: it says the service's token is wrong, which no other worker would take either.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import grpc

from codegym.sandbox.v1 import sandbox_service_pb2 as sb
from codegym.sandbox.v1 import sandbox_service_pb2_grpc as sb_grpc
from codegym_client.channels import Access, aio_channel
from codegym_client.errors import retryable_answer
from services.worker_stream import DEADLINE_SLACK_S, RUNS_PER_OPERATION, QueueFull, WorkerStream

__all__ = ["QueueFull", "SandboxDispatcher", "SandboxUnavailable", "sourced", "with_source"]

log = logging.getLogger(__name__)
SANDBOX_SERVICE = sb.DESCRIPTOR.services_by_name["SandboxService"].full_name
T = TypeVar("T")
# How long a worker that answered UNAVAILABLE is skipped by pinned sessions.
DOWN_S = 2.0


def with_source(op: sb.Operation, code: str) -> sb.Operation:
    """A copy of `op` that carries its source's text, for a worker that has not cached it."""
    full = sb.Operation()
    full.CopyFrom(op)
    full.source.code = code
    return full


async def sourced(
    call: Callable[[sb.Operation], Awaitable[sb.OperationResult]], op: sb.Operation, source: str
) -> sb.OperationResult:
    """`call(op)` by sha256 first, and once more with the text when the worker answers SOURCE_NEEDED."""
    result = await call(op)
    if result.status == sb.STATUS_SOURCE_NEEDED:
        result = await call(with_source(op, source))
    return result


def worker_addresses(addresses: str | Sequence[str]) -> list[str]:
    """The individual `host:port` workers of a target, or [] when they are not known one by one."""
    items = [
        a.strip() for a in (addresses.split(",") if isinstance(addresses, str) else addresses) if a.strip()
    ]
    if len(items) < 2 or any("://" in a or a.startswith("dns:") for a in items):
        return []
    return items


@dataclass(frozen=True)
class Worker:
    """One worker's channel, and the stream its sessions' operations go over."""

    channel: grpc.aio.Channel
    stream: WorkerStream


class SandboxUnavailable(RuntimeError):
    """No worker could run the operation (all down, or overloaded past the retry budget)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class SandboxDispatcher:
    """Runs operations on whichever worker the channel picks. Create inside the running loop."""

    def __init__(
        self, addresses: str | Sequence[str], *, attempts: int = 6, access: Access | None = None
    ) -> None:
        # One layer retries: this class (`attempts`, with back-off), never the channel under it
        # too (its policy would multiply every attempt here by its own).
        access = access or Access.from_env()
        self.channel = aio_channel(
            addresses, [SANDBOX_SERVICE], retry=False, health_service=SANDBOX_SERVICE, access=access
        )
        self.stub = sb_grpc.SandboxServiceStub(self.channel)
        self.attempts = attempts
        self.workers: dict[str, Worker] = {}
        for address in worker_addresses(addresses):
            channel = aio_channel(
                address, [SANDBOX_SERVICE], retry=False, health_service=SANDBOX_SERVICE, access=access
            )
            stream = WorkerStream(sb_grpc.SandboxServiceStub(channel), address)
            self.workers[address] = Worker(channel, stream)
        self.down_until: dict[str, float] = {}

    @property
    def queued(self) -> int:
        """Operations waiting in the runtime to be sent to a worker: for one of its slots for
        creates, or to be written to its stream (the worker is not reading: flow control)."""
        return sum(w.stream.queued for w in self.workers.values())

    async def close(self) -> None:
        await self.channel.close()
        for worker in self.workers.values():
            await worker.stream.close()
            await worker.channel.close()

    def order(self, key: str) -> list[str]:
        """The workers in the session's rendezvous order: the first is its home."""
        return sorted(
            self.workers,
            key=lambda a: hashlib.blake2b(f"{key}|{a}".encode(), digest_size=8).digest(),
            reverse=True,
        )

    async def execute(self, op: sb.Operation, source: str, key: str = "") -> sb.OperationResult:
        """Run `op` (whose `source.sha256` is set); `source` is sent only if a worker asks for it.

        With `key` (a session id), on the session's worker while it is up (see the module doc).
        """
        if key and self.workers:
            pinned = await self._pinned(op, source, key)
            if pinned is not None:
                return pinned
        return await sourced(self._call, op, source)

    async def release(self, key: str) -> None:
        """Tell the session's worker to drop its resident process (best effort: a miss costs nothing)."""
        op = sb.Operation(release=sb.ReleaseOp(session_key=key))
        try:
            if self.workers:
                now = time.monotonic()
                home = next((a for a in self.order(key) if self.down_until.get(a, 0.0) <= now), None)
                if home is not None:
                    await self.workers[home].stream.submit(op)
            else:
                await self.stub.Execute(sb.ExecuteRequest(operation=op), timeout=DEADLINE_SLACK_S)
        except (grpc.aio.AioRpcError, QueueFull) as exc:
            log.debug("release of %s failed: %s", key, exc)

    async def _pinned(self, op: sb.Operation, source: str, key: str) -> sb.OperationResult | None:
        """The result from the first worker of the session's order that takes the call; None if none did."""
        now = time.monotonic()
        for address in self.order(key):
            if self.down_until.get(address, 0.0) > now:
                continue
            try:
                return await sourced(self.workers[address].stream.submit, op, source)
            except grpc.aio.AioRpcError as exc:
                if not retryable_answer(exc.code()):  # the failure table (codegym_client.errors)
                    raise
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    self.down_until[address] = time.monotonic() + DOWN_S
                log.info("worker %s: %s; session goes to the next worker", address, exc.code().name)
        return None

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
            if not part[0].source.code and part[0].source.sha256 in sources:
                part[0] = with_source(part[0], sources[part[0].source.sha256])
            async with limit:
                answers = await self._call_batch(part)
                missing = [i for i, r in enumerate(answers) if r.status == sb.STATUS_SOURCE_NEEDED]
                if missing:
                    resend = [with_source(part[i], sources[part[i].source.sha256]) for i in missing]
                    for i, result in zip(missing, await self._call_batch(resend), strict=True):
                        answers[i] = result
            for i, result in enumerate(answers):
                results[start + i] = result

        await asyncio.gather(*(run(start) for start in range(0, len(ops), chunk)))
        return [r for r in results if r is not None]

    async def _call_batch(self, ops: list[sb.Operation]) -> list[sb.OperationResult]:
        wall_s = max((op.limits.wall_ms or 5000) for op in ops) / 1000
        # Operations of one call share the worker's jails: allow for them running one after another.
        timeout = wall_s * RUNS_PER_OPERATION * max(1, len(ops)) + DEADLINE_SLACK_S
        request = sb.ExecuteBatchRequest(operations=ops)
        response = await self._retrying(
            lambda: self.stub.ExecuteBatch(request, timeout=timeout, wait_for_ready=True)
        )
        return list(response.results)

    async def _call(self, op: sb.Operation) -> sb.OperationResult:
        wall_s = (op.limits.wall_ms or 5000) / 1000
        request = sb.ExecuteRequest(operation=op)
        response = await self._retrying(
            lambda: self.stub.Execute(
                request, timeout=wall_s * RUNS_PER_OPERATION + DEADLINE_SLACK_S, wait_for_ready=True
            )
        )
        return response.result

    async def _retrying(self, call: Callable[[], Awaitable[T]]) -> T:
        delay = 0.05
        last: grpc.aio.AioRpcError | None = None
        for attempt in range(self.attempts):
            try:
                return await call()
            except grpc.aio.AioRpcError as exc:
                if not retryable_answer(exc.code()):  # the failure table (codegym_client.errors)
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

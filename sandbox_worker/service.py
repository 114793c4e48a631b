"""The `codegym.sandbox.v1.SandboxService` servicer.

Bad requests and overload are RPC errors; everything the untrusted code does (raise, loop, eat
memory, die) is an `OperationResult` with a status.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc

from codegym.errors import Reason, Refusal, Undecodable, guarded
from codegym.inside.messages import Limits, Request, Result
from codegym.sandbox.v1 import sandbox_service_pb2 as pb
from codegym.sandbox.v1 import sandbox_service_pb2_grpc as pb_grpc
from codegym.server.metrics import SANDBOX_REFUSALS
from codegym_client.api.common.v1 import common_pb2
from sandbox_worker.cache import SourceCache
from sandbox_worker.pool import JailPool
from sandbox_worker.prepared import Prepared
from sandbox_worker.settings import DEFAULT_LIMITS, MAX_LIMITS, RequestLimits
from sandbox_worker.streaming import DRAINING, execute_stream

log = logging.getLogger(__name__)

# Every `messages.Status` a jail answers, as the RPC says it.
STATUS: dict[str, pb.Status.ValueType] = {
    "ok": pb.STATUS_OK,
    "env_error": pb.STATUS_ENV_ERROR,
    "timeout": pb.STATUS_TIMEOUT,
    "memory_limit": pb.STATUS_MEMORY_LIMIT,
    "output_limit": pb.STATUS_OUTPUT_LIMIT,
    "killed": pb.STATUS_KILLED,
    "crashed": pb.STATUS_CRASHED,
    "bad_request": pb.STATUS_BAD_REQUEST,
    "source_needed": pb.STATUS_SOURCE_NEEDED,
}
MAX_BATCH = 4096


class BadOperation(ValueError):
    """An operation that cannot be served at all (INVALID_ARGUMENT)."""


def limits_message(limits: RequestLimits) -> pb.Limits:
    return pb.Limits(
        wall_ms=limits.wall_ms,
        cpu_ms=limits.cpu_ms,
        memory_mb=limits.memory_mb,
        output_bytes=limits.output_bytes,
    )


def limits_sent(limits: RequestLimits) -> Limits:
    """A request's limits as the jail reads them."""
    return {
        "wall_ms": limits.wall_ms,
        "cpu_ms": limits.cpu_ms,
        "memory_mb": limits.memory_mb,
        "output_bytes": limits.output_bytes,
    }


def to_result(raw: Result, sha: str) -> pb.OperationResult:
    """Validate a jail's answer field by field; anything malformed becomes CRASHED."""
    # `raw` is the jail's claim: every value is checked here, anything malformed becomes CRASHED.
    usage: Any = raw.get("usage")
    if not isinstance(usage, dict):
        usage = {}
    try:
        # A binary part of the frame (`frames.parse` never takes it from the JSON head), passed on
        # as opaque bytes: never unpickled here.
        state: Any = raw.get("state", b"")
        if not isinstance(state, bytes | memoryview):
            raise TypeError(f"state is a {type(state).__name__}, not bytes")
        return pb.OperationResult(
            status=STATUS.get(str(raw.get("status")), pb.STATUS_CRASHED),
            message=str(raw.get("message", ""))[:4096],
            stdout=str(raw.get("stdout", "")),
            stderr=str(raw.get("stderr", "")),
            output_truncated=bool(raw.get("output_truncated", False)),
            usage=common_pb2.ResourceUsage(
                wall_ms=max(0, int(usage.get("wall_ms", 0))),
                cpu_ms=max(0, int(usage.get("cpu_ms", 0))),
                peak_rss_kb=max(0, int(usage.get("peak_rss_kb", 0))),
                peak_alloc_bytes=max(0, int(usage.get("peak_alloc_bytes", 0))),
            ),
            state=bytes(state),
            observation=str(raw.get("observation", "")),
            reward=float(raw.get("reward", 0.0)),
            done=bool(raw.get("done", False)),
            step_count=max(0, int(raw.get("step_count", 0))),
            answer_json=str(raw.get("answer_json", "")),
            answer_repr=str(raw.get("answer_repr", "")),
            exit_code=int(raw.get("exit_code", 0)),
            source_sha256=sha,
            env_class=str(raw.get("env_class", "")),
            trajectory=[str(item) for item in raw.get("trajectory") or []],
            resident=bool(raw.get("from_resident", False)),
        )
    except (TypeError, ValueError, OverflowError) as exc:
        return pb.OperationResult(
            status=pb.STATUS_CRASHED, message=f"malformed answer from the jail: {exc}", source_sha256=sha
        )


class SandboxServicer(pb_grpc.SandboxServiceServicer):
    def __init__(
        self,
        pool: JailPool,
        *,
        defaults: RequestLimits = DEFAULT_LIMITS,
        maximum: RequestLimits = MAX_LIMITS,
        max_pending: int | None = None,
        stream_in_flight: int | None = None,
        source_cache_bytes: int = 64 * 1024 * 1024,
    ) -> None:
        """`stream_in_flight`: the operations of one ExecuteStream running or answered and not yet
        sent, past which the stream is not read (default `max_pending`: one stream is never read
        further than the worker could admit)."""
        self.pool = pool
        self.cache = SourceCache(source_cache_bytes)
        self.defaults = defaults
        self.maximum = maximum
        self.max_pending = max_pending or pool.size * 256
        self.stream_in_flight = stream_in_flight or self.max_pending
        # One token per operation admitted and not yet answered, over every call and stream.
        self.pending: set[object] = set()
        # Set once the worker drains: open streams end as soon as nothing of theirs runs.
        self.drain = asyncio.Event()

    @property
    def draining(self) -> bool:
        return self.drain.is_set()

    @draining.setter
    def draining(self, value: bool) -> None:
        if value:
            self.drain.set()
        else:
            self.drain.clear()

    def _request(self, op: pb.Operation) -> Prepared | pb.OperationResult:
        """The jail request for an operation, or a result when it can be answered here."""
        kind = op.WhichOneof("kind")
        if kind is None:
            raise BadOperation(
                "operation has no kind (create, step, reset, ref_answer, solve, run_script, ...)"
            )
        if kind == "release":
            if not op.release.session_key:
                raise BadOperation("release needs a session_key")
            limits = self.defaults.capped(self.maximum)
            release: Request = {
                "op": "release",
                "session": op.release.session_key,
                "sha": "",
                "limits": limits_sent(limits),
            }
            return Prepared(release, limits.wall_ms)
        if op.source.code:
            sha = self.cache.put(op.source.code)
            if op.source.sha256 and op.source.sha256 != sha:
                raise BadOperation("source.sha256 does not match source.code")
            source = op.source.code
        elif op.source.sha256:
            sha = op.source.sha256.lower()
            cached = self.cache.get(sha)
            if cached is None:
                return pb.OperationResult(
                    status=pb.STATUS_SOURCE_NEEDED,
                    message="source not cached on this worker: resend with source.code",
                    source_sha256=sha,
                )
            source = cached
        else:
            raise BadOperation("operation has neither source.code nor source.sha256")
        limits = self.defaults.merged(
            self.maximum,
            wall_ms=op.limits.wall_ms,
            cpu_ms=op.limits.cpu_ms,
            memory_mb=op.limits.memory_mb,
            output_bytes=op.limits.output_bytes,
        )
        req: Request = {
            "op": kind,
            "sha": sha,
            "source": source,
            "seed": op.seed,
            "limits": limits_sent(limits),
        }
        if kind == "create":
            req["config"] = op.create.config_json
            if op.create.session_key:
                req["session"] = op.create.session_key
        elif kind == "step":
            req["state"] = op.step.state
            req["action"] = op.step.action
            held = op.step.session_key in self.pool.affinity
            if op.step.session_key and not self.pool.residency.worth_a_process(op.step.idle_ms, held):
                self.pool.sparse(op.step.session_key)
            elif op.step.session_key:
                req["session"] = op.step.session_key
                # The version a resident process must hold to take this step (the zygote would
                # otherwise decode and hash the state itself).
                req["state_sha"] = hashlib.sha256(op.step.state).hexdigest()
        elif kind == "reset":
            req["state"] = op.reset.state
            req["config"] = op.reset.config_json
        elif kind == "ref_answer":
            req["config"] = op.ref_answer.config_json
        elif kind == "solve":
            req["config"] = op.solve.config_json
            req["solve_source"] = op.solve.solve_source
            req["max_steps"] = op.solve.max_steps or 256
            req["record"] = op.solve.record
        elif kind == "run_script":
            req["stdin"] = op.run_script.stdin
        elif kind == "call_function":
            try:
                args = json.loads(op.call_function.args_json or "[]")
                kwargs = json.loads(op.call_function.kwargs_json or "{}")
            except ValueError as exc:
                raise BadOperation(f"call_function arguments are not JSON: {exc}") from None
            if not isinstance(args, list) or not isinstance(kwargs, dict):
                raise BadOperation("call_function args_json must be an array and kwargs_json an object")
            req["function"] = op.call_function.function_name
            req["args"] = args
            req["kwargs"] = kwargs
            req["stdin"] = op.call_function.stdin
        return Prepared(req, limits.wall_ms, op.step.idle_ms if kind == "step" else 0)

    def prepare(self, op: pb.Operation) -> Prepared | pb.OperationResult:
        """`_request`, with an operation that cannot be served as the refusal the RPCs answer."""
        try:
            return self._request(op)
        except BadOperation as exc:
            raise Refusal(Reason.INVALID_REQUEST, str(exc)) from None

    async def run(self, prepared: Prepared | pb.OperationResult) -> pb.OperationResult:
        if isinstance(prepared, pb.OperationResult):
            return prepared
        raw = await self.pool.execute(prepared.request, prepared.wall_ms, prepared.idle_ms)
        return to_result(raw, prepared.request["sha"])

    def admit(self, count: int) -> None:
        """Refuse `count` more operations when the worker drains or would hold more than `max_pending`."""
        if self.draining:
            raise Refusal(Reason.UNAVAILABLE, DRAINING)
        if len(self.pending) + count > self.max_pending:
            SANDBOX_REFUSALS.inc()
            raise Refusal(
                Reason.CAPACITY,
                f"worker overloaded: {len(self.pending)} operations pending (max {self.max_pending}); retry later",
                retry_after_ms=50,
            )

    @guarded
    async def Execute(
        self, request: pb.ExecuteRequest, context: grpc.aio.ServicerContext
    ) -> pb.ExecuteResponse:
        self.admit(1)
        token = object()
        self.pending.add(token)
        try:
            return pb.ExecuteResponse(result=await self.run(self.prepare(request.operation)))
        finally:
            self.pending.discard(token)

    @guarded
    async def ExecuteBatch(
        self, request: pb.ExecuteBatchRequest, context: grpc.aio.ServicerContext
    ) -> pb.ExecuteBatchResponse:
        count = len(request.operations)
        if count > MAX_BATCH:
            raise Refusal(Reason.INVALID_REQUEST, f"batch of {count} operations (max {MAX_BATCH})")
        self.admit(count)
        try:
            prepared = [self._request(op) for op in request.operations]
        except BadOperation as exc:
            raise Refusal(Reason.INVALID_REQUEST, f"operation rejected: {exc}") from None
        # Without a cap of its own the batch's operations all wait for the jails at once, so the
        # pool serves them by priority (a resident step before a create) and on every free jail.
        limit = asyncio.Semaphore(request.max_parallel) if request.max_parallel else None

        async def one(item: Prepared | pb.OperationResult) -> pb.OperationResult:
            if limit is None:
                return await self.run(item)
            async with limit:
                return await self.run(item)

        tokens = [object() for _ in prepared]
        self.pending.update(tokens)
        try:
            results = await asyncio.gather(*(one(item) for item in prepared))
        finally:
            self.pending.difference_update(tokens)
        return pb.ExecuteBatchResponse(results=results)

    async def ExecuteStream(
        self,
        request_iterator: AsyncIterator[pb.ExecuteStreamRequest | Undecodable],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.ExecuteStreamResponse]:
        # An async generator function itself: gRPC (and the auth interceptor) tell streaming
        # handlers apart by that. Failures are answers per operation (sandbox_worker/streaming.py).
        async for answer in execute_stream(request_iterator, context, self, self.stream_in_flight):
            yield answer

    @guarded
    async def GetWorkerInfo(
        self, request: pb.GetWorkerInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetWorkerInfoResponse:
        return pb.GetWorkerInfoResponse(
            jails=self.pool.size,
            jails_alive=self.pool.alive,
            jails_replaced=self.pool.replaced,
            cached_sources=len(self.cache),
            default_limits=limits_message(self.defaults),
            max_limits=limits_message(self.maximum),
            isolation=self.pool.isolation,
            operations=self.pool.operations,
        )

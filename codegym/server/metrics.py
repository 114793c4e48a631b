"""Prometheus metrics every server exports (`--metrics-port`), defined in one place.

RPCs are counted by a server interceptor (method and status code, with a latency histogram), so
no servicer has to remember to; it also gives each call a request id for the logs
(codegym/server/logs.py). The roles add their own figures (sandbox operations by status, jails,
resident steps; LLM requests, tokens, retries and cache hits; pipeline stage outcomes).
"""

from __future__ import annotations

import inspect
import itertools
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from prometheus_client import Counter, Gauge, Histogram, start_http_server

from codegym.server.logs import REQUEST_ID

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60)

RPCS = Counter("codegym_rpc_total", "RPCs handled, by method and status code", ["method", "code"])
RPC_SECONDS = Histogram("codegym_rpc_seconds", "RPC handling time", ["method"], buckets=LATENCY_BUCKETS)

SANDBOX_OPERATIONS = Counter(
    "codegym_sandbox_operations_total", "Sandbox operations run, by kind and status", ["op", "status"]
)
SANDBOX_RETRIES = Counter(
    "codegym_sandbox_retries_total",
    "Operations run again cold after a failure their own code may not have caused, by kind and first status",
    ["op", "status"],
)
SANDBOX_OPERATION_SECONDS = Histogram(
    "codegym_sandbox_operation_seconds",
    "Sandbox operation time (jail round trip)",
    ["op"],
    buckets=LATENCY_BUCKETS,
)
# Every cache on the path of a library of tens of thousands of environments (codegym/bounded_cache.py
# and the jails' compiled code): runtime_envs, worker_sources, jail_code.
CACHE_BYTES = Gauge("codegym_cache_bytes", "Bytes held by a cache (the sum of its entries' costs)", ["cache"])
CACHE_CAPACITY = Gauge("codegym_cache_capacity_bytes", "A cache's byte budget", ["cache"])
CACHE_ENTRIES = Gauge("codegym_cache_entries", "Entries held by a cache", ["cache"])
CACHE_EVENTS = Counter(
    "codegym_cache_events_total", "Cache lookups and evictions: hit, miss, eviction", ["cache", "event"]
)
JAILS_RESTARTED = Counter("codegym_sandbox_jails_restarted_total", "Jails replaced after they died")
JAILS_ALIVE = Gauge("codegym_sandbox_jails_alive", "Jails running")
RESIDENT_STEPS = Counter(
    "codegym_sandbox_resident_steps_total", "Steps served by a session's resident process"
)
COLD_STEPS = Counter(
    "codegym_sandbox_cold_steps_total",
    "Steps that ran cold (fork, unpickle), by cause: new (no process held the session here), "
    "stale (the process held another state), full (no room: served one-shot), sparse (the session "
    "steps further apart than a resident may sit idle: served one-shot)",
    ["cause"],
)
EVICTIONS = Counter(
    "codegym_sandbox_evictions_total",
    "Resident processes ended, by reason: release (session closed), done (episode over), "
    "room (made room for another), idle, failed (a step failed in it), stale",
    ["reason"],
)
RESIDENTS = Gauge("codegym_sandbox_residents", "Resident session processes held by this worker's jails")
RESIDENT_CAPACITY = Gauge(
    "codegym_sandbox_resident_capacity",
    "Resident sessions this worker's memory budget holds at their measured cost",
)
RESIDENT_BUDGET_BYTES = Gauge(
    "codegym_sandbox_resident_budget_bytes",
    "Memory this worker may spend on resident sessions (--resident-memory-mb)",
)
RESIDENT_COST_BYTES = Gauge(
    "codegym_sandbox_resident_cost_bytes", "Measured memory of one resident session (private pages, mean)"
)
RESIDENT_IDLE_SECONDS = Gauge(
    "codegym_sandbox_resident_idle_seconds",
    "The resident idle time: a session stepping further apart gets no resident, and a resident idle "
    "twice this long goes (derived from a resident's measured cost unless --resident-idle-s)",
)
SANDBOX_QUEUE_DEPTH = Gauge("codegym_sandbox_queue_depth", "Operations waiting for a jail")
SANDBOX_REFUSALS = Counter(
    "codegym_sandbox_refusals_total", "Operations refused with CAPACITY (worker queue full)"
)

LLM_REQUESTS = Counter(
    "codegym_llm_requests_total", "HTTP requests to the LLM endpoint (retries included)", ["stage"]
)
LLM_TOKENS = Counter("codegym_llm_tokens_total", "LLM tokens", ["stage", "kind"])
LLM_RETRIES = Counter("codegym_llm_retries_total", "LLM requests retried (429, 5xx, timeouts)", ["stage"])
LLM_CACHE_HITS = Counter(
    "codegym_llm_cache_hits_total", "LLM answers served from the response cache", ["stage"]
)

SESSIONS_OPEN = Gauge("codegym_runtime_sessions_open", "Open sessions in this runtime's store")
SESSIONS_EXPIRED = Counter("codegym_runtime_sessions_expired_total", "Sessions dropped after their idle time")
STEPS = Counter("codegym_runtime_steps_total", "Steps, by outcome (ok or the step error code)", ["outcome"])
STEPS_IN_FLIGHT = Gauge("codegym_runtime_steps_in_flight", "Steps admitted and not yet answered")
ADMISSION_REFUSALS = Counter(
    "codegym_runtime_admission_refusals_total",
    "Calls refused with CAPACITY, by limit: sessions (max open), steps (in flight), queue (a worker's queue)",
    ["limit"],
)
WORKER_QUEUE_DEPTH = Gauge(
    "codegym_runtime_worker_queue_depth",
    "Operations queued for sandbox workers, not yet sent (written to a worker's stream)",
)
# The episode record (services/runtime/episode_record.py): totals and bands only, never an env or
# task label (there are tens of thousands); per-task figures come through the Stats RPC.
RECORD_EVENTS = Counter(
    "codegym_record_events_total",
    "Episode record events: passed / failed episodes, failed_step, shortcut (rewarded in under a "
    "quarter of the oracle's steps), branch (a fork's end, counted apart), dropped (deltas the store "
    "did not take), captured (an episode kept by the capture store), capture_lost (one the store "
    "did not take)",
    ["event"],
)
RECORD_TASKS = Gauge(
    "codegym_record_tasks",
    "Tasks played by any run, by recent pass-rate band (refreshed every 30 s)",
    ["band"],
)
# Per tenant (the tenants a tokens file names: a few, never a trainer's own label).
TENANT_REFUSALS = Counter(
    "codegym_runtime_tenant_refusals_total",
    "Calls refused with CAPACITY by a tenant's quota, by tenant and limit (sessions, steps, creates)",
    ["tenant", "limit"],
)
TENANT_CALLS = Counter(
    "codegym_runtime_tenant_calls_total", "Creates and steps admitted, by tenant and kind", ["tenant", "kind"]
)
TENANT_SESSIONS = Gauge("codegym_runtime_tenant_sessions", "Sessions open, by tenant", ["tenant"])
RECORD_QUARANTINED = Gauge("codegym_record_quarantined_envs", "Environments quarantined from sampling")

PIPELINE_OUTCOMES = Counter(
    "codegym_pipeline_stage_outcomes_total",
    "Pipeline stage outcomes, by stage and status",
    ["stage", "status"],
)


_REQUEST_NUMBERS = itertools.count(1)


def next_request_id() -> str:
    """Unique per server process and cheap on the step path (no random bytes, no system call)."""
    return f"{os.getpid():x}-{next(_REQUEST_NUMBERS):x}"


def serve_metrics(port: int, host: str = "127.0.0.1") -> int:
    """Expose /metrics over HTTP in a background thread; returns the bound port (0 picks one)."""
    server, _ = start_http_server(port, addr=host)
    return int(server.server_address[1])


class MetricsInterceptor(grpc.aio.ServerInterceptor):
    """Counts every RPC by method and final status code and times it."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method.rsplit("/", 1)[-1]
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._unary(method, handler.unary_unary),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._stream(method, handler.unary_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                self._stream(method, handler.stream_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler

    def __init__(self) -> None:
        # Label children resolved once: `labels()` takes a lock and builds a key on every call.
        self._counts: dict[tuple[str, str], Any] = {}
        self._seconds: dict[str, Any] = {}

    def _record(self, method: str, context: Any, started: float, failed: bool) -> None:
        code = context.code() if hasattr(context, "code") else None
        if code is None:
            code = grpc.StatusCode.UNKNOWN if failed else grpc.StatusCode.OK
        name = code.name if isinstance(code, grpc.StatusCode) else str(code)
        counter = self._counts.get((method, name))
        if counter is None:
            counter = self._counts[(method, name)] = RPCS.labels(method, name)
        counter.inc()
        seconds = self._seconds.get(method)
        if seconds is None:
            seconds = self._seconds[method] = RPC_SECONDS.labels(method)
        seconds.observe(time.perf_counter() - started)

    def _unary(self, method: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
        async def wrapped(request: Any, context: Any) -> Any:
            REQUEST_ID.set(next_request_id())
            started = time.perf_counter()
            failed = True
            try:
                result = await behavior(request, context)
                failed = False
                return result
            finally:
                self._record(method, context, started, failed)

        return wrapped

    def _stream(self, method: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
        if not inspect.isasyncgenfunction(behavior):
            # A streaming handler may be a coroutine that writes with context.write (grpc's own
            # health Watch is): time it as a call, and leave its messages alone.
            return self._unary(method, behavior)

        async def wrapped(request: Any, context: Any) -> AsyncIterator[Any]:
            REQUEST_ID.set(next_request_id())
            started = time.perf_counter()
            failed = True
            try:
                async for item in behavior(request, context):
                    yield item
                failed = False
            finally:
                self._record(method, context, started, failed)

        return wrapped

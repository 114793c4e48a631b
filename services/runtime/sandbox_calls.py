"""How the runtime runs an operation on a sandbox worker, and what a worker's failure becomes.

A worker that cannot be reached or does not answer in time is an infrastructure fault
(UNAVAILABLE: nothing was committed, the caller may resend), never the environment's answer; a
full queue is CAPACITY with the step retry-after, so a trainer comes back instead of queueing
behind work it would time out on."""

from __future__ import annotations

import logging

import grpc

from codegym.errors import Reason, Refusal
from codegym.sandbox.v1 import sandbox_service_pb2 as sb
from codegym.server.metrics import ADMISSION_REFUSALS
from services.dispatcher import QueueFull, SandboxDispatcher, SandboxUnavailable
from services.runtime.catalog import Served
from services.runtime.config import RuntimeConfig

log = logging.getLogger(__name__)


async def execute(
    dispatcher: SandboxDispatcher, op: sb.Operation, record: Served, key: str, config: RuntimeConfig
) -> sb.OperationResult:
    """Run `op` for session `key` on a worker.

    A create carries its source: it is most often the first time a worker sees that environment
    (a trainer's batch draws across tens of thousands), and asking first would cost a second trip
    through the queue. Steps and resets send the sha256 alone; the session's worker got the code
    with the create."""
    if op.WhichOneof("kind") == "create":
        op.source.code = record.source
    try:
        return await dispatcher.execute(op, record.source, key)
    except QueueFull as exc:
        ADMISSION_REFUSALS.labels("queue").inc()
        raise Refusal(
            Reason.CAPACITY, f"the sandbox workers are busy ({exc}); retry later", config.step_retry_after_ms
        ) from None
    except SandboxUnavailable as exc:
        raise Refusal(Reason.UNAVAILABLE, str(exc), config.retry_after_ms) from None
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            message = "no sandbox worker answered in time; nothing was applied"
        else:
            log.error("sandbox call failed: %s %s", exc.code().name, exc.details())
            message = f"sandbox call failed ({exc.code().name}): {exc.details()}"
        raise Refusal(Reason.UNAVAILABLE, message, config.retry_after_ms) from None

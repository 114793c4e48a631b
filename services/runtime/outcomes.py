"""What the runtime answers for an operation's outcome: the environment's own failures (a step
error the agent sees, or ENV_FAILED at create/reset), and a resent step's recorded reply.
Infrastructure faults never get here: the worker retried them, and the dispatcher's failures are
UNAVAILABLE (service.py)."""

from __future__ import annotations

import hashlib
import time

from codegym.errors import Reason, Refusal
from codegym.sandbox.v1 import sandbox_service_pb2 as sb
from codegym_client.api.runtime.v1 import runtime_service_pb2 as rt
from services.runtime.requests import shown
from services.runtime.sessions import Session

LIMIT_STATUSES = (sb.STATUS_MEMORY_LIMIT, sb.STATUS_OUTPUT_LIMIT, sb.STATUS_KILLED, sb.STATUS_CRASHED)


def action_digest(action: str) -> str:
    return hashlib.sha256(action.encode()).hexdigest()


def env_failed(result: sb.OperationResult, what: str) -> Refusal:
    """The environment's own failure at create or reset (the worker already retried anything that
    may have come from outside): it fails the same way every time, so ENV_FAILED, never a
    capacity or availability status a trainer would retry for ever."""
    detail = result.message or sb.Status.Name(result.status)
    kind = sb.Status.Name(result.status).removeprefix("STATUS_").lower()
    return Refusal(Reason.ENV_FAILED, f"{what}: the environment failed ({kind}): {detail}")


def recorded_reply(session: Session, step_index: int, action: str) -> rt.StepResponse:
    """A step sent again after its reply was lost: answered from the record, never applied twice.

    Only the same action gets the record: another action with that index is a caller that
    missed a step someone else applied, which must hear so rather than get another's reply."""
    if step_index == session.step_index - 1 and session.last_reply:
        if not session.last_action or session.last_action == action_digest(action):
            return rt.StepResponse.FromString(session.last_reply)
        raise Refusal(
            Reason.STEP_CONFLICT,
            f"step {step_index} of session {shown(session.session_id)} was applied with another action; "
            f"the session is at step {session.step_index}",
        )
    raise Refusal(
        Reason.STEP_CONFLICT,
        f"session {shown(session.session_id)} is at step {session.step_index}, not {step_index}",
    )


def step_error(result: sb.OperationResult) -> rt.StepError | None:
    status = result.status
    if status == sb.STATUS_OK:
        return None
    detail = result.message or sb.Status.Name(status)
    if status == sb.STATUS_TIMEOUT:
        return rt.StepError(code=rt.STEP_ERROR_CODE_STEP_TIMEOUT, message=f"step timed out: {detail}")
    if status in LIMIT_STATUSES:
        name = sb.Status.Name(status).removeprefix("STATUS_").lower()
        return rt.StepError(code=rt.STEP_ERROR_CODE_SANDBOX_LIMIT, message=f"sandbox {name}: {detail}")
    return rt.StepError(code=rt.STEP_ERROR_CODE_ENV_ERROR, message=f"environment error: {detail}")


def session_reply(session: Session, ttl_s: float) -> rt.GetSessionResponse:
    """What GetSession tells of a session: where it stands, and how long it lives unused."""
    if session.truncated:
        status = rt.SESSION_STATUS_TRUNCATED
    elif session.done:
        status = rt.SESSION_STATUS_DONE
    else:
        status = rt.SESSION_STATUS_ACTIVE
    idle = time.monotonic() - session.last_used
    return rt.GetSessionResponse(
        session_id=session.session_id,
        env_id=session.env_id,
        status=status,
        step_index=session.step_index,
        reward=session.reward,
        max_steps=session.max_steps,
        expires_in_s=max(0, int(ttl_s - idle)),
    )

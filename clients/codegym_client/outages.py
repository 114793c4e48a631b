"""Riding out an outage: a call the runtime cannot serve now is sent again, with back-off, for as
long as the operator allows, before its failure ends anything.

A training run lasts hours to days and lives through deploys, evictions and network blips. The
clients' own resends (`resend.py`) cover a lost reply, a few seconds; a runtime restarting, Redis
restarting or the way to the cluster down lasts longer, and ending an episode (or, in TRL, the run)
then would be the wrong answer to a fault that clears by itself. So the trainer adapters wrap
each call in `ride_out` / `ride_out_async`: while the failure is one that clears up by itself
(`UNAVAILABLE`, `CAPACITY`, `OUTCOME_UNKNOWN`, a failure on the way with no answer from the
runtime), the call is sent again after a back-off (1 s doubling to 30 s), with a log line saying
what it waits for, until `wait_s` (the operator's setting, 10 minutes by default) has passed; then the last error is
raised. Every other error is raised at once: it fails the same way again.

Only calls that may be sent twice go through here: creating a session (an orphan expires), a
step sent with its step index (the runtime answers a repeat from its record, never applies it
twice), a reset, a close.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from codegym_client.errors import CodeGymError

__all__ = ["DEFAULT_OUTAGE_WAIT_S", "clears_by_itself", "ride_out", "ride_out_async"]

log = logging.getLogger("codegym_client.outages")

T = TypeVar("T")
# How long a call waits out an outage before its failure is raised (an operator's setting).
DEFAULT_OUTAGE_WAIT_S = 600.0
FIRST_DELAY_S = 1.0
MAX_DELAY_S = 30.0
# Statuses a failure on the way has (no reason from the runtime): the runtime or the way to it down.
TRANSIENT_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED}
)


def clears_by_itself(exc: BaseException) -> bool:
    """Whether the same call may succeed later as it is: the runtime unavailable or full, its
    store failing while it committed a step (`OUTCOME_UNKNOWN`: the calls sent here carry their
    step index, so the runtime answers a repeat from its record), or the way to it broken (a
    status with no reason from the runtime)."""
    if isinstance(exc, CodeGymError):
        return (
            exc.retryable
            or exc.reason == "OUTCOME_UNKNOWN"
            or (exc.reason == "" and exc.code() in TRANSIENT_CODES)
        )
    if isinstance(exc, grpc.RpcError):
        code = exc.code() if callable(getattr(exc, "code", None)) else None
        return code in TRANSIENT_CODES
    return False


class _Backoff:
    """The waits of one call riding out an outage, and the log lines that say so."""

    def __init__(self, what: str, wait_s: float) -> None:
        self.what = what
        self.started = time.monotonic()
        self.deadline = self.started + max(0.0, wait_s)
        self.delay = FIRST_DELAY_S
        self.attempts = 0

    def next_delay(self, exc: BaseException) -> float | None:
        """How long to wait before the next send, or None: give up (raise `exc`)."""
        remaining = self.deadline - time.monotonic()
        if not clears_by_itself(exc) or remaining <= 0:
            if self.attempts:
                log.error(
                    "%s: gave up after %.0f s and %d attempts: %s",
                    self.what,
                    time.monotonic() - self.started,
                    self.attempts + 1,
                    exc,
                )
            return None
        self.attempts += 1
        hint = getattr(exc, "retry_after_s", None)
        delay = min(max(self.delay, hint or 0.0), remaining)
        log.warning(
            "%s: the CodeGym runtime cannot serve it now (%s); waiting %.0f s (attempt %d, giving up in %.0f s)",
            self.what,
            getattr(exc, "reason", "") or type(exc).__name__,
            delay,
            self.attempts,
            remaining,
        )
        self.delay = min(self.delay * 2, MAX_DELAY_S)
        return delay


def ride_out(call: Callable[[], T], what: str, wait_s: float = DEFAULT_OUTAGE_WAIT_S) -> T:
    """`call()`, sent again while its failure clears by itself and `wait_s` lasts (see the module)."""
    backoff = _Backoff(what, wait_s)
    while True:
        try:
            return call()
        except grpc.RpcError as exc:
            delay = backoff.next_delay(exc)
            if delay is None:
                raise
        time.sleep(delay)


async def ride_out_async(
    call: Callable[[], Awaitable[T]], what: str, wait_s: float = DEFAULT_OUTAGE_WAIT_S
) -> T:
    """The asyncio twin of `ride_out`."""
    backoff = _Backoff(what, wait_s)
    while True:
        try:
            return await call()
        except grpc.RpcError as exc:
            delay = backoff.next_delay(exc)
            if delay is None:
                raise
        await asyncio.sleep(delay)

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

Which failures clear by themselves is the `ride out` column of the failure table (errors.py). The
calls of one trainer share one wait (`Outage`: TRL's spec, verl's agent loop and tool): an outage
is counted from the first call it failed, so a batch of rollouts waits it out once, not once per
rollout.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from codegym_client.errors import failure_row

__all__ = ["DEFAULT_OUTAGE_WAIT_S", "Outage", "clears_by_itself", "ride_out", "ride_out_async"]

log = logging.getLogger("codegym_client.outages")

T = TypeVar("T")
# How long a call waits out an outage before its failure is raised (an operator's setting).
DEFAULT_OUTAGE_WAIT_S = 600.0
FIRST_DELAY_S = 1.0
MAX_DELAY_S = 30.0


def clears_by_itself(exc: BaseException) -> bool:
    """Whether the same call may succeed later as it is (the failure table's `ride out`): the
    runtime unavailable or full, its store failing while it committed a step (`OUTCOME_UNKNOWN`:
    the calls sent here carry their step index, so the runtime answers a repeat from its record),
    or the way to it broken (a status with no reason from the runtime)."""
    row = failure_row(exc)
    return row is not None and row.rides_out


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


class Outage:
    """The runtime's outage as the calls of one trainer see it: since when they have failed for a
    reason that clears by itself (None: the last call was answered). The calls share one wait: an
    outage is counted from the first call it failed, so a batch of rollouts waits `wait_s` once,
    not once per rollout; after that each call is sent once (with the client's own resends) until
    a call is answered. Thread-safe; shared by threads and by the tasks of event loops."""

    def __init__(self, wait_s: float = DEFAULT_OUTAGE_WAIT_S) -> None:
        self.wait_s = max(0.0, float(wait_s))
        self.lock = threading.Lock()
        self.since: float | None = None

    def remaining(self) -> float:
        with self.lock:
            if self.since is None:
                return self.wait_s
            return max(0.0, self.since + self.wait_s - time.monotonic())

    def saw(self, exc: BaseException | None) -> None:
        """A call's outcome: answered (`exc` None, or a refusal that does not clear by itself:
        the runtime is up) or not."""
        with self.lock:
            if exc is None or not clears_by_itself(exc):
                self.since = None
            elif self.since is None:
                self.since = time.monotonic()

    def call(self, call: Callable[[], T], what: str, wait_s: float | None = None) -> T:
        """`call()` riding out an outage for what is left of the wait (or `wait_s`)."""

        def attempt() -> T:
            try:
                result = call()
            except grpc.RpcError as exc:
                self.saw(exc)
                raise
            self.saw(None)
            return result

        return ride_out(attempt, what, self.remaining() if wait_s is None else wait_s)

    async def call_async(self, call: Callable[[], Awaitable[T]], what: str, wait_s: float | None = None) -> T:
        """The asyncio twin of `call`."""

        async def attempt() -> T:
            try:
                result = await call()
            except grpc.RpcError as exc:
                self.saw(exc)
                raise
            self.saw(None)
            return result

        return await ride_out_async(attempt, what, self.remaining() if wait_s is None else wait_s)

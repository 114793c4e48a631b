"""Quotas between tenants: what one trainer may hold and start, so a flood from one leaves the others
served.

A tenant is who an access token speaks for (`codegym.server.auth`: the tokens file maps each token to a
tenant, and its `tenants` section gives each tenant its `TenantLimits`). Per runtime replica:
- sessions open: counted from the sessions the store holds for the tenant (never a counter kept by
  hand), checked at create;
- creates and steps per second: a token bucket each, holding one second of its rate, so a burst of
  that size passes and a steady flood is held to the rate.
Past a limit the call gets CAPACITY with the time until the bucket has a token (or, for sessions,
the runtime's retry-after), which the clients honour; nothing else changes, and no other
tenant's bucket or sessions are touched. Without tokens (auth off) every caller is the tenant ""
with no limits.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from codegym.errors import Reason, Refusal
from codegym.server.auth import CALLER, OPERATOR, TenantLimits
from codegym.server.metrics import TENANT_REFUSALS

# The longest retry-after a refused call is told (a flood of thousands is spread over at most this).
MAX_WAIT_S = 30.0


@dataclass
class Bucket:
    """A token bucket: `rate` tokens a second, at most `rate` (one second's) held, at least one.

    A refused call is told when to come back, and the calls refused after it later still, one
    token's time apart (`slot`): twenty rollouts of a flooding tenant told the same instant would
    all come back at once and be refused again, nineteen of them, every token's time, and each
    refusal costs the runtime a call's CPU that the other tenants then wait for."""

    rate: float
    tokens: float = field(default=0.0)
    stamp: float = field(default_factory=time.monotonic)
    # The instant promised to the last refused call.
    slot: float = 0.0

    def __post_init__(self) -> None:
        self.tokens = self.capacity

    @property
    def capacity(self) -> float:
        return max(1.0, self.rate)

    def take(self, now: float | None = None, count: int = 1) -> float:
        """Take `count` tokens, all or none: 0.0 when there were, else the seconds the caller should
        wait. More than the bucket holds (a fork of more than a second's rate) waits for a full one."""
        now = time.monotonic() if now is None else now
        self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        need = min(float(count), self.capacity)
        if self.tokens >= need - 1e-9:  # a token's time later is a token, whatever the rounding
            self.tokens = max(0.0, self.tokens - need)
            return 0.0
        self.slot = max(now + (need - self.tokens) / self.rate, self.slot + 1.0 / self.rate)
        self.slot = min(self.slot, now + MAX_WAIT_S)
        return self.slot - now


class Quotas:
    """Each tenant's limits and buckets in this runtime."""

    def __init__(self, limits: Mapping[str, TenantLimits]) -> None:
        self.limits = dict(limits)
        self.buckets: dict[tuple[str, str], Bucket] = {}

    def limit(self, tenant: str) -> TenantLimits:
        return self.limits.get(tenant, TenantLimits())

    def _bucket(self, tenant: str, kind: str, rate: float) -> Bucket:
        bucket = self.buckets.get((tenant, kind))
        if bucket is None or bucket.rate != rate:
            bucket = self.buckets[(tenant, kind)] = Bucket(rate)
        return bucket

    def _rate(self, tenant: str, kind: str, rate: float, what: str, count: int = 1) -> None:
        if rate <= 0:
            return
        wait_s = self._bucket(tenant, kind, rate).take(count=count)
        if wait_s > 0:
            TENANT_REFUSALS.labels(tenant, kind).inc()
            raise Refusal(
                Reason.CAPACITY,
                f"tenant {tenant!r} is past its {what} quota ({rate:g}/s); retry later",
                max(1, math.ceil(wait_s * 1000)),
            )

    def admit_step(self, tenant: str) -> None:
        self._rate(tenant, "steps", self.limit(tenant).steps_per_s, "steps")

    def admit_create(self, tenant: str, open_sessions: int, retry_after_ms: int, count: int = 1) -> None:
        """Admit `count` new sessions (a create, a restore, or the forks of one ForkSession) or none:
        the session quota and the create rate count every one of them."""
        limit = self.limit(tenant)
        if limit.sessions and open_sessions + count > limit.sessions:
            TENANT_REFUSALS.labels(tenant, "sessions").inc()
            more = f"; {count} more would pass it" if count > 1 else ""
            raise Refusal(
                Reason.CAPACITY,
                f"tenant {tenant!r} holds {open_sessions} sessions (its quota is {limit.sessions}){more}; "
                "close finished sessions or retry",
                retry_after_ms,
            )
        self._rate(tenant, "creates", limit.creates_per_s, "creates", count)


def require_operator(what: str) -> None:
    """Refuse the call unless its token is an operator's (PERMISSION_DENIED): what changes the
    deployment or reads environment code. Without access tokens every caller may."""
    caller = CALLER.get()
    if caller is not None and caller.role != OPERATOR:
        raise Refusal(
            Reason.PERMISSION_DENIED,
            f"{what} takes an operator's token; this token is a {caller.role}'s (tenant {caller.tenant})",
        )

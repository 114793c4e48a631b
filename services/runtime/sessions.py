"""Sessions and where they are kept.

A session is plain data (ids, the task config, the opaque state bytes made by a jail, counters), so
a store can be a dict here or Redis for several runtime replicas (redis_store.py): the
`SessionStore` protocol is all the service relies on: get, put, delete, count, expire, a per-session
lock that serializes steps (a lease across replicas in Redis), a commit that applies a step's
result only if the session is still at the step index the step started from, and a touch that
renews only the session's idle time under the same condition.

Only `put` writes unconditionally, and only creating a session uses it: anything a step or a
reset writes is conditional, because with several replicas the step that wrote last is not
necessarily the one that started last (a replica can stall past its lease while another steps on).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Protocol

from codegym.errors import Unavailable


class StoreUnavailable(Unavailable):
    """The session store cannot be reached (Redis down): the runtime answers UNAVAILABLE."""


@dataclass(slots=True)
class Session:
    """One episode on one task config. `state` is produced and read only inside sandbox jails."""

    session_id: str
    env_id: str
    config_json: str
    state: bytes
    max_steps: int
    step_timeout_ms: int
    seed: int
    step_index: int = 0
    reward: float = 0.0
    done: bool = False
    truncated: bool = False
    last_used: float = 0.0
    # The serialized StepResponse of the last committed step: a client that lost that reply and
    # sends the step again (naming its step index) gets it back instead of a second application.
    last_reply: bytes = b""
    # sha256 of the canonical action that step applied: a resend must carry the same action, or
    # it is a different step sent with a stale index (STEP_CONFLICT), never silently dropped.
    last_action: str = ""
    # sha256 of the code the session was created with: its steps run that code, even when the
    # library's environment changed since or the task was recorded with code of its own ("" from
    # a store written before this field: the environment's code as the library holds it).
    sha256: str = ""
    # The trainer's run and policy version named at create: the episode's outcome is recorded for
    # them (episode_record.py).
    run_id: str = ""
    policy_version: int | None = None
    # The tenant whose token created the session ("" without tokens): only it may use the session.
    tenant: str = ""

    def touch(self, now: float | None = None) -> None:
        self.last_used = time.monotonic() if now is None else now


class SessionStore(Protocol):
    """Where sessions live between steps."""

    async def get(self, session_id: str) -> Session | None: ...

    async def put(self, session: Session) -> None: ...

    async def delete(self, session_id: str) -> bool: ...

    async def commit(self, session: Session, expected_step_index: int) -> bool:
        """Store a step's result if the stored session is still at `expected_step_index`."""
        ...

    async def touch(self, session: Session, step_index: int) -> bool:
        """Renew the session's idle time (its `last_used`, in Redis its TTL) and nothing else, if the
        stored session is still at `step_index`; False (nothing written) otherwise.

        What a failed step, or anything else that does not advance the session, writes: writing the
        whole session back instead would roll back a step another replica committed meanwhile.
        """
        ...

    def lock(self, session_id: str) -> AbstractAsyncContextManager[None]:
        """Held while a step of the session runs."""
        ...

    async def count(self) -> int: ...

    async def count_of(self, tenant: str) -> int:
        """Sessions held for one tenant (its quota)."""
        ...

    async def expire(self, idle_s: float) -> list[str]:
        """Drop sessions idle for longer than `idle_s`; return their ids."""
        ...


class InMemorySessionStore:
    """Sessions in a dict ordered by last use, so expiry only looks at the oldest entries."""

    def __init__(self) -> None:
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._committed: dict[str, int] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        # Session ids by tenant: the same sessions as `_sessions`, added and dropped with them.
        self._tenants: dict[str, set[str]] = {}

    def _drop(self, session_id: str) -> Session | None:
        session = self._sessions.pop(session_id, None)
        self._committed.pop(session_id, None)
        self._locks.pop(session_id, None)
        if session is not None:
            held = self._tenants.get(session.tenant)
            if held is not None:
                held.discard(session_id)
                if not held:
                    del self._tenants[session.tenant]
        return session

    async def get(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id)

    async def put(self, session: Session) -> None:
        self._sessions[session.session_id] = session
        self._sessions.move_to_end(session.session_id)
        self._committed[session.session_id] = session.step_index
        self._tenants.setdefault(session.tenant, set()).add(session.session_id)

    async def commit(self, session: Session, expected_step_index: int) -> bool:
        if self._committed.get(session.session_id) != expected_step_index:
            return False
        await self.put(session)
        return True

    async def touch(self, session: Session, step_index: int) -> bool:
        stored = self._sessions.get(session.session_id)
        if stored is None or self._committed.get(session.session_id) != step_index:
            return False
        stored.last_used = max(stored.last_used, session.last_used)
        self._sessions.move_to_end(session.session_id)  # expiry reads the dict oldest-used first
        return True

    @contextlib.asynccontextmanager
    async def lock(self, session_id: str) -> AsyncIterator[None]:
        lock = self._locks.get(session_id)
        if lock is None:
            lock = self._locks[session_id] = asyncio.Lock()
        async with lock:
            yield

    async def delete(self, session_id: str) -> bool:
        return self._drop(session_id) is not None

    async def count(self) -> int:
        return len(self._sessions)

    async def count_of(self, tenant: str) -> int:
        return len(self._tenants.get(tenant, ()))

    async def expire(self, idle_s: float) -> list[str]:
        cutoff = time.monotonic() - idle_s
        expired: list[str] = []
        while self._sessions:
            session_id, session = next(iter(self._sessions.items()))
            if session.last_used > cutoff:
                break
            self._drop(session_id)
            expired.append(session_id)
        return expired

"""Sessions and where they are kept.

A session is plain data (ids, the task config, the opaque state bytes made by a jail, counters), so
a store can be a dict here or Redis for several runtime replicas (redis_store.py): the
`SessionStore` protocol is all the service relies on: get, put, delete, count, expire, a per-session
lock that serializes steps (a lease across replicas in Redis), a commit that applies a step's
result only if the session is still at the step index the step started from, and a touch that
renews only the session's idle time under the same condition.

Only `put` and `put_new` write unconditionally, and only making a session (a create, a fork, a
restore) uses them: anything a step or a reset writes is conditional, because with several
replicas the step that wrote last is not necessarily the one that started last (a replica can
stall past its lease while another steps on).

Two more things live beside the sessions, so every replica sees them: a session's history (only
with `keep_history`, history.py), appended by the commit of its step; and the idempotency entries
of forks, checkpoints and restores (`recall`/`remember`, idempotency.py), written in the same
atomic write as what they answer (`put_new`, `suspend`) so a resend never finds the effect without
its answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Protocol

from codegym.errors import Unavailable
from services.runtime.history import HistoryWrite


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
    # The create asked for a per-step history (history.py): forks may rewind it (`at_step`).
    keep_history: bool = False
    # A fork (or a restore of one): its outcome is recorded as a branch, apart from episodes, so a
    # prefix shared by several branches is counted once, by the episode it was forked from.
    branch: bool = False
    # Steps of the episode its log keeps for a capture (captures.py): 0 none; `max_steps` or more,
    # every step (a sampled episode); else the first ones, enough to hold a shortcut whole.
    capture_steps: int = 0
    # When the episode started (Unix milliseconds; 0 from a store written before this field).
    started_ms: int = 0

    def touch(self, now: float | None = None) -> None:
        self.last_used = time.monotonic() if now is None else now


class SessionStore(Protocol):
    """Where sessions live between steps."""

    async def get(self, session_id: str) -> Session | None: ...

    async def put(self, session: Session) -> None: ...

    async def delete(self, session_id: str) -> bool: ...

    async def commit(
        self, session: Session, expected_step_index: int, history: HistoryWrite | None = None
    ) -> bool:
        """Store a step's result if the stored session is still at `expected_step_index`, and with
        it `history`'s entry (in the same atomic write: nothing when the commit is refused)."""
        ...

    async def put_new(
        self, made: Sequence[tuple[Session, Sequence[bytes]]], answer: Answer | None = None
    ) -> None:
        """Write new sessions, each with its history (kept to `HistoryBounds`), and the idempotency
        entry that answers the call that made them: all of it or nothing."""
        ...

    async def history(self, session_id: str) -> list[bytes]:
        """The session's history entries, oldest first (empty without one)."""
        ...

    async def suspend(self, session: Session, answer: Answer | None) -> bool:
        """Delete the session (and its history) and write `answer`, at once: a checkpoint that
        closes. False when the session was gone already (nothing written)."""
        ...

    async def recall(self, key: str) -> bytes | None:
        """The idempotency entry stored under `key`, if it has not expired."""
        ...

    async def claim(self, key: str, hold_s: float) -> bytes | None:
        """The idempotency entry under `key` (`PENDING` while a call holds it), or None, having
        marked `key` PENDING for `hold_s` in the same atomic step: this call is then the one that
        answers it (`remember` or `put_new` or `suspend` replaces the mark, `unclaim` drops it)."""
        ...

    async def unclaim(self, key: str) -> None:
        """Drop this call's PENDING mark (it failed: a resend runs the call again)."""
        ...

    async def remember(self, answer: Answer) -> None:
        """Store an idempotency entry (the oldest go past the store's bound)."""
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


# The mark of an idempotency key whose call is running (never a serialized reply: protobuf has no
# field number 0).
PENDING = b"\x00"


@dataclass(frozen=True, slots=True)
class Answer:
    """An idempotency entry: the answer to a call with a request id, kept `ttl_s` and at most
    `bound` of them (the oldest go first)."""

    key: str
    value: bytes
    ttl_s: float
    bound: int


@dataclass(frozen=True, slots=True)
class HistoryBounds:
    """History entries kept per session and across the store (RuntimeConfig's)."""

    keep: int = 256
    total: int = 1_000_000


class InMemorySessionStore:
    """Sessions in a dict ordered by last use, so expiry only looks at the oldest entries."""

    def __init__(self, history: HistoryBounds | None = None) -> None:
        self.history_bounds = history or HistoryBounds()
        # Histories by session (only sessions that keep one), and the session of every entry
        # appended, oldest first: past `total` entries the oldest go, whichever session holds them.
        self._histories: dict[str, deque[bytes]] = {}
        self._appended: deque[str] = deque()
        # Idempotency entries: key -> (expiry on the monotonic clock, answer), oldest first.
        self._answers: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._committed: dict[str, int] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._waiting: dict[str, int] = {}  # users of each lock (held or waiting)
        # Session ids by tenant: the same sessions as `_sessions`, added and dropped with them.
        self._tenants: dict[str, set[str]] = {}

    def _drop(self, session_id: str) -> Session | None:
        session = self._sessions.pop(session_id, None)
        self._committed.pop(session_id, None)
        self._locks.pop(session_id, None)
        self._histories.pop(session_id, None)
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

    async def commit(
        self, session: Session, expected_step_index: int, history: HistoryWrite | None = None
    ) -> bool:
        if self._committed.get(session.session_id) != expected_step_index:
            return False
        await self.put(session)
        if history is not None:
            if history.restart:
                self._histories.pop(session.session_id, None)
            self._append(session.session_id, [history.entry], history.keep, history.total)
        return True

    def _append(self, session_id: str, entries: Sequence[bytes], keep: int, total: int) -> None:
        held = self._histories.get(session_id)
        if held is None:
            held = self._histories[session_id] = deque(maxlen=max(1, keep))
        for item in entries:
            held.append(item)
            self._appended.append(session_id)
        while len(self._appended) > total:
            oldest = self._histories.get(self._appended.popleft())
            if oldest:
                oldest.popleft()

    async def put_new(
        self, made: Sequence[tuple[Session, Sequence[bytes]]], answer: Answer | None = None
    ) -> None:
        for session, entries in made:
            await self.put(session)
            self._histories.pop(session.session_id, None)
            if entries:
                bounds = self.history_bounds
                self._append(session.session_id, entries, bounds.keep, bounds.total)
        if answer is not None:
            await self.remember(answer)

    async def history(self, session_id: str) -> list[bytes]:
        return list(self._histories.get(session_id, ()))

    async def suspend(self, session: Session, answer: Answer | None) -> bool:
        if self._drop(session.session_id) is None:
            return False
        if answer is not None:
            await self.remember(answer)
        return True

    async def recall(self, key: str) -> bytes | None:
        held = self._answers.get(key)
        if held is None or held[0] < time.monotonic():
            return None
        return held[1]

    async def claim(self, key: str, hold_s: float) -> bytes | None:
        held = await self.recall(key)
        if held is not None:
            return held
        self._answers[key] = (time.monotonic() + hold_s, PENDING)
        return None

    async def unclaim(self, key: str) -> None:
        held = self._answers.get(key)
        if held is not None and held[1] == PENDING:
            del self._answers[key]

    async def remember(self, answer: Answer) -> None:
        now = time.monotonic()
        self._answers.pop(answer.key, None)
        self._answers[answer.key] = (now + answer.ttl_s, answer.value)
        while self._answers and (
            len(self._answers) > answer.bound or next(iter(self._answers.values()))[0] < now
        ):
            self._answers.popitem(last=False)

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
        self._waiting[session_id] = self._waiting.get(session_id, 0) + 1
        try:
            async with lock:
                yield
        finally:
            # A lock on anything but a held session (an idempotency key) goes with its last user.
            left = self._waiting.pop(session_id) - 1
            if left:
                self._waiting[session_id] = left
            elif session_id not in self._sessions:
                self._locks.pop(session_id, None)

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

"""Sessions and where they are kept.

A session is plain data (ids, the task config, the opaque state bytes made by a jail, counters), so
a store can be a dict here or Redis for several runtime replicas: the `SessionStore` protocol is
all the service relies on. Locks that serialize steps of one session live in the service, next to
the event loop that takes them.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol


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

    def touch(self, now: float | None = None) -> None:
        self.last_used = time.monotonic() if now is None else now


class SessionStore(Protocol):
    """Where sessions live between steps."""

    async def get(self, session_id: str) -> Session | None: ...

    async def put(self, session: Session) -> None: ...

    async def delete(self, session_id: str) -> bool: ...

    async def count(self) -> int: ...

    async def expire(self, idle_s: float) -> list[str]:
        """Drop sessions idle for longer than `idle_s`; return their ids."""
        ...


class InMemorySessionStore:
    """Sessions in a dict ordered by last use, so expiry only looks at the oldest entries."""

    def __init__(self) -> None:
        self._sessions: OrderedDict[str, Session] = OrderedDict()

    async def get(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id)

    async def put(self, session: Session) -> None:
        self._sessions[session.session_id] = session
        self._sessions.move_to_end(session.session_id)

    async def delete(self, session_id: str) -> bool:
        return self._sessions.pop(session_id, None) is not None

    async def count(self) -> int:
        return len(self._sessions)

    async def expire(self, idle_s: float) -> list[str]:
        cutoff = time.monotonic() - idle_s
        expired: list[str] = []
        while self._sessions:
            session_id, session = next(iter(self._sessions.items()))
            if session.last_used > cutoff:
                break
            del self._sessions[session_id]
            expired.append(session_id)
        return expired

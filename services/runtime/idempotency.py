"""Request ids of ForkSession, CheckpointSession and RestoreSession: a resend gets the first answer.

A client fills in `request_id` and sends the same id again when the reply was lost (an outage, a
deadline), possibly to another replica. The answer is kept in the session store (`Answer`: memory
or Redis, so every replica finds it), written in the same atomic write as the effect it answers
(the forks, the restored session, the suspension), for `idempotency_ttl_s` and at most
`idempotency_entries` of them. A call first claims its id (one atomic store call that returns the
answer, or marks the id pending), so a second send of an id whose first is still running waits
for the first's answer.

The key holds the tenant and the RPC, so one tenant's id never answers another's call.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

from google.protobuf.message import DecodeError, Message

from codegym.errors import Reason, Refusal, Unavailable
from services.runtime.config import RuntimeConfig
from services.runtime.requests import shown
from services.runtime.sessions import PENDING, Answer, SessionStore

# How long a call's claim on its request id holds: a send of the same id waits this long for the
# first's answer. Longer than any of the three calls takes (a suspending checkpoint waits for the
# session's step in flight: up to two 60 s runs), so a live call's resend never runs it twice; a
# claim whose replica died lapses after it.
CLAIM_HOLD_S = 150.0


class Idempotency:
    """The answers of calls with a request id, kept in `store`."""

    def __init__(self, store: SessionStore, config: RuntimeConfig) -> None:
        self.store = store
        self.config = config

    def answer(self, key: str, reply: Message) -> Answer | None:
        """The entry to write with the effect (None for a call without a request id)."""
        if not key:
            return None
        return Answer(
            key, reply.SerializeToString(), self.config.idempotency_ttl_s, self.config.idempotency_entries
        )

    def key(self, tenant: str, method: str, request_id: str) -> str:
        """The entry's key ("" when the call named no request id)."""
        if len(request_id) > self.config.max_request_id:
            raise Refusal(
                Reason.INVALID_REQUEST,
                f"request_id is {len(request_id)} characters long (max {self.config.max_request_id})",
            )
        if not request_id:
            return ""
        return f"{method}:{len(tenant)}:{tenant}:{request_id}"

    async def once[M: Message](
        self, key: str, kind: type[M], run: Callable[[], Awaitable[M]], request_id: str
    ) -> M:
        """`run`'s reply, or the reply a call with the same key got first. `run` writes the entry
        (`answer(key, reply)`) with its effect, so there is never a second effect for one key.

        The key is claimed first (one atomic store call: the answer, or a PENDING mark this call
        sets), so a send that finds the first still running waits for its answer instead of running
        again; a mark whose call died (its replica with it) lapses after `CLAIM_HOLD_S`."""
        if not key:
            return await run()
        held = await self._claimed(key)
        if held is None:
            try:
                return await run()
            except BaseException:
                with contextlib.suppress(Unavailable):
                    held = await self.store.recall(key)
                if held is None or held == PENDING:
                    with contextlib.suppress(Unavailable):
                        await self.store.unclaim(key)
                    raise
                # A send of this key that held it before this one's mark (a mark that lapsed)
                # answered meanwhile: that answer is the call's.
        reply = kind()
        try:
            reply.ParseFromString(held)
        except DecodeError:
            raise Refusal(
                Reason.INVALID_REQUEST, f"request_id {shown(request_id)} answered another call"
            ) from None
        return reply

    async def _claimed(self, key: str) -> bytes | None:
        """The first answer under `key`, waiting while its call runs; None: this call claimed it."""
        deadline = time.monotonic() + CLAIM_HOLD_S
        delay = 0.002
        while True:
            held = await self.store.claim(key, CLAIM_HOLD_S)
            if held != PENDING:
                return held
            if time.monotonic() > deadline:
                raise Unavailable("the first send of this request_id is still running; send it again")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)

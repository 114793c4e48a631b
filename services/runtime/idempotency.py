"""Request ids of ForkSession, CheckpointSession and RestoreSession: a resend gets the first answer.

A client fills in `request_id` and sends the same id again when the reply was lost (an outage, a
deadline), possibly to another replica. The answer is kept in the session store (`Answer`: memory
or Redis, so every replica finds it), written in the same atomic write as the effect it answers
(the forks, the restored session, the suspension), for `idempotency_ttl_s` and at most
`idempotency_entries` of them. Two sends of one id at once are serialized by the store's lock on
the id, so the second waits for the first and gets its answer.

The key holds the tenant and the RPC, so one tenant's id never answers another's call.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from google.protobuf.message import DecodeError, Message

from codegym.errors import Reason, Refusal
from services.runtime.config import RuntimeConfig
from services.runtime.requests import shown
from services.runtime.sessions import Answer, SessionStore


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
        (`answer(key, reply)`) with its effect, so there is never a second effect for one key."""
        if not key:
            return await run()
        async with self.store.lock("request:" + key):
            held = await self.store.recall(key)
            if held is None:
                return await run()
            reply = kind()
            try:
                reply.ParseFromString(held)
            except DecodeError:
                raise Refusal(
                    Reason.INVALID_REQUEST, f"request_id {shown(request_id)} answered another call"
                ) from None
            return reply

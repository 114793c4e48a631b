"""Sessions in Redis, so several runtime replicas serve any session and one can die without loss.

A session is a Redis hash (`codegym:session:{id}`) with the idle TTL as the key's expiry, renewed
on every write; a sorted set indexes live sessions by expiry time for counting and for reporting
expiries. Steps of one session are serialized across replicas by a lease (`SET NX PX` with a
random token, released only by its holder). The holder renews its lease every third of its length
while the step runs, so a step longer than the lease (steps may run 60 s, the lease is 5 s by
default) keeps it; a replica that dies stops renewing, so its session is free again after at most
the lease.

A replica can still lose its lease while it lives (frozen, or cut off from Redis, for longer than
the lease), and another replica may then step the session. So nothing a step writes is
unconditional: its result is committed only if the session is still at the step index the step
started from *and* the step's lease is still held (one Lua script; a renewal that found the lease
gone refuses the commit at once), and a failed step only renews the session's TTL, again only at
the step index it started from, never writing the state back over a newer one.

A session that keeps a history has a list beside its hash (`codegym:history:{id}`), appended by
the commit script itself, so a step whose lease was lost appends nothing; a list of the session
of every entry appended (`codegym:history-order`) lets the script drop the oldest entries across
the runtime past its bound. Idempotency entries are keys of their own with a TTL
(`codegym:answer:{key}`), indexed by time in a sorted set that keeps at most the bound.

Redis being unreachable is `StoreUnavailable`, which the runtime answers as UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import secrets
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from services.runtime.history import HistoryWrite
from services.runtime.sessions import PENDING, Answer, HistoryBounds, Session, StoreUnavailable

log = logging.getLogger(__name__)

# Append ARGV[i] (a history entry of session ARGV[i+1], list KEYS[h]) and trim: the list to its
# last ARGV[keep] entries, every list to ARGV[total] entries together (oldest first, by the order
# list KEYS[o], whose members name the session; ARGV[prefix] .. session is its list).
HISTORY_APPEND = """
local function append(list, order, entry, session, keep, total, prefix, ttl)
  redis.call('RPUSH', list, entry)
  redis.call('LTRIM', list, -tonumber(keep), -1)
  redis.call('PEXPIRE', list, ttl)
  redis.call('RPUSH', order, session)
  while redis.call('LLEN', order) > tonumber(total) do
    redis.call('LPOP', prefix .. redis.call('LPOP', order))
  end
end
"""
# Replace the hash only if its step_index is still ARGV[1] and, when a lease token is given
# (ARGV[5]), the step lease KEYS[3] still holds it; then renew the expiry and the index. With a
# history (KEYS[5], the order list KEYS[6]): clear it when ARGV[6] is '1', append ARGV[7] unless
# empty (ARGV[8] kept per session, ARGV[9] in all, ARGV[10] the lists' prefix).
COMMIT = (
    HISTORY_APPEND
    + """
if redis.call('HGET', KEYS[1], 'step_index') ~= ARGV[1] then return 0 end
if ARGV[5] ~= '' and redis.call('GET', KEYS[3]) ~= ARGV[5] then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 11))
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[4])
if #KEYS >= 4 then redis.call('ZADD', KEYS[4], ARGV[3], ARGV[4]) end
if #KEYS >= 6 then
  if ARGV[6] == '1' then redis.call('DEL', KEYS[5]) end
  if ARGV[7] ~= '' then
    append(KEYS[5], KEYS[6], ARGV[7], ARGV[4], ARGV[8], ARGV[9], ARGV[10], ARGV[2])
  end
end
return 1
"""
)
# New sessions' histories: KEYS[1] the order list, then each session's list; ARGV: keep, total,
# prefix, ttl, then per session its id, its entry count and the entries.
HISTORY_PUT = (
    HISTORY_APPEND
    + """
local at = 5
for i = 2, #KEYS do
  local session, n = ARGV[at], tonumber(ARGV[at + 1])
  redis.call('DEL', KEYS[i])
  for j = 1, n do
    append(KEYS[i], KEYS[1], ARGV[at + 1 + j], session, ARGV[1], ARGV[2], ARGV[3], ARGV[4])
  end
  at = at + 2 + n
end
return 1
"""
)
# Claim the idempotency key KEYS[1]: its value when set (an answer, or the PENDING mark ARGV[1] of
# a call still running); else nil, having set the mark for ARGV[2] ms.
CLAIM = """
local held = redis.call('GET', KEYS[1])
if held then return held end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return false
"""
# Drop KEYS[1] only while it is still the PENDING mark ARGV[1] (never an answer written meanwhile).
UNCLAIM = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
# An idempotency entry KEYS[1] (ARGV[1], for ARGV[2] ms), indexed by expiry (ARGV[5]) in KEYS[2]
# under its key ARGV[3]; expired members leave the index (now: ARGV[6]) and past ARGV[4] entries
# the oldest go (ARGV[7] .. member is an entry's key).
REMEMBER = """
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[5], ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', ARGV[6])
local over = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[4])
if over > 0 then
  local popped = redis.call('ZPOPMIN', KEYS[2], over)
  for i = 1, #popped, 2 do redis.call('DEL', ARGV[7] .. popped[i]) end
end
return 1
"""
# Renew only the expiry (the idle TTL) and the index, if the step_index is still ARGV[1]: what a
# failed step writes. The hash itself (state, step_index, reward, done...) is never touched.
TOUCH = """
if redis.call('HGET', KEYS[1], 'step_index') ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[4])
if #KEYS >= 3 then redis.call('ZADD', KEYS[3], ARGV[3], ARGV[4]) end
if #KEYS >= 4 then redis.call('PEXPIRE', KEYS[4], ARGV[2]) end
return 1
"""
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
# Extend the lease only while it is still ours (same token); 0 means it was lost.
EXTEND = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""


# Longer than a live holder can keep a session's lease: a step of at most 60 s, which a worker may
# run twice (once more cold after a failure from outside, see sandbox_worker/pool.py), plus slack.
LOCK_WAIT_S = 2 * 60.0 + 15.0


@dataclass(slots=True)
class _Lease:
    """A step lease this task holds: the lock key, its token, and whether renewal found it gone."""

    name: str
    token: str
    lost: bool = False


# The lease held by the running task, set by `lock()` for the length of its block: `commit` reads
# it, so the protocol's `commit(session, step_index)` needs no lease argument, and two steps of one
# session in one replica (which wait for each other in Redis) never see each other's lease.
_LEASE: contextvars.ContextVar[_Lease | None] = contextvars.ContextVar("codegym_step_lease", default=None)


def _mapping(session: Session) -> dict[Any, Any]:
    return {
        "env_id": session.env_id,
        "config_json": session.config_json,
        "state": session.state,
        "max_steps": session.max_steps,
        "step_timeout_ms": session.step_timeout_ms,
        "seed": session.seed,
        "step_index": session.step_index,
        "reward": repr(session.reward),
        "done": int(session.done),
        "truncated": int(session.truncated),
        "last_reply": session.last_reply,
        "last_action": session.last_action,
        "sha256": session.sha256,
        "run_id": session.run_id,
        "policy_version": "" if session.policy_version is None else session.policy_version,
        "tenant": session.tenant,
        "keep_history": int(session.keep_history),
        "branch": int(session.branch),
        "capture_steps": session.capture_steps,
        "started_ms": session.started_ms,
    }


class RedisSessionStore:
    """A `SessionStore` on Redis (the `redis` package's asyncio client). Create inside the loop."""

    def __init__(
        self,
        url: str,
        ttl_s: float,
        *,
        lease_s: float = 5.0,
        prefix: str = "codegym:",
        history: HistoryBounds | None = None,
    ) -> None:
        self.history_bounds = history or HistoryBounds()
        self.history_order = f"{prefix}history-order"
        self.answers = f"{prefix}answers"
        self.redis = aioredis.from_url(url, socket_connect_timeout=2, socket_timeout=5)
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.lease_ms = int(lease_s * 1000)
        self.prefix = prefix
        self.index = f"{prefix}sessions"
        self._commit = self.redis.register_script(COMMIT)
        self._touch = self.redis.register_script(TOUCH)
        self._release = self.redis.register_script(RELEASE)
        self._extend = self.redis.register_script(EXTEND)
        self._history_put = self.redis.register_script(HISTORY_PUT)
        self._remember = self.redis.register_script(REMEMBER)
        self._claim = self.redis.register_script(CLAIM)
        self._unclaim = self.redis.register_script(UNCLAIM)
        self._renewals: set[asyncio.Task[None]] = set()  # referenced until done (the loop keeps weak ones)

    def key(self, session_id: str) -> str:
        return f"{self.prefix}session:{session_id}"

    def tenant_index(self, tenant: str) -> str:
        """The tenant's sessions, scored by expiry like `index` (its quota counts them)."""
        return f"{self.prefix}tenant-sessions:{tenant}"

    def history_key(self, session_id: str) -> str:
        return f"{self.prefix}history:{session_id}"

    def answer_key(self, key: str) -> str:
        return f"{self.prefix}answer:{key}"

    def lock_key(self, session_id: str) -> str:
        return f"{self.prefix}lock:{session_id}"

    async def close(self) -> None:
        for renewal in list(self._renewals):
            renewal.cancel()
        await self.redis.aclose()

    @contextlib.asynccontextmanager
    async def _calls(self) -> AsyncIterator[None]:
        try:
            yield
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"session store (Redis) unavailable: {exc}") from exc

    async def get(self, session_id: str) -> Session | None:
        async with self._calls():
            raw: dict[Any, Any] = await self.redis.hgetall(self.key(session_id))
        if not raw:
            return None
        f: dict[str, Any] = {k.decode(): v for k, v in raw.items()}
        session = Session(
            session_id=session_id,
            env_id=f["env_id"].decode(),
            config_json=f["config_json"].decode(),
            state=bytes(f["state"]),
            max_steps=int(f["max_steps"]),
            step_timeout_ms=int(f["step_timeout_ms"]),
            seed=int(f["seed"]),
            step_index=int(f["step_index"]),
            reward=float(f["reward"]),
            done=f["done"] == b"1",
            truncated=f["truncated"] == b"1",
            last_reply=bytes(f.get("last_reply", b"")),
            last_action=bytes(f.get("last_action", b"")).decode(),
            sha256=bytes(f.get("sha256", b"")).decode(),
            run_id=bytes(f.get("run_id", b"")).decode(),
            policy_version=int(f["policy_version"]) if f.get("policy_version") else None,
            tenant=bytes(f.get("tenant", b"")).decode(),
            keep_history=f.get("keep_history") == b"1",
            branch=f.get("branch") == b"1",
            capture_steps=int(f.get("capture_steps") or 0),
            started_ms=int(f.get("started_ms") or 0),
        )
        session.touch()  # Redis holds only live sessions (its expiry is the idle TTL)
        return session

    async def put(self, session: Session) -> None:
        key = self.key(session.session_id)
        async with self._calls(), self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping=_mapping(session))
            pipe.pexpire(key, self.ttl_ms)
            pipe.zadd(self.index, {session.session_id: time.time() + self.ttl_ms / 1000})
            pipe.zadd(
                self.tenant_index(session.tenant), {session.session_id: time.time() + self.ttl_ms / 1000}
            )
            await pipe.execute()

    async def commit(
        self, session: Session, expected_step_index: int, history: HistoryWrite | None = None
    ) -> bool:
        """The step's result, if the session is still at `expected_step_index` and, inside `lock()`,
        the lease is still this step's: a step whose lease ran out is not applied even when nobody
        stepped meanwhile, because the replica that holds the lease now may be stepping from the
        same index."""
        token = ""
        lease = _LEASE.get()
        if lease is not None and lease.name == self.lock_key(session.session_id):
            if lease.lost:
                return False
            token = lease.token
        args: list[Any] = [
            expected_step_index,
            self.ttl_ms,
            time.time() + self.ttl_ms / 1000,
            session.session_id,
            token,
            "1" if history is not None and history.restart else "0",
            b"" if history is None else history.entry,
            1 if history is None else max(1, history.keep),
            1 if history is None else max(1, history.total),
            f"{self.prefix}history:",
        ]
        for name, value in _mapping(session).items():
            args += [name, value]
        keys = [
            self.key(session.session_id),
            self.index,
            self.lock_key(session.session_id),
            self.tenant_index(session.tenant),
            self.history_key(session.session_id),
            self.history_order,
        ]
        async with self._calls():
            done = await self._commit(keys=keys, args=args)
        return bool(done)

    async def touch(self, session: Session, step_index: int) -> bool:
        """Renew the session's TTL if it is still at `step_index`; nothing else is written (see
        `SessionStore.touch`). A session gone from Redis stays gone."""
        args: list[Any] = [step_index, self.ttl_ms, time.time() + self.ttl_ms / 1000, session.session_id]
        async with self._calls():
            keys = [
                self.key(session.session_id),
                self.index,
                self.tenant_index(session.tenant),
                self.history_key(session.session_id),
            ]
            done = await self._touch(keys=keys, args=args)
        return bool(done)

    async def delete(self, session_id: str) -> bool:
        async with self._calls():
            tenant = await self.redis.hget(self.key(session_id), "tenant")
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.delete(self.key(session_id))
                pipe.delete(self.history_key(session_id))
                pipe.zrem(self.index, session_id)
                owner = tenant.decode() if isinstance(tenant, bytes) else str(tenant or "")
                pipe.zrem(self.tenant_index(owner), session_id)
                deleted, _, _, _ = await pipe.execute()
        return bool(deleted)

    def _put_on(self, pipe: Any, session: Session) -> None:
        key = self.key(session.session_id)
        expiry = time.time() + self.ttl_ms / 1000
        pipe.hset(key, mapping=_mapping(session))
        pipe.pexpire(key, self.ttl_ms)
        pipe.zadd(self.index, {session.session_id: expiry})
        pipe.zadd(self.tenant_index(session.tenant), {session.session_id: expiry})

    async def _remember_on(self, pipe: Any, answer: Answer) -> None:
        now = time.time()
        await self._remember(
            keys=[self.answer_key(answer.key), self.answers],
            args=[
                answer.value,
                max(1, int(answer.ttl_s * 1000)),
                answer.key,
                max(1, answer.bound),
                now + answer.ttl_s,
                now,
                f"{self.prefix}answer:",
            ],
            client=pipe,
        )

    async def put_new(
        self, made: Sequence[tuple[Session, Sequence[bytes]]], answer: Answer | None = None
    ) -> None:
        """All in one MULTI: the sessions, their histories (one script) and the answer."""
        bounds = self.history_bounds
        keys = [self.history_order]
        args: list[Any] = [max(1, bounds.keep), max(1, bounds.total), f"{self.prefix}history:", self.ttl_ms]
        async with self._calls(), self.redis.pipeline(transaction=True) as pipe:
            for session, entries in made:
                self._put_on(pipe, session)
                keys.append(self.history_key(session.session_id))
                args += [session.session_id, len(entries), *entries]
            await self._history_put(keys=keys, args=args, client=pipe)
            if answer is not None:
                await self._remember_on(pipe, answer)
            await pipe.execute()

    async def history(self, session_id: str) -> list[bytes]:
        async with self._calls():
            entries: list[Any] = await self.redis.lrange(self.history_key(session_id), 0, -1)
        return [bytes(x) for x in entries]

    async def suspend(self, session: Session, answer: Answer | None) -> bool:
        async with self._calls(), self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(self.key(session.session_id))
            pipe.delete(self.history_key(session.session_id))
            pipe.zrem(self.index, session.session_id)
            pipe.zrem(self.tenant_index(session.tenant), session.session_id)
            if answer is not None:
                await self._remember_on(pipe, answer)
            done = await pipe.execute()
        return bool(done[0])

    async def recall(self, key: str) -> bytes | None:
        async with self._calls():
            value: Any = await self.redis.get(self.answer_key(key))
        return None if value is None else bytes(value)

    async def claim(self, key: str, hold_s: float) -> bytes | None:
        async with self._calls():
            held: Any = await self._claim(
                keys=[self.answer_key(key)], args=[PENDING, max(1, int(hold_s * 1000))]
            )
        return None if held is None else bytes(held)

    async def unclaim(self, key: str) -> None:
        async with self._calls():
            await self._unclaim(keys=[self.answer_key(key)], args=[PENDING])

    async def remember(self, answer: Answer) -> None:
        async with self._calls(), self.redis.pipeline(transaction=True) as pipe:
            await self._remember_on(pipe, answer)
            await pipe.execute()

    async def count_of(self, tenant: str) -> int:
        async with self._calls():
            await self.redis.zremrangebyscore(self.tenant_index(tenant), "-inf", time.time())
            return int(await self.redis.zcard(self.tenant_index(tenant)))

    async def count(self) -> int:
        async with self._calls():
            await self.redis.zremrangebyscore(self.index, "-inf", time.time())
            return int(await self.redis.zcard(self.index))

    async def expire(self, idle_s: float) -> list[str]:
        """Sessions whose key Redis let expire (the idle TTL is the key's expiry)."""
        now = time.time()
        async with self._calls():
            members: list[Any] = await self.redis.zrangebyscore(self.index, "-inf", now)
            gone = [x.decode() for x in members]
            if gone:
                await self.redis.zrem(self.index, *gone)
        return gone

    @contextlib.asynccontextmanager
    async def lock(self, session_id: str, wait_s: float = LOCK_WAIT_S) -> AsyncIterator[None]:
        """The session's step lease, across replicas; waits up to `wait_s` for the holder.

        Renewed in the background while the block runs, so it outlives any step of a live replica
        and no longer than `lease_s` a dead one. Losing it anyway (see the module's docstring)
        makes `commit` refuse the step's result."""
        name = self.lock_key(session_id)
        token = secrets.token_hex(8)
        deadline = time.monotonic() + wait_s
        delay = 0.002
        async with self._calls():
            while not await self.redis.set(name, token, nx=True, px=self.lease_ms):
                if time.monotonic() > deadline:
                    raise StoreUnavailable(f"session {session_id} is busy (its step lease was not released)")
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.05)
        lease = _Lease(name, token)
        renewal = asyncio.get_running_loop().create_task(self._renew(lease))
        self._renewals.add(renewal)
        renewal.add_done_callback(self._renewals.discard)
        held = _LEASE.set(lease)
        try:
            yield
        finally:
            # Not awaited: a step being cancelled must still reach the release below.
            renewal.cancel()
            try:
                with contextlib.suppress(RedisError, OSError):
                    await self._release(keys=[name], args=[token])
            finally:
                _LEASE.reset(held)

    async def _renew(self, lease: _Lease) -> None:
        """Extend `lease` every third of its length until cancelled or found lost.

        An unreachable Redis is tried again at the next tick: if the lease expired meanwhile, the
        first answer after that says so (and the commit checks the token itself anyway)."""
        interval = self.lease_ms / 3000
        while True:
            await asyncio.sleep(interval)
            try:
                extended = await self._extend(keys=[lease.name], args=[lease.token, self.lease_ms])
            except (RedisError, OSError):
                continue
            if not extended:
                lease.lost = True
                log.warning(
                    "step lease %s lost while its step ran; the step will not be committed", lease.name
                )
                return

"""Which waiting operation a freed jail goes to (sandbox_worker/scheduling.py), without jails.

The scheduler only hands out jail indexes, so it is driven here directly: operations queue for
busy jails, jails are released one at a time, and the order they were handed out is the effect.
"""

from __future__ import annotations

import asyncio

from sandbox_worker.scheduling import COLD, OTHER, RESIDENT, JailScheduler


def scheduler(jails: int) -> JailScheduler:
    s = JailScheduler(lambda idle: min(idle))
    for index in range(jails):
        s.up(index)
    return s


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_freed_jail_goes_to_resident_steps_before_cold_steps_before_creates() -> None:
    s = scheduler(1)
    assert await s.acquire(None, OTHER) == 0
    order: list[str] = []

    async def wait(name: str, want: int | None, priority: int) -> None:
        await s.acquire(want, priority)
        order.append(name)
        s.release(0)

    tasks = [
        asyncio.create_task(wait(name, want, priority))
        for name, want, priority in [
            ("create-1", None, OTHER),
            ("cold-1", None, COLD),
            ("create-2", None, OTHER),
            ("resident-1", 0, RESIDENT),
            ("cold-2", None, COLD),
            ("resident-2", 0, RESIDENT),
        ]
    ]
    await settle()
    assert s.depth == 6
    s.release(0)
    await asyncio.gather(*tasks)
    assert order == ["resident-1", "resident-2", "cold-1", "cold-2", "create-1", "create-2"]
    assert s.depth == 0 and not s.busy


async def test_a_session_waits_for_its_own_jail_while_others_take_any() -> None:
    s = scheduler(2)
    assert await s.acquire(0, RESIDENT) == 0
    mine = asyncio.create_task(s.acquire(0, RESIDENT))
    other = asyncio.create_task(s.acquire(None, OTHER))
    await settle()
    # Jail 1 is idle: the operation that takes any jail got it, the one pinned to 0 still waits.
    assert other.done() and other.result() == 1
    assert not mine.done()
    s.release(0)
    assert await mine == 0


async def test_waiters_of_a_jail_that_goes_down_are_served_by_another() -> None:
    s = scheduler(2)
    assert await s.acquire(0, RESIDENT) == 0
    assert await s.acquire(1, RESIDENT) == 1
    pinned = asyncio.create_task(s.acquire(0, RESIDENT))
    await settle()
    s.down(0)  # jail 0 died while its session's step waited for it
    s.release(1)
    assert await pinned == 1


async def test_a_waiter_that_gives_up_does_not_keep_the_jail() -> None:
    s = scheduler(1)
    assert await s.acquire(None, OTHER) == 0
    impatient = asyncio.create_task(s.acquire(None, RESIDENT))
    patient = asyncio.create_task(s.acquire(None, OTHER))
    await settle()
    impatient.cancel()
    await settle()
    s.release(0)
    assert await patient == 0
    assert s.depth == 0 and s.busy == {0}

"""Which waiting operation gets a jail when one frees up: the most urgent, then the oldest.

A jail serves one operation at a time, and a trainer's load mixes three kinds with very different
costs: steps of sessions resident in the jail (a fraction of a millisecond of the jail's time),
steps that run cold (a fork, several milliseconds), and creates, resets and one-shot operations
(a fork and the environment's own start-up). Served first come first served, a burst of creates
at the start of a training step, or the cold steps of sessions that do not fit, would make every
resident step wait behind them; served by priority, the steps of the episodes already running go
first, cold steps next, and everything else with the time that is left.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable

# Lower goes first.
RESIDENT = 0
COLD = 1
OTHER = 2

Waiter = tuple[int, int, "asyncio.Future[int]"]


class JailScheduler:
    """Hands out jail indexes: a wanted jail when it is up (waiting while it is busy), else any idle
    one (`pick` chooses among them); waiters are served by (priority, arrival)."""

    def __init__(self, pick: Callable[[list[int]], int]) -> None:
        self.pick = pick
        self.ready: set[int] = set()
        self.busy: set[int] = set()
        # Waiters by the jail they want (None: any jail), each a heap of (priority, arrival, future).
        self.queues: dict[int | None, list[Waiter]] = {None: []}
        self.waiting: set[asyncio.Future[int]] = set()
        self._arrivals = itertools.count()

    @property
    def depth(self) -> int:
        """Operations waiting for a jail."""
        return len(self.waiting)

    def _idle(self) -> list[int]:
        return [i for i in self.ready if i not in self.busy]

    async def acquire(self, want: int | None, priority: int) -> int:
        if want is not None and want not in self.ready:
            want = None  # its jail is down: any jail serves the session cold
        if want is None:
            idle = self._idle()
            if idle:
                index = self.pick(idle)
                self.busy.add(index)
                return index
        elif want not in self.busy:
            self.busy.add(want)
            return want
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        heapq.heappush(self.queues.setdefault(want, []), (priority, next(self._arrivals), future))
        self.waiting.add(future)
        try:
            return await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release(future.result())  # handed over as the waiter gave up: pass it on
            raise
        finally:
            self.waiting.discard(future)

    def release(self, index: int) -> None:
        """The jail is free again: hand it to the most urgent waiter that can take it."""
        self.busy.discard(index)
        if index in self.ready:
            self._dispatch(index)

    def up(self, index: int) -> None:
        self.ready.add(index)
        if index not in self.busy:
            self._dispatch(index)

    def down(self, index: int) -> None:
        """The jail is gone (restarting): its waiters wait for any jail instead."""
        self.ready.discard(index)
        self.busy.discard(index)
        moved = self.queues.pop(index, [])
        for waiter in moved:
            heapq.heappush(self.queues[None], waiter)
        for idle in self._idle():
            self._dispatch(idle)

    def _dispatch(self, index: int) -> None:
        own, anyone = self.queues.get(index, []), self.queues[None]
        for queue in (own, anyone):
            while queue and queue[0][2].done():
                heapq.heappop(queue)  # cancelled while waiting
        if not own and not anyone:
            return
        queue = own if own and (not anyone or own[0][:2] < anyone[0][:2]) else anyone
        _, _, future = heapq.heappop(queue)
        self.busy.add(index)
        future.set_result(index)

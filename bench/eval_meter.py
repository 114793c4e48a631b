"""What the eval bench (bench/eval_bench.py) measures of one run, turn by turn (`Meter`), apart from
the bench that fills it and the table (bench/eval_tables.py) that reads it."""

from __future__ import annotations

import asyncio
import time


class Meter:
    """Per-turn figures of one run: wall and CPU inside each call, and the gaps between them.

    A gap is the synchronous stretch of one episode between the return of one instrumented call
    and the start of the next (no await in between, so nothing else runs on the event loop): the
    agent loop's own work. A turn's share is the gap after its LLM call (parse the reply, build
    the assistant message) plus the gap after its step (record it, build the next message, loop);
    the stretch between the session's creation and the first LLM call joins the first turn.
    """

    def __init__(self) -> None:
        self.wall: dict[str, list[float]] = {"chat": [], "step": [], "session": []}
        self.cpu: dict[str, float] = {"chat": 0.0, "step": 0.0, "session": 0.0, "loop": 0.0}
        self.loop_wall: list[float] = []  # one entry per turn
        self.last: dict[int, tuple[str, float, float]] = {}  # episode task -> (call, perf, CPU)
        self.gap: dict[int, float] = {}  # episode task -> loop time of its current turn so far
        self.turn: dict[int, int] = {}  # episode task -> number of its current turn
        self.chat_cpu_by_turn: list[tuple[int, float]] = []

    def enter(self, what: str) -> None:
        wall, cpu = time.perf_counter(), time.thread_time()
        key = id(asyncio.current_task())
        if what == "chat":
            self.turn[key] = self.turn.get(key, 0) + 1
        last = self.last.pop(key, None)
        if what == "create":
            self.turn.pop(key, None)
        if what == "create" or last is None:
            self.gap.pop(key, None)
            return
        previous, exit_wall, exit_cpu = last
        self.cpu["loop"] += cpu - exit_cpu
        spent = self.gap.pop(key, 0.0) + wall - exit_wall
        if previous == "step" and what in ("chat", "close"):
            self.loop_wall.append(spent)  # the turn is complete
        else:
            self.gap[key] = spent

    def exit(self, what: str, wall: float, cpu: float) -> None:
        bucket = "session" if what in ("create", "close") else what
        self.wall[bucket].append(wall)
        self.cpu[bucket] += cpu
        key = id(asyncio.current_task())
        if what == "chat":
            self.chat_cpu_by_turn.append((self.turn.get(key, 0), cpu))
        if what != "close":
            self.last[key] = (what, time.perf_counter(), time.thread_time())

"""How many resident sessions a worker keeps, and for how long: a memory budget divided by what one
really costs, and an idle time after which one is not worth its memory.

A resident session is a forked interpreter holding one live environment. What it costs is the
memory no other process shares with it (its private pages: copy-on-write copies of the zygote's
pages its own code touched, its own objects), its page tables, and the kernel's per-process
structures. That cost depends on the environments served, so it is measured on the live
processes (`sample_cost`, every few seconds, off the event loop) instead of assumed; the cap each
jail is told with every request is its share of the budget divided by that cost. Until a sample
exists the cost is taken as `DEFAULT_COST` (measured with the sample environments, rounded up).

The budget is the operator's (`--resident-memory-mb`, from the pod's memory limit); without one it
is a share of the memory this worker may use (`default_budget_mb`). A jail's ceiling, the most it
holds whatever the budget (`JAIL_CEILING` unless `--resident-cap` says), and the cap each request
carries are a pair, defined and explained together in `codegym/inside/settings.py`.

Residents are a cache of the sessions stepped recently, not one process per rollout in flight: an
idle rollout needs only its committed state (kilobytes, which the runtime holds anyway), and its
next step can run cold from it. What a resident buys is CPU: each step of its session costs
`WARM_STEP_CPU_S` instead of `COLD_STEP_CPU_S`. What it costs is its memory for as long as it is
held. Priced at the machine's own exchange rate, its memory per CPU (one CPU-second is worth that
many byte-seconds: what a machine of this shape charges for either), a resident is worth keeping
while its session steps again within

    idle time = (COLD_STEP_CPU_S - WARM_STEP_CPU_S) x memory per CPU / the measured cost of a resident

and not after (`Residency.idle_s`: about 37 s on a 2-CPU machine of 24 GiB at 1.6 MiB a
resident). A session that steps further apart than that gets no resident at all (the runtime tells
the worker how long the session sat idle before each step, its think time): at agentic think times
of a minute, a rollout in flight costs its kilobytes, not a process. The budget still bounds what
the jails hold when more sessions step within the idle time than it pays for.

A resident whose session has not stepped for `HOLD_FACTOR` times the idle time goes
(`Residency.hold_s`), by the session's clock, not the jail's. The jail's clock also counts the time
the session's next step spends queued on its way, seconds under load; a resident evicted because
the stack was slow makes the next step cold, which makes the stack slower still (measured: 4,096
rollouts at think 16 s on a shared machine fell to 34 % served, then 19 %, as residents went after
their idle time by the jail's clock). So the worker measures how late steps reach their jail
beyond their sessions' think time (`Lateness`) and adds that to the time a resident is held. Twice
the break-even, because a model's turns vary in length: one long turn should not cost its session
its process, and one that stopped stepping costs at most three times what the best choice in
hindsight would have (held for twice the break-even, then a cold step).
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

from codegym import proctree
from codegym.inside.settings import JAIL_CEILING
from sandbox_worker.limits import ID_SPAN

log = logging.getLogger(__name__)

MIB = 1024 * 1024
# What one resident session cost with the sample environments on Python 3.12 (about 2.1 MiB of
# private pages, 0.16 MiB of page tables), rounded up: the estimate before the first sample.
DEFAULT_COST = 3 * MIB
# No resident session costs less than this: the jail's pid, fd and id limits are sized for the
# budget divided by it.
MIN_COST = 1 * MIB
# The kernel's own per-process memory (task, kernel stack, files, signal handlers), not in smaps.
KERNEL_PER_PROCESS = 32 * 1024
# Processes sampled per jail and measurement.
SAMPLE = 16
# Share of the memory available to the worker spent on residents when the operator sets nothing.
DEFAULT_SHARE = 0.5
# CPU of one step, worker and jail together, with the sample environments' recorded oracle steps
# (bench/step_cost_bench.py --held 900: a jail holding 900 idle residents, as in a stack of 4,096
# rollouts in flight): in the session's resident process (1.7 ms), and cold, a one-shot fork of
# the zygote that unpickles the committed state (6.5 ms; 5.7 ms in a jail holding none). A resident
# saves the difference on each step of its session.
WARM_STEP_CPU_S = 0.0017
COLD_STEP_CPU_S = 0.0065
# The derived idle time is kept within these (a cost sampled on a handful of odd processes must
# not make residents last a blink or an hour).
MIN_IDLE_S = 2.0
MAX_IDLE_S = 600.0
# A resident goes once idle this many times the idle time (the module's docstring).
HOLD_FACTOR = 2


def memory_limit_bytes() -> int:
    """The memory this process may use: its cgroup's limit (v2 or v1) when set, else the machine's."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        with contextlib.suppress(OSError, ValueError):
            text = Path(path).read_text().strip()
            if text != "max" and int(text) < (1 << 60):
                return int(text)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 4096 * MIB


def cpu_limit() -> float:
    """The CPUs this process may use: its cgroup's quota (v2 `cpu.max`, v1 CFS) when set, else the
    CPUs it may run on."""
    with contextlib.suppress(OSError, ValueError):
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max" and int(period) > 0:
            return max(0.1, int(quota) / int(period))
    with contextlib.suppress(OSError, ValueError):
        quota_us = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period_us = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        if quota_us > 0 and period_us > 0:
            return max(0.1, quota_us / period_us)
    return float(len(os.sched_getaffinity(0)) or 1)


def memory_per_cpu() -> float:
    """Bytes of memory per CPU this worker may use: the exchange rate of CPU time into memory."""
    return memory_limit_bytes() / cpu_limit()


def default_budget_mb(workers_on_machine: int = 1) -> int:
    """Half the memory this worker may use, shared with the other workers of the same machine."""
    return max(64, int(memory_limit_bytes() * DEFAULT_SHARE / max(1, workers_on_machine) / MIB))


@dataclass
class Residency:
    """A worker's resident budget, the measured cost of one resident, each jail's cap, and the idle
    time after which a resident goes."""

    budget_bytes: int
    jails: int
    ceiling: int
    cost_bytes: int = DEFAULT_COST
    # The operator's idle time (`--resident-idle-s`); 0: derived (`idle_s`).
    fixed_idle_s: float = 0.0
    # The exchange rate: bytes of memory one CPU of this machine (or pod) comes with.
    memory_per_cpu: float = 0.0

    @classmethod
    def for_budget(cls, budget_mb: int, jails: int, ceiling: int = 0, idle_s: float = 0.0) -> Residency:
        """`ceiling`: the most residents a jail may hold whatever the budget (0: `JAIL_CEILING`);
        never more than the budget holds at `MIN_COST`, nor than the ids a jail can hand out.
        `idle_s`: the idle time after which a resident goes (0: derived from its cost)."""
        budget = max(0, budget_mb) * MIB
        # Each process of a jail needs an id of its own: leave room for the one-shot ones.
        structural = max(1, min(ID_SPAN - 256, budget // max(1, jails) // MIN_COST))
        return cls(
            budget,
            jails,
            min(ceiling if ceiling > 0 else JAIL_CEILING, structural),
            fixed_idle_s=max(0.0, idle_s),
            memory_per_cpu=memory_per_cpu(),
        )

    @property
    def jail_budget_bytes(self) -> int:
        return self.budget_bytes // max(1, self.jails)

    def cap(self) -> int:
        """Residents one jail may hold now: its share of the budget at the measured cost."""
        return max(0, min(self.ceiling, self.jail_budget_bytes // max(1, self.cost_bytes)))

    def idle_s(self) -> float:
        """How long a resident may sit idle before it goes: while the CPU it saves its session's
        next step (a cold step's minus a warm one's) is worth more than the memory it holds until
        then, at this machine's memory per CPU (the module's docstring)."""
        if self.fixed_idle_s:
            return self.fixed_idle_s
        saved = COLD_STEP_CPU_S - WARM_STEP_CPU_S
        worth = saved * self.memory_per_cpu / max(1, self.cost_bytes)
        return min(MAX_IDLE_S, max(MIN_IDLE_S, worth))

    def hold_s(self, lateness_s: float = 0.0) -> float:
        """How long a resident may sit idle, by the jail's clock, before it goes: `HOLD_FACTOR`
        idle times of its session, plus how late steps reach their jail lately."""
        return HOLD_FACTOR * self.idle_s() + max(0.0, lateness_s)

    def worth_a_process(self, idle_ms: int, held: bool) -> bool:
        """Whether a step whose session sat idle `idle_ms` before it (0: unknown) should go to, or
        make, the session's resident process. A session without one (`held` false) gets none when
        it steps further apart than the idle time: the process would not pay for itself. One that
        has one keeps using it while it steps within the hold time, which is as long as the
        process lasts: it is there already, and every step it serves saves a cold one (one long
        turn of a model does not cost the session its process)."""
        limit_s = HOLD_FACTOR * self.idle_s() if held else self.idle_s()
        return idle_ms <= 0 or idle_ms <= limit_s * 1000

    def measured(self, cost: int | None) -> None:
        if cost:
            self.cost_bytes = max(MIN_COST // 4, cost)


class Lateness:
    """How late the steps of sessions reach their jail beyond their think time, lately: a step's
    wait since its jail last answered the session, minus the idle time the runtime measured for it
    (the queues of the runtime and this worker, the trip between them). The most seen over the
    last one to two `window_s`, so one slow spell raises it at once and it falls back once past."""

    def __init__(self, window_s: float = 30.0) -> None:
        self.window_s = window_s
        self.started = time.monotonic()
        self.current = 0.0
        self.previous = 0.0

    def _rotate(self, now: float) -> None:
        if now - self.started >= 2 * self.window_s:
            self.current = self.previous = 0.0
            self.started = now
        elif now - self.started >= self.window_s:
            self.previous, self.current = self.current, 0.0
            self.started += self.window_s

    def saw(self, late_s: float) -> None:
        self._rotate(time.monotonic())
        self.current = max(self.current, late_s)

    def value(self) -> float:
        self._rotate(time.monotonic())
        return max(self.current, self.previous)


def process_cost(pid: int) -> int | None:
    """Private pages + page tables + the kernel's per-process memory of one process, in bytes."""
    memory = proctree.memory_kb(pid)
    status = proctree.status_kb(pid)
    if memory is None or status is None:
        return None
    private = memory.get("Private_Clean", 0) + memory.get("Private_Dirty", 0) + status.get("VmPTE", 0)
    return private * 1024 + KERNEL_PER_PROCESS


def sample_cost(jail_pids: list[int]) -> int | None:
    """Mean cost of the session processes (the zygotes' children) under the given nsjail pids, over
    at most `SAMPLE` of them per zygote.

    Reads /proc through `codegym.proctree` (the worker is outside the jails' pid namespaces and sees
    every process); runs in a thread, a few times a minute. The jails' process trees are read from
    their `children` files (`proctree.children_reader`), not by reading every process's stat on the
    machine (with a thousand residents per worker that scan was a tenth of a worker's CPU); the scan
    is the fallback where the kernel lacks those files.
    None when no jail holds a session process yet.
    """
    kids = proctree.children_reader()
    sessions: list[int] = []
    for jail in jail_pids:
        for zygote in kids(jail):
            found = kids(zygote)
            sessions += random.sample(found, min(SAMPLE, len(found)))
    costs = [c for c in (process_cost(pid) for pid in sessions) if c]
    return sum(costs) // len(costs) if costs else None

"""Initial states of task configurations built recently: a create of one whose construction does
not depend on the seed copies its state instead of building it again.

GRPO creates each configuration of its batch several times (eight in CodeGym's recipe), each with
a seed of its own. Building an episode is a sandbox call (a fork, the environment's code loaded and
constructed: about 9 ms of CPU); copying a state the runtime holds costs nothing, and is the same
episode when the construction ignores the seed. That is measured, never assumed, once per
configuration (the environment's code by sha256 and the config JSON the jail is given): its first
two builds with different seeds are compared, state bytes and first observation.
- Equal: the configuration is seed-independent; later creates copy that state and observation. The
  session then has no process on any worker, and its first step runs cold from the state, exactly
  as after a worker's death. Its own seed still drives its steps (`seed + step_index + 1`), so a
  create that names its seed may copy too: the measurement is what makes the copy the episode it
  would have built.
- Different: the configuration is seed-dependent, and every create of it builds.
While a configuration's two trial builds are in flight, its other creates wait for their verdict
instead of building too: a trainer sends a batch's eight creates of a configuration at once, and
without the wait all eight would build before either trial answered. A create whose seed equals a
trial's builds without waiting (its build would tell nothing new).

Two byte-bounded caches (`--initial-states-mb`), least recently used out first, exported like every
cache (`codegym_cache_*`): `runtime_initial_states`, the copyable states (a hit is a create copied,
a miss one built), and `runtime_initial_trials`, first builds waiting for a second and the
configurations found seed-dependent. A configuration that falls out of both is measured again.

What is compared is what the jail reports, and the jail runs untrusted code: a configuration can
make its own episodes start alike (or not), nothing more. The copy never crosses configurations,
environments' code, or tenants' sessions beyond sharing the bytes of one initial state.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from codegym.bounded_cache import BoundedCache

# (sha256 of the environment's code, the config JSON its jail is given)
Key = tuple[str, str]
# What one held entry costs beyond its bytes: the tuple, the key's strings, the cache's own links.
ENTRY_OVERHEAD = 256
# Share of `--initial-states-mb` held for the trials (first builds, seed-dependent verdicts).
TRIALS_SHARE = 4


class Initial(NamedTuple):
    """A configuration's initial state and first observation, as a create answers them."""

    state: bytes
    observation: str


class Trial(NamedTuple):
    """A configuration's first build, waiting for a second with another seed; or, `seeded`, the
    verdict that its construction depends on the seed (no state held)."""

    initial: Initial
    seed: int
    seeded: bool = False


@dataclass
class Flight:
    """The trial builds of one configuration in flight, and the event its waiters wait on (set,
    and replaced, whenever one of them ends)."""

    seeds: list[int] = field(default_factory=list)
    ended: asyncio.Event = field(default_factory=asyncio.Event)


def cost(key: Key, held: Initial) -> int:
    return sum(sys.getsizeof(part) for part in (*key, *held)) + ENTRY_OVERHEAD


class InitialStates:
    """`make`: a create's initial state, copied or built (see the module's docstring)."""

    def __init__(self, max_bytes: int) -> None:
        self.states: BoundedCache[Key, Initial] = BoundedCache("runtime_initial_states", max_bytes)
        self.trials: BoundedCache[Key, Trial] = BoundedCache(
            "runtime_initial_trials", max_bytes // TRIALS_SHARE
        )
        # Configurations with trial builds running: as many as creates in flight, at most.
        self.flights: dict[Key, Flight] = {}

    @property
    def enabled(self) -> bool:
        return self.states.max_bytes > 0 and self.trials.max_bytes > 0

    async def make(
        self, key: Key, seed: int, build: Callable[[], Awaitable[Initial]]
    ) -> tuple[Initial, bool]:
        """The initial state of a create of configuration `key` seeded `seed`, and whether it was
        copied. `build` runs the create in a sandbox (raising when it fails); it is called at most
        once, and not at all for a copy."""
        if not self.enabled:
            return await build(), False
        copied = self.states.get(key)  # counted once per create: a hit copies, a miss builds
        while copied is None:
            trial = self.trials.get(key) if key in self.trials else None
            if trial is not None and trial.seeded:
                return await build(), False
            flight = self.flights.get(key)
            seeds = {*(flight.seeds if flight else ()), *((trial.seed,) if trial else ())}
            if seed in seeds:
                return await build(), False  # a trial's own seed: nothing to learn from this build
            if flight is not None and len(seeds) >= 2:
                await flight.ended.wait()  # two trials out: their verdict decides
            else:
                return await self._trial(key, seed, build), False
            copied = self.states.get(key) if key in self.states else None
        return copied, True

    async def _trial(self, key: Key, seed: int, build: Callable[[], Awaitable[Initial]]) -> Initial:
        """A build that is also a measurement: compared with the configuration's other trial."""
        flight = self.flights.setdefault(key, Flight())
        flight.seeds.append(seed)
        try:
            made = await build()
            self._judge(key, seed, made)
            return made
        finally:
            flight.seeds.remove(seed)
            flight.ended.set()
            if flight.seeds:
                flight.ended = asyncio.Event()
            elif self.flights.get(key) is flight:
                del self.flights[key]

    def _judge(self, key: Key, seed: int, made: Initial) -> None:
        trial = self.trials.get(key) if key in self.trials else None
        if trial is None:
            self.trials.put(key, Trial(made, seed), cost(key, made))
        elif trial.seeded or trial.seed == seed:
            return
        elif trial.initial == made:
            self.trials.discard(key)
            self.states.put(key, made, cost(key, made))
        else:
            verdict = Trial(Initial(b"", ""), seed, seeded=True)
            self.trials.put(key, verdict, cost(key, verdict.initial))

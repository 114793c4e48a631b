"""What a jail is told once, when it starts: the settings every request in it obeys.

The worker builds these from its flags (`codegym serve sandbox --help`) and passes them as the
zygote's one argument (JSON), so a resident cap or idle time above the defaults holds for every
operation, not only for those that happen to carry it.

Two numbers bound a jail's resident sessions, and they differ on purpose:
- its ceiling, `JailSettings.resident_cap`, fixed when the jail starts: nsjail sizes the jail's
  pid, fd and memory limits from it then, and cannot change them later;
- each request's `cap` (`messages.Request.cap`): what the worker's memory budget allows now at the
  measured cost of one resident. That cost is only known once residents exist, and moves with
  the environments served, so the cap is told with every request; the zygote never takes it above
  the ceiling.
The worker sets the ceiling to `JAIL_CEILING` (or its `--resident-cap`), bounded by what its
budget holds at the least a resident costs (`sandbox_worker/residency.py`). `UNBUDGETED_CAP` is the
ceiling of a jail started without a worker's settings, which sets no memory aside for residents.
"""

import json
from dataclasses import asdict, dataclass, fields
from typing import Any

# Most resident sessions one jail holds whatever the worker's budget. A jail's fork gets slower as
# it holds more processes (measured: the zygote's fork 1.0 ms with 250 residents, 2.7 ms with
# 1,000, 8.6 ms with 2,000), and every cold step and create forks: past this, more jails per worker
# serve better.
JAIL_CEILING = 1024
# The ceiling of a jail given no settings (a zygote started by hand, a `Jail` built without a
# pool's settings): no memory is set aside for its residents (`resident_memory_mb` 0), so few.
UNBUDGETED_CAP = 64


@dataclass(frozen=True)
class JailSettings:
    # Most resident sessions this jail may hold, its ceiling (its pid, fd and uid limits are sized
    # from it); each request's `cap` says how many its memory budget allows now, below this.
    resident_cap: int = UNBUDGETED_CAP
    # How long a resident may sit idle before it goes, until a request says (each carries the
    # worker's `resident_idle_ms`, derived from a resident's measured cost: residency.py).
    resident_idle_s: float = 300.0
    # A resident session idle this long may give its place to a new one when the jail is full.
    # Longer than a model's turn: trainers step each episode every few seconds, and a shorter
    # threshold would let newcomers evict sessions that are still playing (every step cold).
    admit_idle_s: float = 60.0
    # This jail's share of the worker's resident budget (its memory limit is sized with it).
    resident_memory_mb: int = 0
    # Bytes of compiled sources (marshalled size) the zygote keeps, least recently used out first;
    # the worker mirrors which (the zygote tells it what it dropped).
    code_cache_bytes: int = 32 * 1024 * 1024
    # Largest result a child may report.
    max_result_bytes: int = 32 * 1024 * 1024
    # Make the zygote's preloaded objects immortal before it forks (`immortal`): fewer pages
    # copied after each fork. Off only to measure what it saves (`serve sandbox --mortal-preloads`).
    immortalize: bool = True

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "JailSettings":
        given: dict[str, Any] = json.loads(text) if text else {}
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in given.items() if k in known})

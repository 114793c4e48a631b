"""What a jail is told once, when it starts: the settings every request in it obeys.

The worker builds these from its flags (`codegym serve sandbox --help`) and passes them as the
zygote's one argument (JSON), so a resident cap or idle time above the defaults holds for every
operation, not only for those that happen to carry it.
"""

import json
from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass(frozen=True)
class JailSettings:
    # Most resident sessions a jail may hold (its pid, fd and uid limits are sized from it); the
    # worker tells each request the cap its memory budget allows at the measured cost, below this.
    resident_cap: int = 64
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

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "JailSettings":
        given: dict[str, Any] = json.loads(text) if text else {}
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in given.items() if k in known})

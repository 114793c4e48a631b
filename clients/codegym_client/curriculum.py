"""The curriculum's shared rules: the pools a task falls in, the labels a library keeps, the band
that places a pass rate, and what a trainer draws when the runtime's choice gives it nothing.

Here, in the client package, because both sides need them and this package is the bottom layer
(it imports nothing of the repo): the runtime's sampler (services/runtime/curriculum.py) and
`codegym library label` place a rate by the same `Band`, and TRL's `Curriculum` and verl's
sampler fall back by the same `uniform_fallback`.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal, TypeVar, get_args

# A task's pool for a run, as `SampleTasks` and `Stats` name it.
Pool = Literal["learnable", "unseen", "mastered", "unsolved", "quarantined"]
POOLS: Final[tuple[Pool, ...]] = get_args(Pool)
# A task's learnability as `codegym library label` writes it into a library (apart from the
# published easy/medium/hard difficulty).
Label = Literal["unsolved", "learnable", "mastered"]
LABELS: Final[tuple[Label, ...]] = get_args(Label)

# Episodes of a task before its pass rate decides its pool or label (SampleTasksRequest's default).
DEFAULT_MIN_EPISODES = 4

T = TypeVar("T")


@dataclass(frozen=True)
class Band:
    """The learnable band (a pass rate strictly between `low` and `high`) and the evidence it
    needs (`min_episodes`): at or below `low` is unsolved, at or above `high` mastered."""

    low: float = 0.0
    high: float = 1.0
    min_episodes: int = DEFAULT_MIN_EPISODES

    @classmethod
    def of(cls, low: float, high: float, min_episodes: int = 0) -> Band:
        """A band from a request's fields (0 and 0: the default band; 0 episodes: the default).
        Raises ValueError for a band that is empty or outside [0, 1]."""
        if low == 0 and high == 0:
            high = 1.0
        if not (0.0 <= low < high <= 1.0):
            raise ValueError(f"the band needs 0 <= low < high <= 1, got low={low} high={high}")
        if min_episodes < 0:
            raise ValueError(f"min_episodes must be >= 0, got {min_episodes}")
        return cls(low, high, min_episodes or DEFAULT_MIN_EPISODES)

    def place(self, rate: float) -> Label:
        """Where a pass rate falls."""
        if rate <= self.low:
            return "unsolved"
        if rate >= self.high:
            return "mastered"
        return "learnable"

    def label(self, rate: float, episodes: int) -> Label | None:
        """A task's label from its pass rate over `episodes` episodes; None before `min_episodes`
        (at least one)."""
        if episodes < max(1, self.min_episodes):
            return None
        return self.place(rate)


def uniform_fallback(
    population: Sequence[T], size: int, seed: int, run_id: str, log: logging.Logger
) -> list[T]:
    """`size` items of `population` drawn uniformly (seeded: the same seed, the same draw), with a
    warning: what a trainer's curriculum serves when the runtime sampled nothing it has (its
    environments or dataset rows). Raises ValueError for an empty population."""
    if not population:
        raise ValueError("the curriculum has nothing to fall back on: no rows of its own")
    log.warning(
        "CodeGym curriculum: the runtime sampled nothing this trainer has for run %r: %d of its own rows, uniformly",
        run_id,
        size,
    )
    return random.Random(seed).choices(population, k=size)

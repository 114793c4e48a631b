"""The library as the sampler draws from it: per env prefix, its tasks' row ids and how many tasks
have each published prior, summarized once per version of the library file.

A library is 80,000 tasks and a run has played a few thousand of them, so the sampler never builds
the library's pools: it places the tasks the record knows exactly, counts the rest by prior from
this summary, and draws the rest at random by row id (`draw`), skipping what the record knows.
The summary is one pass over the tasks' scores (about a quarter of a second for 80,000), made when
a prefix is first asked for or the library file changed, and kept for `MAX_PREFIXES` prefixes.
"""

from __future__ import annotations

import json
import math
import os
import random
import threading
from array import array
from collections import Counter, OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from codegym.library.store import Library

# The published pass rate that seeds the record, most preferred first.
PRIOR_SCORES = ("qwen32b_Bo4_score", "qwen32b_Bo8_score")
# Prefixes whose summaries are kept (the least recently used goes first).
MAX_PREFIXES = 16


def prior_of(scores: Mapping[str, float]) -> float | None:
    """The published pass rate a task starts from, if it has one."""
    for name in PRIOR_SCORES:
        if scores.get(name) is not None:
            return float(scores[name])
    return None


@dataclass(frozen=True)
class Summary:
    """The tasks under a prefix: their row ids and each one's prior (NaN: none), how many have
    each prior (None: no prior), and how many environments they are of."""

    ids: array[int]
    prior: array[float]
    priors: Counter[float | None]
    envs: int

    def draw(self, rng: random.Random, k: int) -> dict[int, float | None]:
        """`k` row ids drawn without replacement (all of them when `k` is at least their number),
        each with its prior."""
        picked = range(len(self.ids)) if k >= len(self.ids) else rng.sample(range(len(self.ids)), k)
        return {self.ids[i]: None if math.isnan(self.prior[i]) else self.prior[i] for i in picked}


def summarize(library: Library, prefix: str) -> Summary:
    ids: array[int] = array("q")
    prior: array[float] = array("d")
    priors: Counter[float | None] = Counter()
    envs: set[str] = set()
    for row_id, env_id, scores in library.task_scores(prefix):
        ids.append(row_id)
        envs.add(env_id)
        value = prior_of(json.loads(scores))
        prior.append(math.nan if value is None else value)
        priors[value] += 1
    return Summary(ids, prior, priors, len(envs))


def file_version(path: Path) -> tuple[int, ...]:
    """What changes when the library file does (its and its WAL's size and modification time)."""
    version: list[int] = []
    for name in (path, Path(f"{path}-wal")):
        try:
            stat = os.stat(name)
        except FileNotFoundError:
            version += [0, 0]
            continue
        version += [stat.st_mtime_ns, stat.st_size]
    return tuple(version)


class Summaries:
    """Summaries of one library file by prefix, rebuilt when the file changes. Thread-safe: the
    sampler and Stats run in threads."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.kept: OrderedDict[str, tuple[tuple[int, ...], Summary]] = OrderedDict()
        self.lock = threading.Lock()
        self.building = threading.Lock()  # one summary made at a time: a second asker waits for it

    def warm(self, prefix: str = "") -> None:
        """Summarize `prefix` now (the runtime does it for the whole library when it starts, so
        the first SampleTasks does not wait for it)."""
        with Library(self.path, read_only=True) as library:
            self.of(library, prefix)

    def of(self, library: Library, prefix: str) -> Summary:
        version = file_version(self.path)
        if (held := self._held(prefix, version)) is not None:
            return held
        with self.building:
            if (held := self._held(prefix, version)) is not None:
                return held  # made meanwhile (the runtime's warm-up)
            summary = summarize(library, prefix)
            with self.lock:
                self.kept[prefix] = (version, summary)
                self.kept.move_to_end(prefix)
                while len(self.kept) > MAX_PREFIXES:
                    self.kept.popitem(last=False)
        return summary

    def _held(self, prefix: str, version: tuple[int, ...]) -> Summary | None:
        with self.lock:
            held = self.kept.get(prefix)
            if held is None or held[0] != version:
                return None
            self.kept.move_to_end(prefix)
            return held[1]

"""A session's per-step history: what a rewind (`ForkSession` with `at_step`) forks from.

Kept only for sessions created with `keep_history` (cost follows use). Each entry is a
`HistoryEntry` (protobuf, made here from what the runtime already holds): the state after the
step, the canonical action that led there and the sha256 of the observation it answered. The
states make a rewind a copy, like a fork (no replay through a jail, so no step's CPU); the actions
and digests are the episode's log, which a replay, or a reader of captured episodes, follows.

It is also the one log of captured episodes (captures.py): a session whose episode is captured
appends entries whether or not it keeps a history, carrying the observation text (and a step that
did not apply, as an entry with its error and no state); without `keep_history` they carry no
state, so they cost the text alone and a fork never reads them.

Entries are appended in the same atomic commit as their step (`HistoryWrite`, carried by
`SessionStore.commit`; in Redis inside the commit script, so a step whose lease was lost appends
nothing), cleared by a reset, and bounded twice: per session (`keep`) and across the runtime
(`total`). At either bound the oldest entries go; a step never fails for it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from codegym.checkpoint.v1 import checkpoint_pb2 as cp


@dataclass(frozen=True, slots=True)
class HistoryWrite:
    """What a commit appends to its session's history: one entry, after clearing it when `restart`
    (a create or reset starts the episode over), kept to `keep` entries for the session and `total`
    across the store."""

    entry: bytes
    keep: int
    total: int
    restart: bool = False


def entry(
    step_index: int,
    state: bytes,
    *,
    action: str = "",
    observation: str = "",
    reward: float = 0.0,
    done: bool = False,
    truncated: bool = False,
    captured: bool = False,
    error: str = "",
) -> bytes:
    """One serialized entry: the state after `step_index` committed steps (`state` empty for a
    session that logs only for its capture), with the observation text when `captured`."""
    return cp.HistoryEntry(
        step_index=step_index,
        action=action,
        observation_sha256=hashlib.sha256(observation.encode("utf-8", "surrogatepass")).hexdigest()
        if action
        else "",
        state=state,
        reward=reward,
        done=done,
        truncated=truncated,
        observation=observation if captured else "",
        error=error,
    ).SerializeToString()


def parse(entries: Sequence[bytes]) -> list[cp.HistoryEntry]:
    """The entries as messages, oldest first (the store wrote them: they parse)."""
    parsed = []
    for raw in entries:
        item = cp.HistoryEntry()
        item.ParseFromString(raw)
        parsed.append(item)
    return parsed


def up_to(entries: Sequence[bytes], items: Sequence[cp.HistoryEntry], step_index: int) -> list[bytes]:
    """The entries (`items`: them parsed) a fork at `step_index` inherits: those of steps up to it,
    of the current episode (after a reset the log starts again at 0, so an entry numbered past a
    lower one is older)."""
    kept: list[bytes] = []
    last = -1
    for raw, item in zip(entries, items, strict=True):
        if item.error:
            continue  # a step that did not apply (a captured episode's): no state to fork from
        if item.step_index <= last:
            kept = []  # a restart of the log (not expected inside one read; never mixed)
        last = item.step_index
        if item.step_index <= step_index:
            kept.append(raw)
    return kept


def find(items: Sequence[cp.HistoryEntry], step_index: int) -> cp.HistoryEntry | None:
    """The entry of `step_index`, when the history still holds it."""
    for item in reversed(items):
        if item.step_index == step_index and not item.error:
            return item
    return None


def held(items: Sequence[cp.HistoryEntry]) -> str:
    """The steps a history holds, for a refusal's message."""
    steps = [item for item in items if not item.error]
    if not steps:
        return "no steps"
    return f"steps {steps[0].step_index}..{steps[-1].step_index}"

"""What the Play page shows of a session: its steps as they were played here.

The runtime answers a step with its observation and forgets it (a session keeps a bounded history
for forks, not a transcript), so the console keeps each console session's transcript itself: who
owns it (the tenant that created it; the runtime checks the same on every call), the first
observation and every step's action and answer. Bounded: `MAX_PLAYS` sessions (the oldest
forgotten first; the runtime session lapses on its own idle timer) of at most their `max_steps`
entries each, one text at most `MAX_TEXT` characters. A console restart loses the transcripts, not
the sessions.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

MAX_PLAYS = 1_000
MAX_TEXT = 64 * 1024
# The run id of every console session: its outcome stays out of the all-runs record sampling reads.
CONSOLE_RUN = "console"


def clip(text: str) -> str:
    return (
        text if len(text) <= MAX_TEXT else text[:MAX_TEXT] + f"\n… ({len(text) - MAX_TEXT} more characters)"
    )


@dataclass
class Turn:
    """One step as played: the action sent and the runtime's answer."""

    index: int
    action: str
    observation: str
    reward: float
    done: bool
    truncated: bool
    error: str = ""


@dataclass
class Play:
    """A console session's transcript."""

    session_id: str
    owner: str
    env_id: str
    task_text: str
    config_json: str
    first_observation: str
    tools: list[dict[str, str]]
    max_steps: int
    turns: list[Turn] = field(default_factory=list)
    forked_from: str = ""

    @property
    def over(self) -> bool:
        return bool(self.turns) and (self.turns[-1].done or self.turns[-1].truncated)

    @property
    def reward(self) -> float:
        return self.turns[-1].reward if self.turns else 0.0

    @property
    def committed(self) -> int:
        """Steps the runtime applied (failed steps change nothing)."""
        return sum(1 for turn in self.turns if not turn.error)


class Plays:
    """Transcripts by session id, bounded."""

    def __init__(self, max_plays: int = MAX_PLAYS) -> None:
        self.max_plays = max_plays
        self._held: OrderedDict[str, Play] = OrderedDict()

    def add(self, play: Play) -> None:
        self._held[play.session_id] = play
        while len(self._held) > self.max_plays:
            self._held.popitem(last=False)

    def find(self, session_id: str, owner: str, operator: bool) -> Play | None:
        """The transcript, if `owner` may see it (its own, or anyone's for an operator)."""
        play = self._held.get(session_id)
        if play is None or not (operator or play.owner == owner):
            return None
        return play

    def forget(self, session_id: str) -> None:
        self._held.pop(session_id, None)

    def rewound(self, play: Play, session_id: str, at_step: int) -> Play:
        """The transcript of a fork of `play` at committed step `at_step`: its turns up to there."""
        kept: list[Turn] = []
        applied = 0
        for turn in play.turns:
            if applied >= at_step:
                break
            kept.append(turn)
            applied += 0 if turn.error else 1
        fork = Play(
            session_id,
            play.owner,
            play.env_id,
            play.task_text,
            play.config_json,
            play.first_observation,
            play.tools,
            play.max_steps,
            kept,
            forked_from=play.session_id,
        )
        self.add(fork)
        return fork

"""Captured episodes: whole episodes kept to be read later (`ListEpisodes`, `GetEpisode`, the
console's timeline, `codegym library episodes`).

What is logged is decided at create (`CapturePolicy.steps_for`), per session:
- a sampled fraction of episodes (`--capture RATE`, drawn per create, so per environment too), and
  every console session (run id `console`: a person playing wants to read it back), log every step;
- every other episode logs its first ceil(solve_fc_round / 4) steps. The shortcut sentinel flags an
  episode rewarded in under a quarter of its oracle's steps, so a flagged episode is always held
  whole by then; an unflagged one is not kept.
The log is the session's history (history.py), whose entries then carry the observation text: one
log, appended in the step's commit. When the episode ends (done or truncated, or closed before its
end when it was sampled) the runtime makes a `Capture` from it and puts it in the capture store,
which lives where the episode record does (SQLite: capture_store.py, Redis: redis_captures.py),
bounded in bytes (`--capture-bytes`): at the bound the oldest captures go.

A capture is tagged with its tenant: a trainer lists and reads its own tenant's, an operator all.
Everything in one (observations, actions) is the environment's and the agent's text: untrusted.
"""

from __future__ import annotations

import base64
import binascii
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from codegym.checkpoint.v1 import checkpoint_pb2 as cp
from codegym.errors import Reason, Refusal
from codegym_client.api.runtime.v1 import runtime_service_pb2 as rt
from services.runtime.episode_record import CONSOLE_RUN
from services.runtime.sessions import Session

# Page sizes of ListEpisodes.
DEFAULT_PAGE = 50
MAX_PAGE = 500


@dataclass(frozen=True)
class CapturePolicy:
    """What a create decides: `enabled` False (`--no-capture`) logs nothing at all."""

    rate: float = 0.1
    enabled: bool = True

    def steps_for(self, max_steps: int, oracle_steps: int, run_id: str) -> int:
        """Steps of a new episode its log keeps for a capture (Session.capture_steps)."""
        if not self.enabled:
            return 0
        if run_id == CONSOLE_RUN or (self.rate > 0 and random.random() < self.rate):
            return max_steps
        return math.ceil(oracle_steps / 4) if oracle_steps > 0 else 0


def flagged(reward: float, steps: int, oracle_steps: int) -> bool:
    """The shortcut sentinel's rule (episode_record.Recorder.episode): rewarded in under a quarter
    of its oracle's steps."""
    return reward > 0 and oracle_steps > 0 and steps * 4 < oracle_steps


def logs(session: Session) -> bool:
    """Whether the session's next committed step goes into its log for a capture."""
    return session.step_index < session.capture_steps


def sampled(session: Session) -> bool:
    return session.capture_steps >= session.max_steps


@dataclass(frozen=True)
class Capture:
    """One captured episode: its summary (what lists filter on) and the whole answer of GetEpisode."""

    summary: rt.EpisodeSummary
    body: bytes  # a serialized GetEpisodeResponse

    @property
    def size(self) -> int:
        """What it costs the store's byte bound."""
        return len(self.body) + self.summary.ByteSize() + len(self.summary.episode_id) + 64


def end_reason(session: Session, entries: Sequence[cp.HistoryEntry], closed: bool) -> str:
    if closed and not session.done:
        return "error" if entries and entries[-1].error else "closed"
    if session.truncated:
        return "truncated"
    return "solved" if session.reward > 0 else "failed"


def make(
    session: Session,
    entries: Sequence[cp.HistoryEntry],
    task_key: str,
    oracle_steps: int,
    closed: bool = False,
) -> Capture:
    """The capture of a session's episode from its log (`entries`, parsed, oldest first)."""
    steps = [
        rt.EpisodeStep(
            index=item.step_index if item.error else item.step_index - 1,
            action=item.action,
            observation=item.observation,
            reward=item.reward,
            done=item.done,
            truncated=item.truncated,
            error=item.error,
        )
        for item in entries
        if item.action
    ]
    committed = {item.step_index for item in entries if not item.error}
    summary = rt.EpisodeSummary(
        episode_id=session.session_id,
        env_id=session.env_id,
        task_key=task_key,
        run_id=session.run_id,
        tenant=session.tenant,
        steps=session.step_index,
        reward=session.reward,
        done=session.done,
        truncated=session.truncated,
        end_reason=end_reason(session, entries, closed),
        flagged=not session.branch and flagged(session.reward, session.step_index, oracle_steps),
        whole=committed >= set(range(session.step_index + 1)),
        started_unix_ms=session.started_ms,
    )
    if session.policy_version is not None:
        summary.policy_version = session.policy_version
    start = next((item for item in entries if item.step_index == 0 and not item.action), None)
    body = rt.GetEpisodeResponse(
        summary=summary,
        config_json=session.config_json,
        first_observation=start.observation if start is not None else "",
        steps=steps,
    )
    return Capture(summary, body.SerializeToString())


def kept(session: Session, capture: Capture) -> bool:
    """Whether an ended episode's capture goes to the store: a sampled one always, another only
    when the sentinel flagged it (its log then holds it whole)."""
    return sampled(session) or capture.summary.flagged


def now_ms() -> int:
    return int(time.time() * 1000)


# ---- reading -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Filters:
    """A ListEpisodes request's filters; `tenant` None lists every tenant's (an operator)."""

    tenant: str | None = None
    run_id: str = ""
    env_id: str = ""
    rewarded: bool | None = None
    flagged_only: bool = False
    errors_only: bool = False

    def match(self, summary: rt.EpisodeSummary) -> bool:
        return (
            (self.tenant is None or summary.tenant == self.tenant)
            and (not self.run_id or summary.run_id == self.run_id)
            and (not self.env_id or summary.env_id == self.env_id)
            and (self.rewarded is None or (summary.reward > 0) == self.rewarded)
            and (not self.flagged_only or summary.flagged)
            and (not self.errors_only or summary.end_reason == "error")
        )


class CaptureStore(Protocol):
    """Where captures are kept (capture_store.py, redis_captures.py), bounded in bytes."""

    async def put(self, capture: Capture) -> None:
        """Keep a capture (a second one of the same episode is ignored); past the byte bound the
        oldest go."""
        ...

    async def page(
        self, filters: Filters, size: int, before: int | None
    ) -> tuple[list[rt.EpisodeSummary], int | None]:
        """Summaries matching `filters`, newest first, kept before position `before` (None: from
        the newest); and the position the next page continues before (None at the end)."""
        ...

    async def get(self, episode_id: str) -> rt.GetEpisodeResponse | None: ...

    async def held_bytes(self) -> int:
        """Bytes the captures held count against the bound."""
        ...

    async def close(self) -> None: ...


def page_token(before: int) -> str:
    return base64.urlsafe_b64encode(f"c1:{before}".encode()).decode()


def read_token(token: str) -> int | None:
    if not token:
        return None
    try:
        text = base64.urlsafe_b64decode(token.encode("ascii")).decode("ascii")
        if not text.startswith("c1:"):
            raise ValueError
        before = int(text[3:])
        if before < 0:
            raise ValueError
        return before
    except (ValueError, UnicodeError, binascii.Error):
        raise Refusal(
            Reason.INVALID_REQUEST, f"page_token {token[:40]!r} is not one ListEpisodes gave"
        ) from None


def page_size(size: int) -> int:
    if size > MAX_PAGE:
        raise Refusal(Reason.INVALID_REQUEST, f"page_size {size} exceeds {MAX_PAGE}")
    return size or DEFAULT_PAGE

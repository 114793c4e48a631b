"""One judge of an episode against its recording, for every bench that replays recorded oracle
trajectories: the rollout bench (bench/load.py) and the soak's paths (bench/soak.py, and the
trainers' own processes, bench/soak_trl.py and bench/soak_verl.py).

Why one: what counts as an episode "shaped" by a fault (an observation that is not the recorded
one, which a trainer cannot tell from a true one and would learn from) is the soak's verdict, and
four copies of it had drifted (an observation past the recording was shaped on one path and
ignored on another). The standard library only: the trainers' venv imports it too.

An episode is, in this order:

  shaped    an observation it was shown differs from the recording (a failure does not excuse
            it), or, played to its end, its reward differs from the recorded one
  failed    the infrastructure failed it and it was marked so the trainer does not learn from it
  lost      it stopped before its recording ended, or went past it, without being marked
  finished  every step played, every observation the recorded one, the environment done
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench.common import Line


@dataclass(frozen=True)
class Verdict:
    outcome: str  # shaped, failed, lost or finished
    reason: str = ""
    example: str = ""


class Judge:
    """One episode against its recording (`line`, or only its first `steps`), observation by
    observation as it is played (`saw`), then as a whole (`verdict`)."""

    def __init__(self, line: Line, steps: Sequence[Sequence[Any]] | None = None) -> None:
        self.line = line
        self.expected = [str(observation) for _, observation in (line["steps"] if steps is None else steps)]
        self.shown: list[str] = []
        self.differs_at: int | None = None

    def saw(self, observation: str) -> bool:
        """An observation the trainer was shown, in order; False once one differed from the
        recording (the episode is shaped: a player stops there). One past the end of the
        recording is not compared: `verdict` calls the episode lost."""
        index = len(self.shown)
        self.shown.append(observation)
        if self.differs_at is None and index < len(self.expected) and observation != self.expected[index]:
            self.differs_at = index
        return self.differs_at is None

    @property
    def shaped(self) -> bool:
        return self.differs_at is not None

    def difference(self) -> str:
        """Where the first differing observation is, and what came instead of the recorded one."""
        if self.differs_at is None:
            return ""
        i = self.differs_at
        return f"step {i}: shown {self.shown[i][:120]!r}, recorded {self.expected[i][:120]!r}"

    def verdict(
        self,
        *,
        failure: str | None = None,
        done: bool = True,
        steps: int | None = None,
        reward: float | None = None,
        last_shown: bool = True,
        stop: str = "",
    ) -> Verdict:
        """The episode's outcome (see the module docstring). `failure`: the reason the
        infrastructure failed it, when it was marked; `done`: the environment ended it; `steps`:
        the steps it applied (the observations shown, by default); `reward`: compared with the
        recording's when given (NaN: the trainer did not score it); `last_shown` False: the final
        step's observation is never shown to the model (verl), its reward says whether it was
        applied; `stop`: why the player stopped, the reason of a lost episode."""
        if self.differs_at is not None:
            where = " (in a failed row, masked)" if failure is not None else ""
            return Verdict(
                "shaped",
                f"observation {self.differs_at} differs from the recording{where}",
                self.difference(),
            )
        if failure is not None:
            return Verdict("failed", failure, f"{len(self.shown)} observations shown")
        shown, recorded = len(self.shown), len(self.expected)
        played = steps if steps is not None else shown + (0 if last_shown else 1)
        if not done or played != recorded or shown != recorded - (0 if last_shown else 1):
            reason = stop or f"stopped after {played} of {recorded} steps (done={done})"
            return Verdict("lost", reason, f"{played} of {recorded} steps, {shown} observations shown")
        if reward is not None and not math.isclose(reward, float(self.line["reward"])):
            return Verdict(
                "shaped",
                "the reward differs from the recording",
                f"reward {reward}, recorded {self.line['reward']}",
            )
        return Verdict("finished", "done", f"reward {reward}" if reward is not None else "")

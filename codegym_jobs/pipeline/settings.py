"""What a pipeline run can be told (`PipelineSettings`): its stages' thresholds, each declared once
as an option of `codegym pipeline run` (`codegym.server.settings`). Standard library only, for
`codegym --help`; `PipelineConfig.of` builds what a run takes from it, with the verification
service's request messages."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from codegym.server.settings import nested, option

if TYPE_CHECKING:
    from codegym.verification.v1 import verification_service_pb2 as vf


@dataclass(frozen=True)
class UnitTestLimits:
    """How generated unit tests are validated (verification's `UnitTestThresholds`)."""

    ref_time_ms: int = option(3000, "--ref-time-ms", "time limit of one get_ref_answer()")
    ref_memory_mb: int = option(100, "--ref-memory-mb", "memory limit of one get_ref_answer()")
    max_answer_chars: int = option(100, "--max-answer-chars", "longest accepted answer repr()")
    min_valid: int = option(10, "--min-valid", "valid tests an environment needs")
    min_valid_ratio: float = option(0.8, "--min-valid-ratio", "fraction of distinct tests that must be valid")

    def message(self) -> vf.UnitTestThresholds:
        from codegym.verification.v1 import verification_service_pb2 as vf

        return vf.UnitTestThresholds(
            ref_time_ms=self.ref_time_ms,
            ref_memory_mb=self.ref_memory_mb,
            max_answer_chars=self.max_answer_chars,
            min_valid=self.min_valid,
            min_valid_ratio=self.min_valid_ratio,
        )


@dataclass(frozen=True)
class SolvabilityBudget:
    """How the solve() candidates are run (verification's `SolvabilityLimits`)."""

    case_time_ms: int = option(10_000, "--case-time-ms", "time limit of one solve() run")
    case_memory_mb: int = option(256, "--case-memory-mb", "memory limit of one solve() run")
    max_steps: int = option(1024, "--max-steps", "step() calls one solve() run may make")
    budget_s: float = option(300.0, "--budget-s", "solvability budget per environment")

    def message(self) -> vf.SolvabilityLimits:
        from codegym.verification.v1 import verification_service_pb2 as vf

        return vf.SolvabilityLimits(
            case_time_ms=self.case_time_ms,
            case_memory_mb=self.case_memory_mb,
            max_steps=self.max_steps,
            budget_ms=int(self.budget_s * 1000),
        )


@dataclass(frozen=True)
class PipelineSettings:
    """The stages' options of `codegym pipeline run` (the defaults are DESIGN §7's)."""

    hard_tests: bool = option(False, "--hard-tests", "also generate hard unit tests")
    reject_unsafe: bool = option(False, "--reject-unsafe", "reject (not only flag) risky constructs")
    parallel: int = option(8, "--parallel", "problems in flight")
    unit_tests: UnitTestLimits = nested(UnitTestLimits)
    solvability: SolvabilityBudget = nested(SolvabilityBudget)
    min_solve_fc_round: int = option(10, "--min-solve-fc-round", "fewest oracle steps of a kept config")
    max_solve_fc_round: int = option(256, "--max-solve-fc-round", "most oracle steps of a kept config")
    min_tools: int = option(4, "--min-tools", "fewest distinct tools of a kept environment")
    keep_shortcuts: bool = option(
        False, "--keep-shortcuts", "flag shortcut environments instead of dropping them"
    )
    shortcut_fraction: float = option(
        0.5, "--shortcut-fraction", "a tool answering on more than this fraction of tests is a shortcut"
    )
    # Wrong answers derived from each reference answer must all get reward 0.
    no_negative_controls: bool = option(
        False,
        "--no-negative-controls",
        "skip the check that Done pays no wrong answer derived from the reference answer",
    )
    # The oracle replayed twice on this many tests must give the same trajectory (0 = off).
    determinism_tests: int = option(
        5,
        "--determinism-tests",
        "tests the oracle replays twice in separate processes (0 = skip the determinism check)",
    )
    max_guess_rate: float = option(
        0.0,
        "--max-guess-rate",
        "reject environments a blind Done answers right more often than this (0 = only report)",
    )

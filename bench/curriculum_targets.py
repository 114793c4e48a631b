"""The curriculum bench's tables and targets (bench/curriculum_bench.py): the arms' and the recording's
columns, and the verdicts their rows must meet.
"""

from __future__ import annotations

from bench.common import (
    Figures,
)
from bench.tables import Col
from bench.targets import spread_verdicts, verdict


def recording_targets(rows: list[Figures]) -> list[Figures]:
    """Recording on against off, judged by the run-to-run spread."""
    return spread_verdicts(rows, "on", "off", name="record")


def curriculum_targets(rows: list[Figures]) -> list[Figures]:
    zero = {row["point"]: row["zero_variance_pct"] for row in rows}
    uniform, chosen = zero["uniform"], zero["curriculum"]
    return [
        verdict("uniform zero-variance groups", ">= 50 %", f"{uniform:.1f} %", uniform >= 50, pct=uniform),
        verdict("curriculum zero-variance groups", "<= 10 %", f"{chosen:.1f} %", chosen <= 10, pct=chosen),
    ]


CURRICULUM_COLUMNS = (
    "curriculum: B configurations x 8 episodes per training step, uniform or from SampleTasks",
    [
        Col("tasks", "tasks", "d"),
        Col("steps", "steps", "d"),
        Col("groups", "groups", "d"),
        Col("zero-var %", "zero_variance_pct", ".1f"),
        Col("zero-var % late", "zero_variance_late_pct", ".1f"),
        Col("useful/1000", "useful_per_1000", ".0f"),
        Col("pass rate start", "pass_rate_start", ".3f"),
        Col("pass rate end", "pass_rate_end", ".3f"),
        Col("s/step", "seconds_per_step", ".1f"),
    ],
)
RECORDING_COLUMNS = (
    "recording on/off: steady N rollouts thinking T, one fresh stack per run, alternating",
    [
        Col("served/s", "served"),
        Col("p50 ms", "p50_ms", ".2f"),
        Col("p99 ms", "p99_ms", ".1f"),
        Col("CPU ms/step", "cpu_ms_per_step", ".2f"),
        Col("recorded", "recorded", "d"),
        Col("errors", "errors", "d"),
        Col("mismatch", "mismatches", "d"),
        Col("other CPU %", "other_cpu_pct"),
    ],
)

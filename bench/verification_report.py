"""The verification bench's report (bench/verification_bench.py): its measurements as titled sections
of figures, the services' against the naive way's, printed as key-value lines.
"""

from __future__ import annotations

import argparse
import os

from bench.verification_cases import (
    CANDIDATES,
    ENV_CLASS,
    TESTS,
    WORKERS,
    Inputs,
    Measured,
    NaiveRun,
    ServiceRuns,
    outcome_summary,
)
from codegym.sandbox.v1 import sandbox_service_pb2 as sb
from codegym.verification.v1 import verification_service_pb2 as vf

Section = tuple[str, dict[str, object]]


def ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


def wall_figures(t: Measured) -> dict[str, object]:
    return {"wall_ms_p50": ms(t.wall), "wall_ms_min_max": f"{ms(min(t.walls))} / {ms(max(t.walls))}"}


def cpu_figures(t: Measured) -> dict[str, object]:
    return {"servers_cpu_ms_per_call": ms(t.servers_cpu_s), "bench_cpu_ms_per_call": ms(t.bench_cpu_s)}


def setup_section(args: argparse.Namespace, load_start: float) -> Section:
    return (
        "setup",
        {
            "environment": f"{ENV_CLASS}: {CANDIDATES} solve() candidates × {TESTS} tests",
            "servers": f"{WORKERS} × `serve sandbox --jails {args.jails}` + `serve verification`",
            "timing": f"wall = median of {args.runs} calls after 1 warm-up; CPU per call",
            "load_average_1m_start_end": f"{load_start:.2f} / {os.getloadavg()[0]:.2f}",
        },
    )


def solvability_figures(t: Measured) -> dict[str, object]:
    r: vf.CheckSolvabilityResponse = t.last
    return {
        **wall_figures(t),
        "verdict": f"{vf.Verdict.Name(r.verdict).removeprefix('VERDICT_')}, oracle {r.oracle_index}",
        "candidates": outcome_summary(r),
        "cases_run": r.cases_run,
        "sandbox_cpu_ms_from_response": r.cpu_ms,
        **cpu_figures(t),
        "ms_per_case": round(ms(t.wall) / max(1, r.cases_run), 2),
    }


def batch_section(batch: Measured, n: int) -> Section:
    results: dict[tuple[int, int], sb.OperationResult] = batch.last
    rewarded = sum(1 for r in results.values() if r.status == sb.STATUS_OK and r.reward == 1.0)
    return (
        f"ExecuteBatch, {n} cases split over {WORKERS} workers (one call each, concurrent)",
        {
            **wall_figures(batch),
            "cases_per_s": round(n / batch.wall, 1),
            "ms_per_case": round(ms(batch.wall) / n, 2),
            "reward_1": f"{rewarded}/{n} (expected {n - CANDIDATES + 1})",
            "source_needed": sum(1 for r in results.values() if r.status == sb.STATUS_SOURCE_NEEDED),
            "sandbox_cpu_ms_from_results": sum(r.usage.cpu_ms for r in results.values()),
            **cpu_figures(batch),
        },
    )


def validate_section(units: Measured) -> Section:
    vu: vf.ValidateUnitTestsResponse = units.last
    return (
        f"ValidateUnitTests, {TESTS} configs",
        {
            **wall_figures(units),
            "verdict": f"{vf.Verdict.Name(vu.verdict).removeprefix('VERDICT_')}, valid {vu.valid}/{TESTS}",
            **cpu_figures(units),
        },
    )


def check_sections(runs: ServiceRuns) -> list[Section]:
    """The checks after solvability, each also as a multiple of CheckSolvability stopping at the oracle."""
    negative, determ5, determ30, guess = runs.negative, runs.determ5, runs.determ30, runs.guess
    checks: list[tuple[str, Measured, dict[str, object]]] = [
        (
            f"CheckNegativeControls, {TESTS} tests",
            negative,
            {
                "wrong_answers": negative.last.controls,
                "kinds": dict(negative.last.kinds),
                "sandbox_runs": negative.last.runs,
                "sandbox_cpu_ms_from_response": negative.last.cpu_ms,
            },
        ),
        (
            "CheckDeterminism, default 5 tests (10 runs)",
            determ5,
            {"sandbox_runs": determ5.last.runs, "sandbox_cpu_ms_from_response": determ5.last.cpu_ms},
        ),
        (
            f"CheckDeterminism, all {TESTS} tests ({2 * TESTS} runs)",
            determ30,
            {"sandbox_runs": determ30.last.runs, "sandbox_cpu_ms_from_response": determ30.last.cpu_ms},
        ),
        (
            f"MeasureGuessability, {TESTS} tests (no sandbox)",
            guess,
            {"guess_rate": round(guess.last.guess_rate, 3)},
        ),
    ]
    allpass = runs.allpass
    return [
        (
            title,
            {
                **wall_figures(t),
                "verdict": vf.Verdict.Name(t.last.verdict).removeprefix("VERDICT_"),
                **extra,
                **cpu_figures(t),
                "wall_vs_solvability_stop_at_oracle": round(t.wall / allpass.wall, 2),
                "servers_cpu_vs_solvability_stop_at_oracle": round(
                    t.servers_cpu_s / max(1e-9, allpass.servers_cpu_s), 2
                ),
            },
        )
        for title, t, extra in checks
    ]


def naive_section(naive: NaiveRun, results: dict[tuple[int, int], sb.OperationResult], n: int) -> Section:
    sampled = len(naive.sample)
    agree = sum(
        1
        for case, reward in zip(naive.sample, naive.rewards, strict=True)
        if reward is not None and results[case].status == sb.STATUS_OK and reward == results[case].reward
    )
    return (
        f"naive: one fresh `python` per case, {WORKERS} at a time; {sampled} of {n} cases timed,"
        f" extrapolated to {n}",
        {
            f"sample_wall_ms_{sampled}_cases": ms(naive.wall),
            "ms_per_case": round(ms(naive.wall_per_case), 2),
            f"wall_ms_{n}_cases_extrapolated": ms(naive.wall_per_case * n),
            f"cpu_ms_{n}_cases_extrapolated": ms(naive.cpu_per_case * n),
            "rewards_agree_with_sandbox": f"{agree}/{sampled}",
        },
    )


def ratio_section(runs: ServiceRuns, naive: NaiveRun, n: int) -> Section:
    allpass, fullm, batch = runs.allpass, runs.fullm, runs.batch
    ap: vf.CheckSolvabilityResponse = allpass.last
    fm: vf.CheckSolvabilityResponse = fullm.last
    return (
        "ratios (naive / verification, same cases; target ≥ 20× faster)",
        {
            f"wall_naive_over_executebatch_{n}": round(naive.wall_per_case * n / batch.wall, 1),
            f"wall_naive_over_checksolvability_full_{fm.cases_run}": round(
                naive.wall_per_case * fm.cases_run / fullm.wall, 1
            ),
            f"wall_naive_over_checksolvability_allpass_{ap.cases_run}": round(
                naive.wall_per_case * ap.cases_run / allpass.wall, 1
            ),
            f"cpu_naive_over_executebatch_{n}_servers_plus_bench": round(
                naive.cpu_per_case * n / (batch.servers_cpu_s + batch.bench_cpu_s), 1
            ),
            f"cpu_naive_over_checksolvability_full_{fm.cases_run}_servers_plus_bench": round(
                naive.cpu_per_case * fm.cases_run / (fullm.servers_cpu_s + fullm.bench_cpu_s), 1
            ),
        },
    )


def report(
    args: argparse.Namespace, inputs: Inputs, runs: ServiceRuns, naive: NaiveRun, load_start: float
) -> list[Section]:
    n = len(inputs.matrix)
    return [
        setup_section(args, load_start),
        (
            "CheckSolvability, all 10 candidates = env's solve() (stops at candidate 0)",
            solvability_figures(runs.allpass),
        ),
        (
            "CheckSolvability, full matrix (candidates 0-8 wrong on the last test only)",
            solvability_figures(runs.fullm),
        ),
        batch_section(runs.batch, n),
        validate_section(runs.units),
        *check_sections(runs),
        naive_section(naive, runs.batch.last, n),
        ratio_section(runs, naive, n),
    ]


def print_sections(sections: list[Section]) -> None:
    width = max(len(k) for _, figures in sections for k in figures)
    for title, figures in sections:
        print(f"== {title}")
        for key, value in figures.items():
            print(f"  {key:<{width}}  {value}")

"""The pipeline's trust stages: a verified reward must mean something (negative controls,
determinism with resident against cold, guessability). Each asks the verification service, which
runs everything in sandbox workers.

Each stage is a function of the verification stub, the settings it reads and the data of the
stages before it (`done`), all passed in: `Pipeline` calls them with its own, so this module
reads on its own and nothing here reaches into the pipeline object.
"""

from __future__ import annotations

from typing import Any

from codegym.verification.v1 import verification_service_pb2 as vf
from codegym.verification.v1 import verification_service_pb2_grpc as vf_grpc
from codegym_jobs.pipeline.state import StageOutcome, passed, rejected

# How long one check may take (the verification service runs many sandbox operations for it).
CHECK_DEADLINE_S = 600.0


async def negative_controls(
    verification: vf_grpc.VerificationServiceStub, limits: vf.SolvabilityLimits, done: dict[str, Any]
) -> StageOutcome:
    """Wrong answers to the oracle environment's tests, each through `Done`: none may be paid."""
    tasks = done["solvability"]["tasks"]
    response = await verification.CheckNegativeControls(
        vf.CheckNegativeControlsRequest(
            env_source=done["solvability"]["oracle_env_source"],
            cases=[
                vf.ShortcutCase(config_json=t["config_json"], answer_json=t["answer_json"]) for t in tasks
            ],
            case_time_ms=limits.case_time_ms,
            case_memory_mb=limits.case_memory_mb,
        ),
        timeout=CHECK_DEADLINE_S,
    )
    data: dict[str, Any] = {
        "tests": response.tests,
        "controls": response.controls,
        "kinds": dict(sorted(response.kinds.items())),
        "runs": response.runs,
        "cpu_ms": response.cpu_ms,
        "failed_runs": response.failed_runs,
        "paid": [
            {
                "config_json": p.config_json,
                "kind": p.kind,
                "answer": p.answer_json,
                "reference": p.reference_json,
                "reward": p.reward,
                "observation": p.observation,
            }
            for p in response.paid
        ],
    }
    if response.first_failure:
        data["first_failure"] = response.first_failure
    if response.verdict != vf.VERDICT_PASS:
        return rejected("; ".join(response.reasons), data)
    return passed(data)


async def determinism(
    verification: vf_grpc.VerificationServiceStub,
    limits: vf.SolvabilityLimits,
    tests: int,
    done: dict[str, Any],
) -> StageOutcome:
    """The oracle replayed on `tests` tests, and resident against cold: the same trajectory each time."""
    solvability = done["solvability"]
    oracle = done["solve_functions"]["candidates"][solvability["oracle_index"]]
    response = await verification.CheckDeterminism(
        vf.CheckDeterminismRequest(
            env_source=solvability["oracle_env_source"],
            solve_source=oracle["solve_source"],
            config_jsons=[t["config_json"] for t in solvability["tasks"]],
            tests=tests,
            case_time_ms=limits.case_time_ms,
            case_memory_mb=limits.case_memory_mb,
            max_steps=limits.max_steps,
        ),
        timeout=CHECK_DEADLINE_S,
    )
    data: dict[str, Any] = {
        "compared": response.compared,
        "runs": response.runs,
        "cpu_ms": response.cpu_ms,
        "differences": [
            {
                "config_json": d.config_json,
                "step": d.step,
                "what": d.what,
                "first": d.first,
                "second": d.second,
            }
            for d in response.differences[:5]
        ],
        "resident_steps": response.resident_steps,
        "resident_served": response.resident_served,
    }
    if response.HasField("resident_difference"):
        d = response.resident_difference
        data["resident_difference"] = {
            "config_json": d.config_json,
            "step": d.step,
            "what": d.what,
            "resident": d.first,
            "cold": d.second,
        }
    if response.verdict != vf.VERDICT_PASS:
        return rejected("; ".join(response.reasons), data)
    return passed(data)


async def guessability(
    verification: vf_grpc.VerificationServiceStub, max_guess_rate: float, done: dict[str, Any]
) -> StageOutcome:
    """How often a blind `Done` is right per test; above `max_guess_rate` (when set) rejects."""
    tasks = done["solvability"]["tasks"]
    response = await verification.MeasureGuessability(
        vf.MeasureGuessabilityRequest(
            cases=[
                vf.ShortcutCase(config_json=t["config_json"], answer_json=t["answer_json"]) for t in tasks
            ],
            max_guess_rate=max_guess_rate,
        ),
        timeout=CHECK_DEADLINE_S,
    )
    data: dict[str, Any] = {
        "guess_rate": round(response.guess_rate, 4),
        "most_frequent": response.most_frequent_json,
        "rates": {t["config_json"]: round(r, 4) for t, r in zip(tasks, response.guess_rates, strict=True)},
    }
    if response.verdict != vf.VERDICT_PASS:
        return rejected("; ".join(response.reasons), data)
    return passed(data)

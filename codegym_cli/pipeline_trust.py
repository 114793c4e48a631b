"""The pipeline's trust stages: a verified reward must mean something (negative controls,
determinism with resident against cold, guessability). `Pipeline` inherits them; each asks the
verification service, which runs everything in sandbox workers.
"""

from __future__ import annotations

from typing import Any

from codegym.verification.v1 import verification_service_pb2 as vf
from codegym.verification.v1 import verification_service_pb2_grpc as vf_grpc
from codegym_cli.pipeline_state import StageOutcome, passed, rejected
from services.synthesis.problems import Problem

# How long one check may take (the verification service runs many sandbox operations for it).
CHECK_DEADLINE_S = 600.0


class TrustStages:
    config: Any
    verification: vf_grpc.VerificationServiceStub

    async def _negative_controls(self, problem: Problem, done: dict[str, Any]) -> StageOutcome:
        tasks = done["solvability"]["tasks"]
        response = await self.verification.CheckNegativeControls(
            vf.CheckNegativeControlsRequest(
                env_source=done["solvability"]["oracle_env_source"],
                cases=[
                    vf.ShortcutCase(config_json=t["config_json"], answer_json=t["answer_json"]) for t in tasks
                ],
                case_time_ms=self.config.solvability.case_time_ms,
                case_memory_mb=self.config.solvability.case_memory_mb,
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

    async def _determinism(self, problem: Problem, done: dict[str, Any]) -> StageOutcome:
        solvability = done["solvability"]
        oracle = done["solve_functions"]["candidates"][solvability["oracle_index"]]
        response = await self.verification.CheckDeterminism(
            vf.CheckDeterminismRequest(
                env_source=solvability["oracle_env_source"],
                solve_source=oracle["solve_source"],
                config_jsons=[t["config_json"] for t in solvability["tasks"]],
                tests=self.config.determinism_tests,
                case_time_ms=self.config.solvability.case_time_ms,
                case_memory_mb=self.config.solvability.case_memory_mb,
                max_steps=self.config.solvability.max_steps,
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

    async def _guessability(self, problem: Problem, done: dict[str, Any]) -> StageOutcome:
        tasks = done["solvability"]["tasks"]
        response = await self.verification.MeasureGuessability(
            vf.MeasureGuessabilityRequest(
                cases=[
                    vf.ShortcutCase(config_json=t["config_json"], answer_json=t["answer_json"]) for t in tasks
                ],
                max_guess_rate=self.config.max_guess_rate,
            ),
            timeout=CHECK_DEADLINE_S,
        )
        data: dict[str, Any] = {
            "guess_rate": round(response.guess_rate, 4),
            "most_frequent": response.most_frequent_json,
            "rates": {
                t["config_json"]: round(r, 4) for t, r in zip(tasks, response.guess_rates, strict=True)
            },
        }
        if response.verdict != vf.VERDICT_PASS:
            return rejected("; ".join(response.reasons), data)
        return passed(data)

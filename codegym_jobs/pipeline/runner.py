"""The pipeline: problems in, verified environments and task configs in the library out.

    environment → check → unit_tests → [hard_tests] → validate → solve_functions → solvability
    → negative_controls → determinism → guessability → filters → library

Each problem walks the stages on its own (several problems in flight); generation goes through
the synthesis service, every check through the verification service (which runs the code in
sandbox workers), both over gRPC. Every stage outcome is stored in the work folder before the
next stage starts, so an interrupted run continues where it stopped and redoes nothing finished;
one problem's failure never stops the others.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from codegym.library.store import Library, TaskRecord, canonical_config
from codegym.server.metrics import PIPELINE_OUTCOMES
from codegym.synthesis.v1 import synthesis_service_pb2 as sy
from codegym.synthesis.v1 import synthesis_service_pb2_grpc as sy_grpc
from codegym.verification.v1 import verification_service_pb2 as vf
from codegym.verification.v1 import verification_service_pb2_grpc as vf_grpc
from codegym_client.api.common.v1 import common_pb2 as cm
from codegym_client.errors import refused_as_sent
from codegym_jobs.pipeline.settings import PipelineSettings
from codegym_jobs.pipeline.state import (
    PipelineState,
    StageOutcome,
    parse_status,
    passed,
    rejected,
    usage_fields,
)
from codegym_jobs.pipeline.trust import CHECK_DEADLINE_S, determinism, guessability, negative_controls
from services.synthesis.problems import Problem

STAGES = (
    "environment",
    "check",
    "unit_tests",
    "hard_tests",
    "validate",
    "solve_functions",
    "solvability",
    "negative_controls",
    "determinism",
    "guessability",
    "filters",
    "library",
)
LLM_STAGES = ("environment", "unit_tests", "hard_tests", "solve_functions")
LLM_DEADLINE_S = 3600.0
DIFFICULTY = {"easy": cm.DIFFICULTY_EASY, "medium": cm.DIFFICULTY_MEDIUM, "hard": cm.DIFFICULTY_HARD}

Progress = Callable[[str, str, StageOutcome], None]
Step = Callable[[Problem, dict[str, Any]], Awaitable[StageOutcome]]

# Every option at its default: `PipelineConfig`'s defaults are read from it.
_OPTIONS = PipelineSettings()


@dataclass
class PipelineConfig:
    """Everything a run can be told, as the stages read it; the defaults are `PipelineSettings`'s
    (the options of `codegym pipeline run`, DESIGN §7's), which `of` builds it from."""

    hard_tests: bool = _OPTIONS.hard_tests
    reject_unsafe: bool = _OPTIONS.reject_unsafe
    parallel: int = _OPTIONS.parallel
    model: str = ""
    unit_tests: vf.UnitTestThresholds = field(default_factory=_OPTIONS.unit_tests.message)
    solvability: vf.SolvabilityLimits = field(default_factory=_OPTIONS.solvability.message)
    min_solve_fc_round: int = _OPTIONS.min_solve_fc_round
    max_solve_fc_round: int = _OPTIONS.max_solve_fc_round
    min_tools: int = _OPTIONS.min_tools
    drop_shortcuts: bool = not _OPTIONS.keep_shortcuts
    shortcut_fraction: float = _OPTIONS.shortcut_fraction
    # Wrong answers derived from each reference answer must all get reward 0.
    negative_controls: bool = not _OPTIONS.no_negative_controls
    # The oracle replayed twice on this many tests must give the same trajectory (0 = off).
    determinism_tests: int = _OPTIONS.determinism_tests
    # Reject an environment whose blind Done is right more often than this (0 = only report).
    max_guess_rate: float = _OPTIONS.max_guess_rate

    @classmethod
    def of(cls, settings: PipelineSettings, model: str) -> PipelineConfig:
        """A run's config from `codegym pipeline run`'s options (`model`: the LLM's, for the record)."""
        return cls(
            hard_tests=settings.hard_tests,
            reject_unsafe=settings.reject_unsafe,
            parallel=settings.parallel,
            model=model,
            unit_tests=settings.unit_tests.message(),
            solvability=settings.solvability.message(),
            min_solve_fc_round=settings.min_solve_fc_round,
            max_solve_fc_round=settings.max_solve_fc_round,
            min_tools=settings.min_tools,
            drop_shortcuts=not settings.keep_shortcuts,
            shortcut_fraction=settings.shortcut_fraction,
            negative_controls=not settings.no_negative_controls,
            determinism_tests=settings.determinism_tests,
            max_guess_rate=settings.max_guess_rate,
        )

    def active_stages(self) -> tuple[str, ...]:
        off = {
            "hard_tests": not self.hard_tests,
            "negative_controls": not self.negative_controls,
            "determinism": self.determinism_tests <= 0,
        }
        return tuple(s for s in STAGES if not off.get(s, False))


class Pipeline:
    """Runs problems through the stages. Build inside the running loop."""

    def __init__(
        self,
        state: PipelineState,
        library: Library,
        synthesis: grpc.aio.Channel,
        verification: grpc.aio.Channel,
        config: PipelineConfig,
        progress: Progress | None = None,
    ) -> None:
        self.state = state
        self.library = library
        self.synthesis = sy_grpc.SynthesisServiceStub(synthesis)
        self.verification = vf_grpc.VerificationServiceStub(verification)
        self.config = config
        self.progress = progress
        self.run_id = state.run_id()
        # What runs each stage, in STAGES' order; each takes the problem and the data of the
        # stages before it, and returns its outcome.
        self.steps: dict[str, Step] = {
            "environment": self._environment,
            "check": self._check,
            "unit_tests": self._unit_tests,
            "hard_tests": self._hard_tests,
            "validate": self._validate,
            "solve_functions": self._solve_functions,
            "solvability": self._solvability,
            "negative_controls": self._negative_controls,
            "determinism": self._determinism,
            "guessability": self._guessability,
            "filters": self._filters,
            "library": self._library,
        }

    def stages(self) -> tuple[str, ...]:
        return self.config.active_stages()

    async def run(self, problems: list[Problem]) -> None:
        limit = asyncio.Semaphore(self.config.parallel)

        async def one(problem: Problem) -> None:
            async with limit:
                await self.problem(problem)

        await asyncio.gather(*(one(p) for p in problems))

    async def problem(self, problem: Problem) -> None:
        """Walk one problem through the stages, from the first one without a final outcome."""
        done: dict[str, dict[str, Any]] = {}
        for stage in self.stages():
            outcome = self.state.outcome(problem.question_id, stage)
            if outcome is None:
                started = time.monotonic()
                try:
                    outcome = await self.steps[stage](problem, done)
                except grpc.aio.AioRpcError as exc:
                    # A request that will never be taken as it stands is rejected, not retried later.
                    status = "rejected" if refused_as_sent(exc.code()) else "error"
                    outcome = StageOutcome(status, reason=f"rpc_{exc.code().name.lower()}: {exc.details()}")
                except Exception as exc:  # one problem's bug must not stop the others
                    outcome = StageOutcome("error", reason=f"internal: {type(exc).__name__}: {exc}")
                outcome.wall_s = time.monotonic() - started
                self.state.record(problem.question_id, stage, outcome)
                PIPELINE_OUTCOMES.labels(stage, outcome.status).inc()
            if self.progress is not None:
                self.progress(problem.question_id, stage, outcome)
            if outcome.status != "passed":
                return
            done[stage] = outcome.data

    # ---- stages -------------------------------------------------------------------------------
    # Each takes the problem and the data of the stages before it, and returns its outcome.

    async def _environment(self, problem: Problem, done: dict[str, Any]) -> StageOutcome:
        request = sy.GenerateEnvironmentRequest(
            problem=sy.Problem(
                question_id=problem.question_id,
                question=problem.question,
                solution=problem.solution,
                tests=problem.tests,
            )
        )
        response = await self.synthesis.GenerateEnvironment(request, timeout=LLM_DEADLINE_S)
        usage = usage_fields(response.usage)
        good = next((c for c in response.candidates if c.status == sy.PARSE_STATUS_OK), None)
        if good is None:
            first = response.candidates[0] if response.candidates else None
            if first is None:
                return rejected("no_output: the model returned no candidate", usage=usage)
            detail = "; ".join(first.reasons[:2]) or "-"
            return rejected(f"{parse_status(first.status)}: {detail}", usage=usage)
        env_id = f"{problem.question_id}__{good.env_class}"
        data = {
            "env_id": env_id,
            "env_class": good.env_class,
            "env_source": good.env_source,
            "task_text": good.task_text,
        }
        return passed(data, usage=usage)

    async def _check(self, problem: Problem, done: dict[str, Any]) -> StageOutcome:
        env = done["environment"]
        response = await self.verification.CheckEnvironment(
            vf.CheckEnvironmentRequest(env_source=env["env_source"], reject_unsafe=self.config.reject_unsafe),
            timeout=CHECK_DEADLINE_S,
        )
        data = {
            "tools": [t.name for t in response.tools],
            "safety_findings": list(response.safety_findings),
            "main_exit_code": response.main_exit_code,
            "main_wall_ms": response.main_usage.wall_ms,
        }
        if response.verdict != vf.VERDICT_PASS:
            data["main_output"] = response.main_output
            return rejected("; ".join(response.reasons[:3]), data)
        return passed(data)

    async def _tests(self, env: dict[str, Any], *, hard: bool, seeds: list[str]) -> StageOutcome:
        response = await self.synthesis.GenerateUnitTests(
            sy.GenerateUnitTestsRequest(
                task_text=env["task_text"], env_source=env["env_source"], hard=hard, seed_tests=seeds
            ),
            timeout=LLM_DEADLINE_S,
        )
        usage = usage_fields(response.usage)
        good = [
            {"config_json": t.config_json, "difficulty": t.difficulty, "env_str": t.env_str}
            for t in response.tests
            if t.status == sy.PARSE_STATUS_OK
        ]
        bad = Counter(t.reason.split(":", 1)[0] for t in response.tests if t.status != sy.PARSE_STATUS_OK)
        data = {"tests": good, "unparsed": dict(bad)}
        if not good and not hard:
            return rejected(f"no_tests: no usable test line ({len(response.tests)} lines)", data, usage=usage)
        return passed(data, usage=usage)

    async def _unit_tests(self, problem: Problem, done: dict[str, Any]) -> StageOutcome:
        return await self._tests(done["environment"], hard=False, seeds=[])

    async def _hard_tests(self, problem: Problem, done: dict[str, Any]) -> StageOutcome:
        easy = [t["env_str"] for t in done["unit_tests"]["tests"] if t["difficulty"] == "easy"][:5]
        return await self._tests(done["environment"], hard=True, seeds=easy)

    async def _validate(self, problem: Problem, done: dict[str, Any]) -> StageOutcome:
        env = done["environment"]
        tests = done["unit_tests"]["tests"] + done.get("hard_tests", {}).get("tests", [])
        request = vf.ValidateUnitTestsRequest(
            env_source=env["env_source"],
            tasks=[
                cm.TaskConfig(
                    env_id=env["env_id"],
                    config_json=t["config_json"],
                    difficulty=DIFFICULTY.get(t["difficulty"], cm.DIFFICULTY_UNSPECIFIED),
                )
                for t in tests
            ],
            solution_source=problem.solution,
            entry_point=problem.entry_point,
            arg_names=list(problem.arg_names),
            thresholds=self.config.unit_tests,
        )
        response = await self.verification.ValidateUnitTests(request, timeout=CHECK_DEADLINE_S)
        valid = [
            {
                "config_json": t.task.config_json,
                "difficulty": tests[i]["difficulty"],
                "answer_json": t.answer_json,
            }
            for i, t in enumerate(response.tests)
            if t.valid
        ]
        invalid = Counter(t.reason.split(":", 1)[0] for t in response.tests if not t.valid)
        data = {
            "tests": valid,
            "valid": response.valid,
            "distinct": response.distinct,
            "invalid": dict(invalid),
            "solution_function": response.solution_function,
            "cross_checked": response.cross_checked,
            "disagreement_rate": round(response.disagreement_rate, 4),
        }
        if response.verdict != vf.VERDICT_PASS:
            reasons = list(response.reasons)
            if invalid:
                top = ", ".join(f"{k} ×{v}" for k, v in invalid.most_common(4))
                reasons[0] = f"{reasons[0]}; invalid: {top}"
            return rejected("; ".join(reasons), data)
        return passed(data)

    async def _solve_functions(self, problem: Problem, done: dict[str, Any]) -> StageOutcome:
        env = done["environment"]
        response = await self.synthesis.GenerateSolveFunctions(
            sy.GenerateSolveFunctionsRequest(task_text=env["task_text"], env_source=env["env_source"]),
            timeout=LLM_DEADLINE_S,
        )
        usage = usage_fields(response.usage)
        good = [
            {"solve_source": c.solve_source, "env_source": c.env_source}
            for c in response.candidates
            if c.status == sy.PARSE_STATUS_OK
        ]
        unparsed = Counter(
            parse_status(c.status) for c in response.candidates if c.status != sy.PARSE_STATUS_OK
        )
        data: dict[str, Any] = {
            "candidates": good,
            "unparsed": dict(unparsed),
            "generated": len(response.candidates),
        }
        if not good:
            return rejected(
                f"no_candidates: none of {len(response.candidates)} solve() outputs parsed", data, usage
            )
        return passed(data, usage=usage)

    async def _solvability(self, problem: Problem, done: dict[str, Any]) -> StageOutcome:
        env = done["environment"]
        tests = done["validate"]["tests"]
        candidates = done["solve_functions"]["candidates"]
        request = vf.CheckSolvabilityRequest(
            env_source=env["env_source"],
            tasks=[cm.TaskConfig(env_id=env["env_id"], config_json=t["config_json"]) for t in tests],
            solve_sources=[c["solve_source"] for c in candidates],
            limits=self.config.solvability,
        )
        budget_s = (self.config.solvability.budget_ms or 300_000) / 1000
        response = await self.verification.CheckSolvability(request, timeout=budget_s + CHECK_DEADLINE_S)
        outcomes = Counter(
            vf.CandidateOutcome.Name(c.outcome).removeprefix("CANDIDATE_OUTCOME_").lower()
            for c in response.candidates
        )
        data: dict[str, Any] = {
            "candidates": dict(outcomes),
            "cases_run": response.cases_run,
            "cpu_ms": response.cpu_ms,
            "first_failures": [c.first_failure for c in response.candidates if c.first_failure][:10],
        }
        if response.verdict != vf.VERDICT_PASS:
            return rejected("; ".join(response.reasons), data)
        oracle = candidates[response.oracle_index]
        data["oracle_index"] = response.oracle_index
        data["oracle_env_source"] = oracle["env_source"]
        data["tasks"] = [
            {**t, "solve_fc_round": r.solve_fc_round} for t, r in zip(tests, response.tasks, strict=True)
        ]
        return passed(data)

    # The trust stages (pipeline_trust.py) take the stub and the settings they read.

    async def _negative_controls(self, problem: Problem, done: dict[str, Any]) -> StageOutcome:
        return await negative_controls(self.verification, self.config.solvability, done)

    async def _determinism(self, problem: Problem, done: dict[str, Any]) -> StageOutcome:
        tests = self.config.determinism_tests
        return await determinism(self.verification, self.config.solvability, tests, done)

    async def _guessability(self, problem: Problem, done: dict[str, Any]) -> StageOutcome:
        return await guessability(self.verification, self.config.max_guess_rate, done)

    async def _filters(self, problem: Problem, done: dict[str, Any]) -> StageOutcome:
        env = done["environment"]
        tasks = done["solvability"]["tasks"]
        tools = sorted(set(done["check"]["tools"]))
        low, high = self.config.min_solve_fc_round, self.config.max_solve_fc_round
        kept = [t for t in tasks if low <= t["solve_fc_round"] <= high]
        response = await self.verification.CheckShortcuts(
            vf.CheckShortcutsRequest(
                env_source=env["env_source"],
                cases=[
                    vf.ShortcutCase(config_json=t["config_json"], answer_json=t["answer_json"]) for t in tasks
                ],
                max_fraction=self.config.shortcut_fraction,
            ),
            timeout=CHECK_DEADLINE_S,
        )
        rounds = [t["solve_fc_round"] for t in tasks]
        data: dict[str, Any] = {
            "tools": len(tools),
            "kept": len(kept),
            "dropped_rounds": len(tasks) - len(kept),
            "shortcut_tools": list(response.shortcut_tools),
            # A tool called with config values is keyed `Tool(arg, ...)`; bare, by its name.
            "probes": {
                (f"{p.tool}({', '.join(p.arguments)})" if p.arguments else p.tool): [p.hits, p.probed]
                for p in response.probes
            },
            "tasks": kept,
        }
        if len(tools) < self.config.min_tools:
            return rejected(f"too_few_tools: {len(tools)} tools (need {self.config.min_tools})", data)
        if response.shortcut_tools and self.config.drop_shortcuts:
            return rejected("; ".join(response.reasons), data)
        if not kept:
            return rejected(
                f"no_config_in_bounds: all {len(tasks)} configs need outside [{low}, {high}] oracle steps"
                f" ({min(rounds, default=0)}..{max(rounds, default=0)})",
                data,
            )
        return passed(data)

    async def _library(self, problem: Problem, done: dict[str, Any]) -> StageOutcome:
        env = done["environment"]
        tasks = done["filters"]["tasks"]
        rates = done.get("guessability", {}).get("rates", {})
        metadata = {
            "origin": {
                "problem_id": problem.question_id,
                "subset": problem.subset,
                "model": self.config.model,
                "pipeline_run": self.run_id,
            },
            "verification": {
                "check": {k: v for k, v in done["check"].items() if k != "main_output"},
                "validate": {k: v for k, v in done["validate"].items() if k != "tests"},
                "solvability": {
                    k: v
                    for k, v in done["solvability"].items()
                    if k not in ("tasks", "oracle_env_source", "first_failures")
                },
                **{
                    stage: dict(done[stage])
                    for stage in ("negative_controls", "determinism")
                    if stage in done
                },
                **(
                    {"guessability": {k: v for k, v in done["guessability"].items() if k != "rates"}}
                    if "guessability" in done
                    else {}
                ),
                "filters": {k: v for k, v in done["filters"].items() if k != "tasks"},
            },
        }
        self.library.put_environment(
            env["env_id"],
            done["solvability"]["oracle_env_source"],
            task_text=env["task_text"],
            metadata=metadata,
            tasks=[
                TaskRecord(
                    env["env_id"],
                    canonical_config(json.loads(t["config_json"])),
                    t["difficulty"],
                    t["solve_fc_round"],
                    guess_rate=rates.get(t["config_json"]),
                )
                for t in tasks
            ],
        )
        return passed({"env_id": env["env_id"], "tasks": len(tasks)})

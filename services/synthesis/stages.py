"""The three generation stages: environment, unit tests (normal and hard), solve functions.

Each stage is a prompt, a gateway call and a parser; it returns every candidate with its parse
status and reasons, accepted or not, so nothing is dropped without a trace.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, fields, replace
from typing import Any

from codegym.contract import analyze_source, tools_text
from services.synthesis import prompts
from services.synthesis.llm import LLMGateway, StageParams, StageUsage
from services.synthesis.parsing import (
    ParsedEnv,
    ParsedSolve,
    ParsedTest,
    parse_env_output,
    parse_solve_output,
    parse_test_lines,
)
from services.synthesis.problems import Problem

STAGES = ("environment", "unit_tests", "hard_tests", "solve_functions")


@dataclass
class StageDefaults:
    """Per-stage LLM parameters (the issue's defaults: 1 env, 2 × 15 tests, hard tests, K = 10)."""

    environment: StageParams = field(default_factory=lambda: StageParams(temperature=0.6, samples=1))
    unit_tests: StageParams = field(
        default_factory=lambda: StageParams(temperature=0.7, samples=2, max_tokens=4096)
    )
    hard_tests: StageParams = field(
        default_factory=lambda: StageParams(temperature=0.7, samples=1, max_tokens=4096)
    )
    solve_functions: StageParams = field(
        default_factory=lambda: StageParams(temperature=1.0, samples=10, max_tokens=4096)
    )

    def for_stage(self, stage: str) -> StageParams:
        params: StageParams = getattr(self, stage)
        return params

    @classmethod
    def overridden(cls, overrides: Iterable[str]) -> StageDefaults:
        """The defaults with `STAGE.KEY=VALUE` overrides (`--stage solve_functions.samples=10`);
        ValueError says which one is bad and why."""
        defaults = cls()
        types = {f.name: f.type for f in fields(StageParams)}
        for item in overrides:
            target, sep, value = item.partition("=")
            stage, dot, key = target.partition(".")
            if not sep or not dot or stage not in STAGES or key not in types:
                raise ValueError(
                    f"bad --stage {item!r}: expected STAGE.KEY=VALUE with STAGE in {', '.join(STAGES)} "
                    f"and KEY in {', '.join(types)}"
                )
            kind = {"str": str, "float": float, "int": int}[str(types[key])]
            try:
                typed: Any = kind(value)
            except ValueError:
                raise ValueError(f"--stage {item!r}: {value!r} is not a {kind.__name__}") from None
            setattr(defaults, stage, replace(defaults.for_stage(stage), **{key: typed}))
        return defaults


class Synthesizer:
    def __init__(self, gateway: LLMGateway, defaults: StageDefaults | None = None) -> None:
        self.gateway = gateway
        self.defaults = defaults or StageDefaults()

    def _params(self, stage: str, override: StageParams | None) -> StageParams:
        base = self.defaults.for_stage(stage)
        if override is None:
            return base
        return base.merged(
            model=override.model,
            temperature=override.temperature,
            top_p=override.top_p,
            max_tokens=override.max_tokens,
            samples=override.samples,
        )

    async def environment(
        self, problem: Problem, params: StageParams | None = None, usage: StageUsage | None = None
    ) -> list[ParsedEnv]:
        messages = prompts.environment_messages(problem.question, problem.solution)
        completions = await self.gateway.complete(
            "environment", messages, self._params("environment", params), usage
        )
        return [parse_env_output(c.text, c.finish_reason) for c in completions]

    async def unit_tests(
        self,
        task_text: str,
        env_source: str,
        *,
        hard: bool = False,
        seed_tests: list[str] | None = None,
        params: StageParams | None = None,
        usage: StageUsage | None = None,
    ) -> list[ParsedTest]:
        env_class = analyze_source(env_source).class_name
        if not env_class:
            return [ParsedTest("invalid_test", "the env source has no env class")]
        stage = "hard_tests" if hard else "unit_tests"
        if hard:
            messages = prompts.hard_test_messages(task_text, env_source, env_class, seed_tests or [])
        else:
            messages = prompts.unit_test_messages(task_text, env_source, env_class)
        completions = await self.gateway.complete(stage, messages, self._params(stage, params), usage)
        tests: list[ParsedTest] = []
        seen: set[str] = set()
        for completion in completions:
            parsed = parse_test_lines(completion.text, env_class, hard=hard)
            if not parsed and completion.finish_reason == "length":
                parsed = [
                    ParsedTest("invalid_test", "completion cut by the token limit before any test line")
                ]
            for test in parsed:
                if test.status == "ok" and test.config_json in seen:
                    test = ParsedTest(
                        "invalid_test", f"duplicate of an earlier test: {test.env_str[:80]}", test.env_str
                    )
                elif test.status == "ok":
                    seen.add(test.config_json)
                tests.append(test)
        return tests

    async def solve_functions(
        self,
        task_text: str,
        env_source: str,
        *,
        count: int = 0,
        params: StageParams | None = None,
        usage: StageUsage | None = None,
    ) -> list[ParsedSolve]:
        spec = analyze_source(env_source)
        if spec.violations:
            return [ParsedSolve("contract_violation", ["the env source breaks the contract"])]
        merged = self._params("solve_functions", params)
        if count:
            merged = merged.merged(samples=count)
        messages = prompts.solve_messages(task_text, tools_text(spec))
        completions = await self.gateway.complete("solve_functions", messages, merged, usage)
        return [parse_solve_output(c.text, env_source, c.finish_reason) for c in completions]

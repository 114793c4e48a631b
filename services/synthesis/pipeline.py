"""All three stages for a problem set, with an output folder a library import understands.

    OUT/envs/{question_id}__{Env}.py and .task.md   accepted environments (first good candidate)
    OUT/tests/{env_id}.jsonl                        {"env_id", "config", "difficulty"} per test
    OUT/solve/{env_id}.jsonl                        every solve() candidate, with status and reasons
    OUT/rejected/{question_id}.jsonl                every rejected output of every stage, with reasons
    OUT/summary.json                                per-stage counts, reasons and token usage

`codegym library import OUT/envs OUT/tests` loads the environments and their tests. Reruns are served by the
gateway's response cache, so an interrupted run resumes where it stopped at no cost.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from services.synthesis.llm import LLMRejected, LLMUnavailable
from services.synthesis.problems import Problem
from services.synthesis.stages import STAGES, Synthesizer


@dataclass
class StageSummary:
    accepted: int = 0
    rejected: int = 0
    reasons: Counter[str] = field(default_factory=Counter)


@dataclass
class ProblemResult:
    question_id: str
    env_id: str = ""
    stages: dict[str, tuple[int, int, list[str]]] = field(default_factory=dict)
    error: str = ""


Progress = Callable[[str, str, int, int, list[str]], None]


def reason_class(reason: str) -> str:
    """A reason without its specifics (line numbers, values), for counting."""
    head = reason.split(":", 1)[0]
    return head if len(head) < 60 else head[:60]


async def synthesize_problem(
    synth: Synthesizer, problem: Problem, out: Path, progress: Progress | None = None
) -> ProblemResult:
    result = ProblemResult(problem.question_id)
    rejected: list[dict[str, Any]] = []

    def record(stage: str, ok: int, bad: list[tuple[str, list[str]]]) -> None:
        reasons = [r for _, rs in bad for r in rs]
        result.stages[stage] = (ok, len(bad), reasons)
        for status, rs in bad:
            rejected.append(
                {"question_id": problem.question_id, "stage": stage, "status": status, "reasons": rs}
            )
        if progress is not None:
            progress(problem.question_id, stage, ok, len(bad), reasons)

    try:
        envs = await synth.environment(problem)
        record(
            "environment",
            sum(e.status == "ok" for e in envs),
            [(e.status, e.reasons) for e in envs if e.status != "ok"],
        )
        env = next((e for e in envs if e.status == "ok"), None)
        if env is None:
            return result
        env_id = f"{problem.question_id}__{env.env_class}"
        result.env_id = env_id
        (out / "envs").mkdir(parents=True, exist_ok=True)
        (out / "envs" / f"{env_id}.py").write_text(env.env_source)
        (out / "envs" / f"{env_id}.task.md").write_text(env.task_text + "\n")

        tests = await synth.unit_tests(env.task_text, env.env_source)
        good = [t for t in tests if t.status == "ok"]
        record("unit_tests", len(good), [(t.status, [t.reason]) for t in tests if t.status != "ok"])
        seeds = [t.env_str for t in good if t.difficulty == "easy"][:5]
        hard = await synth.unit_tests(env.task_text, env.env_source, hard=True, seed_tests=seeds)
        known = {t.config_json for t in good}
        hard_good = [t for t in hard if t.status == "ok" and t.config_json not in known]
        record("hard_tests", len(hard_good), [(t.status, [t.reason]) for t in hard if t.status != "ok"])
        lines = [
            json.dumps({"env_id": env_id, "config": json.loads(t.config_json), "difficulty": t.difficulty})
            for t in good + hard_good
        ]
        (out / "tests").mkdir(parents=True, exist_ok=True)
        (out / "tests" / f"{env_id}.jsonl").write_text("".join(x + "\n" for x in lines))

        solves = await synth.solve_functions(env.task_text, env.env_source)
        record(
            "solve_functions",
            sum(s.status == "ok" for s in solves),
            [(s.status, s.reasons) for s in solves if s.status != "ok"],
        )
        (out / "solve").mkdir(parents=True, exist_ok=True)
        (out / "solve" / f"{env_id}.jsonl").write_text(
            "".join(
                json.dumps(
                    {
                        "env_id": env_id,
                        "index": i,
                        "status": s.status,
                        "reasons": s.reasons,
                        "solve_source": s.solve_source,
                    }
                )
                + "\n"
                for i, s in enumerate(solves)
            )
        )
    except (LLMUnavailable, LLMRejected) as exc:
        result.error = str(exc)
        if progress is not None:
            progress(problem.question_id, "error", 0, 0, [str(exc)])
    finally:
        if rejected:
            (out / "rejected").mkdir(parents=True, exist_ok=True)
            (out / "rejected" / f"{problem.question_id}.jsonl").write_text(
                "".join(json.dumps(r) + "\n" for r in rejected)
            )
    return result


async def synthesize_all(
    synth: Synthesizer,
    problems: list[Problem],
    out: Path,
    progress: Progress | None = None,
    parallel: int = 8,
) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    limit = asyncio.Semaphore(parallel)

    async def one(problem: Problem) -> ProblemResult:
        async with limit:
            return await synthesize_problem(synth, problem, out, progress)

    results = await asyncio.gather(*(one(p) for p in problems))
    summary: dict[str, StageSummary] = {stage: StageSummary() for stage in STAGES}
    for result in results:
        for stage, (ok, bad, reasons) in result.stages.items():
            summary[stage].accepted += ok
            summary[stage].rejected += bad
            summary[stage].reasons.update(reason_class(r) for r in reasons)
    report = {
        "problems": len(problems),
        "environments": sum(1 for r in results if r.env_id),
        "errors": {r.question_id: r.error for r in results if r.error},
        "stages": {
            k: {"accepted": v.accepted, "rejected": v.rejected, "reasons": dict(v.reasons)}
            for k, v in summary.items()
        },
        "usage": {k: asdict(v) for k, v in synth.gateway.usage.items()},
    }
    (out / "summary.json").write_text(json.dumps(report, indent=2) + "\n")
    return report

"""The verification checks, each a plan of sandbox operations and a reading of their results.

Nothing generated runs here: environment sources, reference answers, original solutions and
solve() candidates run in sandbox workers through `ExecuteBatch`; this process reads sources
only with `ast` and compares answers as JSON. Every failure comes back as a reason
`class: detail`, where `class` is a short token a pipeline can count.

The trust checks live beside this module (trust.py, controls.py) as functions taking what they
run on; `Verifier` hands them its `_run` (and its dispatcher), so the class is the one place that
holds the dispatcher and each of those modules reads on its own.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from codegym.contract import (
    analyze_source,
    answers_equal,
    scan_source,
    tool_schema,
    tool_text,
)
from codegym.sandbox.v1 import sandbox_service_pb2 as sb
from codegym.verification.v1 import verification_service_pb2 as vf
from codegym_client.api.common.v1 import common_pb2 as cm
from services.dispatcher import SandboxDispatcher
from services.verification import controls, trust
from services.verification.plans import (
    BUDGET_MS,
    CASE_MEMORY_MB,
    CASE_TIME_MS,
    MAIN_TIMEOUT_MS,
    MAX_ANSWER_CHARS,
    MAX_STEPS,
    MIN_VALID,
    MIN_VALID_RATIO,
    REF_MEMORY_MB,
    REF_TIME_MS,
    SMOKE_TESTS,
    WAVE,
    RunOps,
    Sources,
    config_key,
    failure,
    json_value,
    last_line,
    limits,
    tail,
)
from services.verification.solution import SolutionCall, find_solution_call


class Verifier:
    """The checks, over one sandbox dispatcher (a channel to every worker)."""

    def __init__(self, sandbox: SandboxDispatcher) -> None:
        self.sandbox = sandbox

    async def _run(self, ops: Sequence[sb.Operation], sources: Sources) -> list[sb.OperationResult]:
        """A plan of independent operations, results in order (the `run` every check is given)."""
        if not ops:
            return []
        return await self.sandbox.execute_batch(ops, sources.by_sha)

    # ---- trust checks (trust.py, controls.py) ---------------------------------------------------

    async def check_shortcuts(self, request: vf.CheckShortcutsRequest) -> vf.CheckShortcutsResponse:
        return await trust.check_shortcuts(self._run, request)

    async def check_negative_controls(
        self, request: vf.CheckNegativeControlsRequest
    ) -> vf.CheckNegativeControlsResponse:
        return await controls.check_negative_controls(self._run, request)

    async def check_determinism(self, request: vf.CheckDeterminismRequest) -> vf.CheckDeterminismResponse:
        return await trust.check_determinism(self._run, self.sandbox, request)

    async def measure_guessability(
        self, request: vf.MeasureGuessabilityRequest
    ) -> vf.MeasureGuessabilityResponse:
        return trust.measure_guessability(request)

    # ---- environment ----------------------------------------------------------------------------

    async def check_environment(self, request: vf.CheckEnvironmentRequest) -> vf.CheckEnvironmentResponse:
        source = request.env_source
        spec = analyze_source(source)
        response = vf.CheckEnvironmentResponse(env_class=spec.class_name)
        response.reasons.extend(f"{v.code}: {v}" for v in spec.violations)
        findings = [str(f) for f in scan_source(source)]
        response.safety_findings.extend(findings)
        if findings and request.reject_unsafe:
            response.reasons.append(f"unsafe: {'; '.join(findings[:5])}")
        for tool in spec.tools:
            response.tools.append(
                cm.ToolSpec(
                    name=tool.name,
                    signature=tool.signature,
                    text=tool_text(tool),
                    json_schema=json.dumps(tool_schema(tool), ensure_ascii=False),
                )
            )
        if not spec.violations and not request.skip_main:
            sources = Sources()
            timeout = request.main_timeout_ms or MAIN_TIMEOUT_MS
            op = sb.Operation(source=sources.ref(source), limits=limits(timeout), run_script=sb.RunScriptOp())
            (result,) = await self._run([op], sources)
            response.main_usage.CopyFrom(result.usage)
            response.main_exit_code = result.exit_code
            response.main_output = tail(result.stderr) or tail(result.stdout)
            if result.status == sb.STATUS_TIMEOUT:
                response.reasons.append(f"main_timeout: __main__ did not finish within {timeout} ms")
            elif result.status == sb.STATUS_ENV_ERROR and result.exit_code:
                response.reasons.append(
                    f"main_failed: __main__ exited with {result.exit_code}: {last_line(result.stderr)}"
                )
            elif result.status != sb.STATUS_OK:
                response.reasons.append(failure(result, "main"))
        response.verdict = vf.VERDICT_FAIL if response.reasons else vf.VERDICT_PASS
        return response

    # ---- unit tests -----------------------------------------------------------------------------

    async def validate_unit_tests(self, request: vf.ValidateUnitTestsRequest) -> vf.ValidateUnitTestsResponse:
        t = request.thresholds
        ref_time = t.ref_time_ms or REF_TIME_MS
        ref_memory = t.ref_memory_mb or REF_MEMORY_MB
        max_chars = t.max_answer_chars or MAX_ANSWER_CHARS
        min_valid = t.min_valid or MIN_VALID
        min_ratio = t.min_valid_ratio or MIN_VALID_RATIO

        tests = [vf.ValidatedTest(task=task, cross_check=vf.CROSS_CHECK_NOT_RUN) for task in request.tasks]
        configs = distinct_configs(tests)
        call = None
        if request.solution_source.strip() and configs:
            keys = list(next(iter(configs.values())))
            call = find_solution_call(
                request.solution_source, keys, request.entry_point, list(request.arg_names)
            )
        sources = Sources()
        ops, plan = unit_test_plan(request, tests, configs, call, sources, ref_time, ref_memory)
        results = await self._run(ops, sources)
        ref: dict[int, sb.OperationResult] = {}
        solution: dict[int, sb.OperationResult] = {}
        for (i, kind), result in zip(plan, results, strict=True):
            (ref if kind == "ref" else solution)[i] = result

        compared = disagreed = 0
        for i, result in ref.items():
            judge_test(tests[i], result, solution.get(i), call, ref_memory, max_chars)
            compared += tests[i].cross_check in (vf.CROSS_CHECK_AGREES, vf.CROSS_CHECK_DISAGREES)
            disagreed += tests[i].cross_check == vf.CROSS_CHECK_DISAGREES

        valid = sum(t.valid for t in tests)
        distinct = len(configs)
        response = vf.ValidateUnitTestsResponse(
            tests=tests,
            valid=valid,
            distinct=distinct,
            solution_function=call.function if call else "",
            cross_checked=compared,
            disagreement_rate=disagreed / compared if compared else 0.0,
        )
        if valid < min_valid:
            response.reasons.append(f"too_few_valid_tests: {valid} valid (need {min_valid})")
        if distinct and valid / distinct < min_ratio:
            response.reasons.append(
                f"low_valid_ratio: {valid}/{distinct} distinct tests valid (need {min_ratio:.0%})"
            )
        response.verdict = vf.VERDICT_FAIL if response.reasons else vf.VERDICT_PASS
        return response

    # ---- solvability ----------------------------------------------------------------------------

    async def check_solvability(self, request: vf.CheckSolvabilityRequest) -> vf.CheckSolvabilityResponse:
        search = OracleSearch(request, self._run)
        response, reports = search.response, search.reports
        live = []
        for i, source in enumerate(request.solve_sources):
            if source.strip():
                live.append(i)
            else:
                reports[i].outcome = vf.CANDIDATE_OUTCOME_EMPTY
        if not search.tasks or not live:
            response.reasons.append(
                "no_tests: no valid test to solve"
                if not search.tasks
                else "no_candidates: no solve() candidate"
            )
            response.candidates.extend(reports)
            response.verdict = vf.VERDICT_FAIL
            return response
        smoke = list(range(min(request.limits.smoke_tests or SMOKE_TESTS, len(search.tasks))))
        survivors = await search.smoke(live, smoke)
        out_of_budget = await search.find_oracle(survivors, list(range(len(smoke), len(search.tasks))))
        response.candidates.extend(reports)
        if response.oracle_index < 0:
            response.reasons.append(search.why_no_oracle(live, out_of_budget))
        response.verdict = vf.VERDICT_PASS if response.oracle_index >= 0 else vf.VERDICT_FAIL
        return response


def distinct_configs(tests: Sequence[vf.ValidatedTest]) -> dict[int, dict[str, Any]]:
    """The config of each test worth running, by index: a test whose config does not parse, or
    repeats an earlier one's, gets its reason instead."""
    configs: dict[int, dict[str, Any]] = {}
    seen: dict[str, int] = {}
    for i, test in enumerate(tests):
        config, key = config_key(test.task.config_json)
        if config is None:
            test.reason = key
        elif key in seen:
            test.reason = f"duplicate: same config as test {seen[key] + 1}"
        else:
            seen[key] = i
            configs[i] = config
    return configs


def unit_test_plan(
    request: vf.ValidateUnitTestsRequest,
    tests: Sequence[vf.ValidatedTest],
    configs: dict[int, dict[str, Any]],
    call: SolutionCall | None,
    sources: Sources,
    ref_time: int,
    ref_memory: int,
) -> tuple[list[sb.Operation], list[tuple[int, str]]]:
    """The sandbox operations of a validation, and what each is ((test, "ref" | "solution")): the
    reference answer of every distinct test, and the original solution's where it can be called."""
    env_ref = sources.ref(request.env_source)
    ops: list[sb.Operation] = []
    plan: list[tuple[int, str]] = []
    for i, config in configs.items():
        ops.append(
            sb.Operation(
                source=env_ref,
                limits=limits(ref_time, ref_memory),
                ref_answer=sb.RefAnswerOp(config_json=tests[i].task.config_json),
            )
        )
        plan.append((i, "ref"))
        args = call.args_for(config) if call is not None else None
        if call is not None and args is not None:
            ops.append(
                sb.Operation(
                    source=sources.ref(request.solution_source),
                    limits=limits(max(ref_time, MAIN_TIMEOUT_MS), max(ref_memory, CASE_MEMORY_MB)),
                    call_function=sb.CallFunctionOp(function_name=call.function, args_json=json.dumps(args)),
                )
            )
            plan.append((i, "solution"))
    return ops, plan


def judge_test(
    test: vf.ValidatedTest,
    result: sb.OperationResult,
    other: sb.OperationResult | None,
    call: SolutionCall | None,
    ref_memory: int,
    max_chars: int,
) -> None:
    """One test's verdict from its reference answer (`result`) and the solution's (`other`, when
    run): valid, or the reason it is not; its cross check says whether the two were compared."""
    test.usage.CopyFrom(result.usage)
    test.answer_json = result.answer_json
    test.answer_repr = result.answer_repr
    if result.status != sb.STATUS_OK:
        test.reason = failure(result, "ref")
        return
    if result.usage.peak_alloc_bytes > ref_memory * 1024 * 1024:
        test.reason = (
            f"ref_memory_limit: get_ref_answer() allocated {result.usage.peak_alloc_bytes >> 20} MiB"
            f" (limit {ref_memory} MiB)"
        )
        return
    if len(result.answer_repr) > max_chars:
        test.reason = (
            f"answer_too_long: the answer renders in {len(result.answer_repr)} characters (limit {max_chars})"
        )
        return
    if other is not None:
        if other.status != sb.STATUS_OK:
            test.cross_check = vf.CROSS_CHECK_SOLUTION_FAILED
            test.reason = failure(other, "solution")
            return
        test.solution_answer_repr = other.answer_repr
        if not same_answer(result, other):
            test.cross_check = vf.CROSS_CHECK_DISAGREES
            test.reason = (
                f"disagrees_with_solution: get_ref_answer() = {result.answer_repr[:60]},"
                f" {call.function if call else 'solution'}() = {other.answer_repr[:60]}"
            )
            return
        test.cross_check = vf.CROSS_CHECK_AGREES
    test.valid = True


class OracleSearch:
    """One CheckSolvability: the solve() candidates run against the tests until one solves them
    all (the oracle). Holds what the stages share: the limits, each candidate's report, the steps
    each solved test took, and the response's counters."""

    def __init__(self, request: vf.CheckSolvabilityRequest, run: RunOps) -> None:
        lim = request.limits
        self.request = request
        self.run_ops = run
        self.case_time = lim.case_time_ms or CASE_TIME_MS
        self.memory = lim.case_memory_mb or CASE_MEMORY_MB
        self.max_steps = lim.max_steps or MAX_STEPS
        self.budget_ms = lim.budget_ms or BUDGET_MS
        self.deadline = time.monotonic() + self.budget_ms / 1000
        self.tasks = list(request.tasks)
        self.sources = Sources()
        self.env_ref = self.sources.ref(request.env_source)
        self.reports = [
            vf.CandidateReport(index=i, outcome=vf.CANDIDATE_OUTCOME_NOT_RUN)
            for i in range(len(request.solve_sources))
        ]
        self.response = vf.CheckSolvabilityResponse(oracle_index=-1)
        self.steps: dict[int, dict[int, int]] = {}  # candidate -> test -> steps it took to solve it

    def op(self, candidate: int, test: int) -> sb.Operation:
        return sb.Operation(
            source=self.env_ref,
            limits=limits(self.case_time, self.memory),
            solve=sb.SolveOp(
                config_json=self.tasks[test].config_json,
                solve_source=self.request.solve_sources[candidate],
                max_steps=self.max_steps,
            ),
        )

    async def run(self, cases: list[tuple[int, int]]) -> list[tuple[int, int, bool]]:
        """Run (candidate, test) cases at once; each one's report is updated, and whether it solved."""
        results = await self.run_ops([self.op(c, t) for c, t in cases], self.sources)
        self.response.cases_run += len(results)
        self.response.cpu_ms += sum(r.usage.cpu_ms for r in results)
        return [(c, t, self.record(c, t, r)) for (c, t), r in zip(cases, results, strict=True)]

    def record(self, candidate: int, test: int, result: sb.OperationResult) -> bool:
        report = self.reports[candidate]
        report.run += 1
        problem = case_failure(result, self.max_steps)
        if problem:
            report.first_failure = report.first_failure or problem
            return False
        report.solved += 1
        self.steps.setdefault(candidate, {})[test] = result.step_count
        return True

    async def smoke(self, live: list[int], smoke: list[int]) -> list[int]:
        """Every candidate on the first test(s), all at once: the candidates that solved them."""
        passed = dict.fromkeys(live, True)
        for c, _, solved in await self.run([(c, t) for c in live for t in smoke]):
            passed[c] = passed[c] and solved
        for c in live:
            if not passed[c]:
                self.reports[c].outcome = vf.CANDIDATE_OUTCOME_FAILED_SMOKE
        return [c for c in live if passed[c]]

    async def find_oracle(self, survivors: list[int], rest: list[int]) -> bool:
        """One candidate at a time over the remaining tests, a wave at a time: the first candidate
        that solves everything is the oracle, and a failure ends a candidate's run. True when the
        budget ran out first."""
        for c in survivors:
            ok = True
            for start in range(0, len(rest), WAVE):
                if time.monotonic() > self.deadline:
                    return True
                results = await self.run([(c, t) for t in rest[start : start + WAVE]])
                if not all(solved for _, _, solved in results):
                    ok = False
                    break
            if not ok:
                self.reports[c].outcome = vf.CANDIDATE_OUTCOME_FAILED
                continue
            self.reports[c].outcome = vf.CANDIDATE_OUTCOME_ORACLE
            self.response.oracle_index = c
            for t, task in enumerate(self.tasks):
                done = cm.TaskConfig()
                done.CopyFrom(task)
                done.solve_fc_round = self.steps[c][t]
                self.response.tasks.append(done)
            return False
        return False

    def why_no_oracle(self, live: list[int], out_of_budget: bool) -> str:
        if out_of_budget:
            return f"budget_exhausted: no oracle within {self.budget_ms} ms ({self.response.cases_run} runs)"
        best = max(live, key=lambda i: (self.reports[i].solved, -i))
        return (
            f"unsolvable: no candidate solved every test of {len(self.tasks)}"
            f" (best: candidate {best} solved {self.reports[best].solved},"
            f" first failure {self.reports[best].first_failure or '-'})"
        )


def same_answer(ref: sb.OperationResult, other: sb.OperationResult) -> bool:
    """Reference answer and the original solution's, compared as JSON values (repr as a fallback)."""
    ok_a, a = json_value(ref.answer_json)
    ok_b, b = json_value(other.answer_json)
    if ok_a and ok_b:
        return answers_equal(a, b)
    return ref.answer_repr == other.answer_repr


def case_failure(result: sb.OperationResult, max_steps: int) -> str:
    """Why one (candidate, test) run did not reach reward 1; "" when it did."""
    if result.status != sb.STATUS_OK:
        return failure(result, "solve")
    if abs(result.reward - 1.0) <= 1e-9:
        return ""
    if "exceeded" in result.message and not result.done:
        return f"step_cap: more than {max_steps} steps"
    if not result.done:
        return f"not_done: solve() returned after {result.step_count} steps without calling Done"
    return f"wrong_answer: reward {result.reward:g} after {result.step_count} steps"

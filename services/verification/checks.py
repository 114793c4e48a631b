"""The verification checks, each a plan of sandbox operations and a reading of their results.

Nothing generated runs here: environment sources, reference answers, original solutions and
solve() candidates run in sandbox workers through `ExecuteBatch`; this process reads sources
only with `ast` and compares answers as JSON. Every failure comes back as a reason
`class: detail`, where `class` is a short token a pipeline can count.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from codegym.common.v1 import common_pb2 as cm
from codegym.contract import (
    analyze_source,
    answers_equal,
    canonical_json,
    scan_source,
    sha256_text,
    tool_schema,
    tool_text,
)
from codegym.contract.source import method_source
from codegym.sandbox.v1 import sandbox_service_pb2 as sb
from codegym.verification.v1 import verification_service_pb2 as vf
from services.dispatcher import SandboxDispatcher
from services.verification.solution import find_solution_call

# The defaults of every threshold (DESIGN §7); a zero request field means these.
MAIN_TIMEOUT_MS = 5_000
REF_TIME_MS = 3_000
REF_MEMORY_MB = 100
MAX_ANSWER_CHARS = 100
MIN_VALID = 10
MIN_VALID_RATIO = 0.8
CASE_TIME_MS = 10_000
CASE_MEMORY_MB = 256
MAX_STEPS = 1_024
BUDGET_MS = 300_000
SMOKE_TESTS = 1
SHORTCUT_FRACTION = 0.5
PROBE_TIME_MS = 5_000
DETERMINISM_TESTS = 5
MAX_PAID_REPORTED = 20
NEGATIVE_MARK = "NEGCTL:"
# Module-level code of the second determinism run's solve_source: it runs in the fork before the
# environment is built, so every later allocation lands elsewhere than in the first run (as in
# another worker), and `random` is seeded differently.
HEAP_SHIFT = "_codegym_heap_shift = [object() for _ in range(4099)] + [bytearray(97) for _ in range(211)]\n"
# Tests one candidate runs per round in the solvability check: enough to keep two workers busy,
# few enough that a candidate failing early wastes little.
WAVE = 16
OUTPUT_TAIL = 600


def status_name(status: int) -> str:
    return sb.Status.Name(status).removeprefix("STATUS_").lower()  # type: ignore[arg-type]


def tail(text: str, limit: int = OUTPUT_TAIL) -> str:
    text = text.strip()
    return text if len(text) <= limit else "…" + text[-limit:]


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip()[:200] if lines else ""


def failure(result: sb.OperationResult, prefix: str) -> str:
    """A reason for an operation that did not complete: `{prefix}_{status}: detail`."""
    detail = result.message or last_line(result.stderr) or status_name(result.status)
    return f"{prefix}_{status_name(result.status)}: {detail[:300]}"


class Sources:
    """Sources by sha256: operations reference them, the dispatcher sends code only when asked."""

    def __init__(self) -> None:
        self.by_sha: dict[str, str] = {}

    def ref(self, code: str) -> sb.SourceRef:
        sha = sha256_text(code)
        self.by_sha[sha] = code
        return sb.SourceRef(sha256=sha)


def limits(time_ms: int, memory_mb: int = 0) -> sb.Limits:
    return sb.Limits(wall_ms=time_ms, cpu_ms=time_ms, memory_mb=memory_mb)


def config_key(config_json: str) -> tuple[dict[str, Any] | None, str]:
    """(config, canonical text) or (None, reason) for a config that is not a JSON object."""
    try:
        config = json.loads(config_json)
    except ValueError as exc:
        return None, f"bad_config: not JSON: {exc}"
    if not isinstance(config, dict):
        return None, f"bad_config: a config is a JSON object, not {type(config).__name__}"
    return config, json.dumps(config, sort_keys=True, separators=(",", ":"))


def json_value(text: str) -> tuple[bool, Any]:
    if not text:
        return False, None
    try:
        return True, json.loads(text)
    except ValueError:
        return False, None


class Verifier:
    """The checks, over one sandbox dispatcher (a channel to every worker)."""

    def __init__(self, sandbox: SandboxDispatcher) -> None:
        self.sandbox = sandbox

    async def _run(self, ops: Sequence[sb.Operation], sources: Sources) -> list[sb.OperationResult]:
        if not ops:
            return []
        return await self.sandbox.execute_batch(ops, sources.by_sha)

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

        sources = Sources()
        env_ref = sources.ref(request.env_source)
        tests = [vf.ValidatedTest(task=task, cross_check=vf.CROSS_CHECK_NOT_RUN) for task in request.tasks]
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
        call = None
        if request.solution_source.strip() and configs:
            keys = list(next(iter(configs.values())))
            call = find_solution_call(
                request.solution_source, keys, request.entry_point, list(request.arg_names)
            )
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
                        call_function=sb.CallFunctionOp(
                            function_name=call.function, args_json=json.dumps(args)
                        ),
                    )
                )
                plan.append((i, "solution"))
        results = await self._run(ops, sources)
        ref: dict[int, sb.OperationResult] = {}
        solution: dict[int, sb.OperationResult] = {}
        for (i, kind), result in zip(plan, results, strict=True):
            (ref if kind == "ref" else solution)[i] = result

        compared = disagreed = 0
        for i, result in ref.items():
            test = tests[i]
            test.usage.CopyFrom(result.usage)
            test.answer_json = result.answer_json
            test.answer_repr = result.answer_repr
            if result.status != sb.STATUS_OK:
                test.reason = failure(result, "ref")
                continue
            if result.usage.peak_alloc_bytes > ref_memory * 1024 * 1024:
                test.reason = (
                    f"ref_memory_limit: get_ref_answer() allocated {result.usage.peak_alloc_bytes >> 20} MiB"
                    f" (limit {ref_memory} MiB)"
                )
                continue
            if len(result.answer_repr) > max_chars:
                test.reason = (
                    f"answer_too_long: the answer renders in {len(result.answer_repr)} characters"
                    f" (limit {max_chars})"
                )
                continue
            other = solution.get(i)
            if other is not None:
                if other.status != sb.STATUS_OK:
                    test.cross_check = vf.CROSS_CHECK_SOLUTION_FAILED
                    test.reason = failure(other, "solution")
                    continue
                test.solution_answer_repr = other.answer_repr
                compared += 1
                if not same_answer(result, other):
                    disagreed += 1
                    test.cross_check = vf.CROSS_CHECK_DISAGREES
                    test.reason = (
                        f"disagrees_with_solution: get_ref_answer() = {result.answer_repr[:60]},"
                        f" {call.function if call else 'solution'}() = {other.answer_repr[:60]}"
                    )
                    continue
                test.cross_check = vf.CROSS_CHECK_AGREES
            test.valid = True

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
        lim = request.limits
        case_time = lim.case_time_ms or CASE_TIME_MS
        memory = lim.case_memory_mb or CASE_MEMORY_MB
        max_steps = lim.max_steps or MAX_STEPS
        deadline = time.monotonic() + (lim.budget_ms or BUDGET_MS) / 1000
        tasks = list(request.tasks)
        sources = Sources()
        env_ref = sources.ref(request.env_source)
        reports = [
            vf.CandidateReport(index=i, outcome=vf.CANDIDATE_OUTCOME_NOT_RUN)
            for i in range(len(request.solve_sources))
        ]
        response = vf.CheckSolvabilityResponse(oracle_index=-1)

        def op(candidate: int, test: int) -> sb.Operation:
            return sb.Operation(
                source=env_ref,
                limits=limits(case_time, memory),
                solve=sb.SolveOp(
                    config_json=tasks[test].config_json,
                    solve_source=request.solve_sources[candidate],
                    max_steps=max_steps,
                ),
            )

        async def run(cases: list[tuple[int, int]]) -> list[tuple[int, int, sb.OperationResult]]:
            results = await self._run([op(c, t) for c, t in cases], sources)
            response.cases_run += len(results)
            response.cpu_ms += sum(r.usage.cpu_ms for r in results)
            return [(c, t, r) for (c, t), r in zip(cases, results, strict=True)]

        def record(candidate: int, result: sb.OperationResult) -> bool:
            report = reports[candidate]
            report.run += 1
            problem = case_failure(result, max_steps)
            if problem:
                report.first_failure = report.first_failure or problem
                return False
            report.solved += 1
            return True

        live = []
        for i, source in enumerate(request.solve_sources):
            if source.strip():
                live.append(i)
            else:
                reports[i].outcome = vf.CANDIDATE_OUTCOME_EMPTY
        if not tasks or not live:
            response.reasons.append(
                "no_tests: no valid test to solve" if not tasks else "no_candidates: no solve() candidate"
            )
            response.candidates.extend(reports)
            response.verdict = vf.VERDICT_FAIL
            return response

        # Smoke run: every candidate on the first test(s), all at once; failures are dropped.
        smoke = list(range(min(lim.smoke_tests or SMOKE_TESTS, len(tasks))))
        steps: dict[int, dict[int, int]] = {i: {} for i in live}
        passed: dict[int, bool] = dict.fromkeys(live, True)
        for c, t, result in await run([(c, t) for c in live for t in smoke]):
            if record(c, result):
                steps[c][t] = result.step_count
            else:
                passed[c] = False
        for c in live:
            if not passed[c]:
                reports[c].outcome = vf.CANDIDATE_OUTCOME_FAILED_SMOKE
        survivors = [c for c in live if passed[c]]

        # Then one candidate at a time over the remaining tests, a wave at a time: the first
        # candidate that solves everything is the oracle, and a failure ends a candidate's run.
        rest = list(range(len(smoke), len(tasks)))
        out_of_budget = False
        for c in survivors:
            ok = True
            for start in range(0, len(rest), WAVE):
                if time.monotonic() > deadline:
                    out_of_budget = True
                    break
                for _, t, result in await run([(c, t) for t in rest[start : start + WAVE]]):
                    if record(c, result):
                        steps[c][t] = result.step_count
                    else:
                        ok = False
                if not ok:
                    break
            if out_of_budget:
                break
            if not ok:
                reports[c].outcome = vf.CANDIDATE_OUTCOME_FAILED
                continue
            reports[c].outcome = vf.CANDIDATE_OUTCOME_ORACLE
            response.oracle_index = c
            for t, task in enumerate(tasks):
                done = cm.TaskConfig()
                done.CopyFrom(task)
                done.solve_fc_round = steps[c][t]
                response.tasks.append(done)
            break
        response.candidates.extend(reports)
        if response.oracle_index < 0:
            if out_of_budget:
                response.reasons.append(
                    f"budget_exhausted: no oracle within {lim.budget_ms or BUDGET_MS} ms"
                    f" ({response.cases_run} runs)"
                )
            else:
                best = max(live, key=lambda i: (reports[i].solved, -i))
                response.reasons.append(
                    f"unsolvable: no candidate solved every test of {len(tasks)}"
                    f" (best: candidate {best} solved {reports[best].solved},"
                    f" first failure {reports[best].first_failure or '-'})"
                )
        response.verdict = vf.VERDICT_PASS if response.oracle_index >= 0 else vf.VERDICT_FAIL
        return response

    # ---- shortcuts ------------------------------------------------------------------------------

    async def check_shortcuts(self, request: vf.CheckShortcutsRequest) -> vf.CheckShortcutsResponse:
        spec = analyze_source(request.env_source)
        response = vf.CheckShortcutsResponse()
        if spec.violations:
            response.reasons.append("contract: the source breaks the contract; check it first")
            response.verdict = vf.VERDICT_FAIL
            return response
        max_fraction = request.max_fraction or SHORTCUT_FRACTION
        probe_time = request.probe_time_ms or PROBE_TIME_MS
        tools = [
            tool.name
            for tool in spec.tools
            if tool.name != "Done" and all(p.arg in tool.defaults for p in tool.params)
        ]
        cases = [(c.config_json, json_value(c.answer_json)) for c in request.cases]
        cases = [(config, answer) for config, (ok, answer) in cases if ok]
        sources = Sources()
        env_ref = sources.ref(request.env_source)
        ops = [
            sb.Operation(
                source=env_ref,
                limits=limits(probe_time),
                solve=sb.SolveOp(config_json=config, solve_source=probe_source(tool), max_steps=2),
            )
            for tool in tools
            for config, _ in cases
        ]
        results = await self._run(ops, sources)
        for n, tool in enumerate(tools):
            probe = vf.ShortcutProbe(tool=tool)
            for k, (_, answer) in enumerate(cases):
                result = results[n * len(cases) + k]
                if result.status != sb.STATUS_OK:
                    continue
                probe.probed += 1
                if answers_equal(result.observation, answer, lenient=True):
                    probe.hits += 1
            response.probes.append(probe)
            if probe.probed and probe.hits / probe.probed > max_fraction:
                response.shortcut_tools.append(tool)
                response.reasons.append(
                    f"shortcut: {tool}() returns the reference answer on {probe.hits}/{probe.probed} tests"
                )
        response.verdict = vf.VERDICT_FAIL if response.shortcut_tools else vf.VERDICT_PASS
        return response

    # ---- negative controls ----------------------------------------------------------------------

    async def check_negative_controls(
        self, request: vf.CheckNegativeControlsRequest
    ) -> vf.CheckNegativeControlsResponse:
        spec = analyze_source(request.env_source)
        response = vf.CheckNegativeControlsResponse()
        done = next((t for t in spec.tools if t.name == "Done"), None)
        if spec.violations or done is None or not done.params:
            response.reasons.append("contract: no Done(answer) tool to call; check the environment first")
            response.verdict = vf.VERDICT_FAIL
            return response
        param = done.params[0].arg
        case_time = request.case_time_ms or CASE_TIME_MS
        memory = request.case_memory_mb or CASE_MEMORY_MB
        cases = [(c.config_json, json_value(c.answer_json)) for c in request.cases]
        answered = [(config, answer) for config, (ok, answer) in cases if ok]
        plans: list[tuple[str, Any, list[tuple[str, Any]]]] = []
        for k, (config, answer) in enumerate(answered):
            others = [a for j, (_, a) in enumerate(answered) if j != k]
            controls = wrong_answers(answer, others)
            plans.append((config, answer, controls))
            for kind, _ in controls:
                response.kinds[kind] = response.kinds.get(kind, 0) + 1
            response.controls += len(controls)
        response.tests = len(plans)
        sources = Sources()
        env_ref = sources.ref(request.env_source)

        def action(value: Any) -> str:
            return json.dumps({"name": "Done", "parameters": {param: value}})

        ops = [
            sb.Operation(
                source=env_ref,
                limits=limits(case_time, memory),
                solve=sb.SolveOp(
                    config_json=config,
                    solve_source=controls_source([action(v) for _, v in controls]),
                    max_steps=2,
                ),
            )
            for config, _, controls in plans
        ]
        results = await self._run(ops, sources)
        response.runs += len(results)
        response.cpu_ms += sum(r.usage.cpu_ms for r in results)
        outcomes: dict[int, list[tuple[float, str]]] = {}
        retry: list[int] = []
        for k, result in enumerate(results):
            parsed = read_controls(result, len(plans[k][2]))
            if parsed is None:
                retry.append(k)
            else:
                outcomes[k] = parsed
        # Where the one-run form failed (an environment deepcopy cannot copy), one run per control.
        singles = [(k, n) for k in retry for n in range(len(plans[k][2]))]
        single_ops = [
            sb.Operation(
                source=env_ref,
                limits=limits(case_time, memory),
                solve=sb.SolveOp(
                    config_json=plans[k][0],
                    solve_source=single_control_source(action(plans[k][2][n][1])),
                    max_steps=2,
                ),
            )
            for k, n in singles
        ]
        single_results = await self._run(single_ops, sources)
        response.runs += len(single_results)
        response.cpu_ms += sum(r.usage.cpu_ms for r in single_results)
        for (k, n), result in zip(singles, single_results, strict=True):
            if result.status != sb.STATUS_OK:
                response.failed_runs += 1
                response.first_failure = response.first_failure or failure(result, "control")
                outcomes.setdefault(k, [(0.0, "")] * len(plans[k][2]))
                continue
            outcomes.setdefault(k, [(0.0, "")] * len(plans[k][2]))[n] = (result.reward, result.observation)
        paid = 0
        for k, (config, answer, controls) in enumerate(plans):
            for (kind, value), (reward, message) in zip(controls, outcomes.get(k, []), strict=False):
                if reward <= 1e-9:
                    continue
                paid += 1
                if len(response.paid) < MAX_PAID_REPORTED:
                    response.paid.append(
                        vf.PaidAnswer(
                            config_json=config,
                            kind=kind,
                            answer_json=json.dumps(value),
                            reference_json=json.dumps(answer),
                            reward=reward,
                            observation=message[:300],
                        )
                    )
        if paid:
            first = response.paid[0]
            kinds = sorted({p.kind for p in response.paid})
            response.reasons.append(
                f"reward_accepts_wrong_answers: {paid} of {response.controls} wrong answers paid"
                f" ({', '.join(kinds)}); e.g. Done({param}={first.answer_json}) for reference"
                f" {first.reference_json[:60]} got reward {first.reward:g}"
            )
        response.verdict = vf.VERDICT_FAIL if response.reasons else vf.VERDICT_PASS
        return response

    # ---- determinism ----------------------------------------------------------------------------

    async def check_determinism(self, request: vf.CheckDeterminismRequest) -> vf.CheckDeterminismResponse:
        response = vf.CheckDeterminismResponse()
        solve = request.solve_source
        if not solve.strip():
            try:
                solve = method_source(request.env_source, "solve")
            except (SyntaxError, ValueError) as exc:
                response.reasons.append(f"contract: no solve() to replay: {exc}")
                response.verdict = vf.VERDICT_FAIL
                return response
        case_time = request.case_time_ms or CASE_TIME_MS
        memory = request.case_memory_mb or CASE_MEMORY_MB
        max_steps = request.max_steps or MAX_STEPS
        configs = list(request.config_jsons)[: request.tests or DETERMINISM_TESTS]
        sources = Sources()
        env_ref = sources.ref(request.env_source)
        ops = [
            sb.Operation(
                source=env_ref,
                limits=limits(case_time, memory),
                seed=run,
                solve=sb.SolveOp(
                    config_json=config,
                    solve_source=(HEAP_SHIFT + solve) if run else solve,
                    max_steps=max_steps,
                    record=True,
                ),
            )
            for config in configs
            for run in (0, 1)
        ]
        results = await self._run(ops, sources)
        response.runs = len(results)
        response.cpu_ms = sum(r.usage.cpu_ms for r in results)
        for k, config in enumerate(configs):
            difference = first_difference(results[2 * k], results[2 * k + 1])
            response.compared += 1
            if difference is not None:
                difference.config_json = config
                response.differences.append(difference)
        if response.differences:
            d = response.differences[0]
            response.reasons.append(
                f"nondeterministic: {len(response.differences)} of {response.compared} tests differ between"
                f" two runs of the oracle; first at step {d.step} ({d.what}) of {d.config_json[:80]}:"
                f" {d.first[:80]!r} vs {d.second[:80]!r}"
            )
        response.verdict = vf.VERDICT_FAIL if response.reasons else vf.VERDICT_PASS
        return response

    # ---- guessability ---------------------------------------------------------------------------

    async def measure_guessability(
        self, request: vf.MeasureGuessabilityRequest
    ) -> vf.MeasureGuessabilityResponse:
        rates, top = guess_rates([c.answer_json for c in request.cases])
        response = vf.MeasureGuessabilityResponse(
            guess_rates=rates, guess_rate=max(rates, default=0.0), most_frequent_json=top
        )
        limit = request.max_guess_rate
        if limit and response.guess_rate > limit:
            response.reasons.append(
                f"guessable: a blind Done({top[:40]}) is right with chance {response.guess_rate:.2f}"
                f" (limit {limit:.2f})"
            )
        response.verdict = vf.VERDICT_FAIL if response.reasons else vf.VERDICT_PASS
        return response


def guess_rates(answer_jsons: Sequence[str]) -> tuple[list[float], str]:
    """Per answer: 0.5 for a boolean, else the fraction of answers equal to it; and the most frequent."""
    keys = []
    for text in answer_jsons:
        ok, value = json_value(text)
        keys.append(canonical_json(value) if ok else text)
    counts: dict[str, int] = {}
    for key in keys:
        counts[key] = counts.get(key, 0) + 1
    top = max(counts, key=lambda key: counts[key], default="")
    rates = [0.5 if key in ("true", "false") else counts[key] / len(keys) for key in keys]
    return rates, top


def mutations(value: Any) -> list[tuple[str, Any]]:
    """Wrong answers of the same shape as `value`, by type (each differs from it)."""
    if isinstance(value, bool):
        return [("other_boolean", not value), ("as_string", str(value))]
    if isinstance(value, int | float):
        out: list[tuple[str, Any]] = [
            ("plus_one", value + 1),
            ("minus_one", value - 1),
            ("as_string", str(value)),
        ]
        if value != 0:
            out.append(("empty", 0))
        return out
    if isinstance(value, str):
        altered = value[:-1] + chr(ord(value[-1]) + 1 if value[-1] != "z" else ord("a")) if value else "x"
        out = [("altered_string", altered), ("extended_string", value + "x")]
        if value:
            out.append(("empty", ""))
        return out
    if isinstance(value, list):
        out = []
        if value:
            inner = mutations(value[0])
            if inner:
                out.append(("element_changed", [inner[0][1], *value[1:]]))
            out.append(("reversed", list(reversed(value))))
            out.append(("empty", []))
            out.append(("element_dropped", value[:-1]))
        else:
            out.append(("extended", [0]))
        return out
    if isinstance(value, dict):
        out = []
        if value:
            key = next(iter(value))
            inner = mutations(value[key])
            if inner:
                out.append(("element_changed", {**value, key: inner[0][1]}))
            out.append(("empty", {}))
        return out
    if value is None:
        return [("zero", 0), ("empty", "")]
    return []


def wrong_answers(answer: Any, others: Sequence[Any]) -> list[tuple[str, Any]]:
    """The negative controls of one test: mutations, None, another config's reference answer."""
    candidates = [*mutations(answer), ("none", None)]
    for other in others:
        if not answers_equal(other, answer):
            candidates.append(("other_config", other))
            break
    seen: set[str] = set()
    out = []
    for kind, value in candidates:
        key = json.dumps(value, sort_keys=True)
        if key in seen or answers_equal(value, answer) or value == answer:
            continue
        seen.add(key)
        out.append((kind, value))
    return out


def controls_source(actions: Sequence[str]) -> str:
    """A solve() that plays each action on its own deep copy of the fresh environment, reporting
    (reward, message) per action as JSON. The class's own step() is called: the instance's is the
    sandbox's step counter, bound to the original."""
    return (
        "def solve(self):\n"
        "    import copy as _copy, json as _json\n"
        f"    _actions = {list(actions)!r}\n"
        "    _step = type(self).step\n"
        "    _base = _copy.deepcopy(self)\n"
        "    _out = []\n"
        "    for _a in _actions:\n"
        "        _env = _copy.deepcopy(_base)\n"
        "        _env.__dict__.pop('step', None)\n"
        "        try:\n"
        "            _r = _step(_env, _a)\n"
        "            _msg = _r[1] if isinstance(_r, tuple) and len(_r) == 2 else _r\n"
        "        except Exception as _e:\n"
        "            _msg = 'Error: %s: %s' % (type(_e).__name__, _e)\n"
        "        try:\n"
        "            _reward = float(getattr(_env, 'reward', 0.0) or 0.0)\n"
        "        except Exception:\n"
        "            _reward = 0.0\n"
        "        _out.append([_reward, str(_msg)[:300]])\n"
        f"    return {NEGATIVE_MARK!r} + _json.dumps(_out)\n"
    )


def single_control_source(action: str) -> str:
    return (
        "def solve(self):\n"
        f"    _r = self.step({action!r})\n"
        "    return _r[1] if isinstance(_r, tuple) and len(_r) == 2 else _r\n"
    )


def read_controls(result: sb.OperationResult, expected: int) -> list[tuple[float, str]] | None:
    """(reward, message) per control from one controls run; None when the run did not report."""
    if result.status != sb.STATUS_OK or not result.observation.startswith(NEGATIVE_MARK):
        return None
    try:
        rows = json.loads(result.observation[len(NEGATIVE_MARK) :])
    except ValueError:
        return None
    if not isinstance(rows, list) or len(rows) != expected:
        return None
    try:
        return [(float(r), str(m)) for r, m in rows]
    except (TypeError, ValueError):
        return None


def first_difference(a: sb.OperationResult, b: sb.OperationResult) -> vf.TrajectoryDifference | None:
    """Where two recorded runs of the same solve() on the same config first differ; None if nowhere."""
    if a.status != b.status:
        return vf.TrajectoryDifference(
            what="status", first=status_name(a.status), second=status_name(b.status)
        )
    if a.status != sb.STATUS_OK:
        return None  # both failed the same way: solvability's business, not determinism's
    for i, (x, y) in enumerate(zip(a.trajectory, b.trajectory, strict=False)):
        if x != y:
            what = "observation" if i % 2 == 0 else "action"
            return vf.TrajectoryDifference(step=(i + 1) // 2, what=what, first=x[:300], second=y[:300])
    if len(a.trajectory) != len(b.trajectory):
        return vf.TrajectoryDifference(
            step=min(len(a.trajectory), len(b.trajectory)) // 2,
            what="length",
            first=str(len(a.trajectory) // 2),
            second=str(len(b.trajectory) // 2),
        )
    if abs(a.reward - b.reward) > 1e-9 or a.done != b.done:
        return vf.TrajectoryDifference(
            step=a.step_count, what="reward", first=f"{a.reward:g}", second=f"{b.reward:g}"
        )
    return None


def probe_source(tool: str) -> str:
    """A solve() that calls one tool first thing and returns what it said."""
    return (
        "def solve(self):\n"
        "    import json as _json\n"
        f"    out = self.step(_json.dumps({{'name': {tool!r}, 'parameters': {{}}}}))\n"
        "    return out[1] if isinstance(out, tuple) and len(out) == 2 else out\n"
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

"""Negative controls: `Done` with wrong answers must give reward 0 on every valid test.

Wrong answers are derived from the reference answer by type (a number ± 1 or as text, a list with
one element changed, reversed or shortened, a string altered, the other boolean, an empty value,
None) and another config's reference answer; all of a test's run in one sandbox solve. An
environment that pays any of them is rejected with the paid answer in its report.

The check is a function of the request and `run` (how a plan of operations runs: the verifier's
dispatcher batch), so nothing here depends on the class that serves it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from codegym.contract import analyze_source, answers_equal
from codegym.sandbox.v1 import sandbox_service_pb2 as sb
from codegym.verification.v1 import verification_service_pb2 as vf
from services.verification.plans import (
    CASE_MEMORY_MB,
    CASE_TIME_MS,
    MAX_PAID_REPORTED,
    NEGATIVE_MARK,
    RunOps,
    Sources,
    failure,
    json_value,
    limits,
)

# One test's controls: its config, its reference answer, and its wrong answers (kind, value).
Plan = tuple[str, Any, list[tuple[str, Any]]]
# What each control of a test got: (reward, observation), in the order of its plan.
Outcomes = dict[int, list[tuple[float, str]]]


async def check_negative_controls(
    run: RunOps, request: vf.CheckNegativeControlsRequest
) -> vf.CheckNegativeControlsResponse:
    """Every wrong answer of every test played through `Done`, with `run`; any reward fails."""
    spec = analyze_source(request.env_source)
    response = vf.CheckNegativeControlsResponse()
    done = next((t for t in spec.tools if t.name == "Done"), None)
    if spec.violations or done is None or not done.params:
        response.reasons.append("contract: no Done(answer) tool to call; check the environment first")
        response.verdict = vf.VERDICT_FAIL
        return response
    param = done.params[0].arg
    plans = control_plans(request, response)
    outcomes = await play_controls(run, request, plans, param, response)
    paid = report_paid(plans, outcomes, response)
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


def control_plans(
    request: vf.CheckNegativeControlsRequest, response: vf.CheckNegativeControlsResponse
) -> list[Plan]:
    """The wrong answers of every test with a readable reference answer; counted in `response`."""
    cases = [(c.config_json, json_value(c.answer_json)) for c in request.cases]
    answered = [(config, answer) for config, (ok, answer) in cases if ok]
    plans: list[Plan] = []
    for k, (config, answer) in enumerate(answered):
        others = [a for j, (_, a) in enumerate(answered) if j != k]
        controls = wrong_answers(answer, others)
        plans.append((config, answer, controls))
        for kind, _ in controls:
            response.kinds[kind] = response.kinds.get(kind, 0) + 1
        response.controls += len(controls)
    response.tests = len(plans)
    return plans


async def play_controls(
    run: RunOps,
    request: vf.CheckNegativeControlsRequest,
    plans: list[Plan],
    param: str,
    response: vf.CheckNegativeControlsResponse,
) -> Outcomes:
    """Each test's controls in one sandbox solve; where that form fails (an environment deepcopy
    cannot copy), one run per control. The runs and their failures are counted in `response`."""
    case_time = request.case_time_ms or CASE_TIME_MS
    memory = request.case_memory_mb or CASE_MEMORY_MB
    sources = Sources()
    env_ref = sources.ref(request.env_source)

    def action(value: Any) -> str:
        return json.dumps({"name": "Done", "parameters": {param: value}})

    def solve(config: str, source: str) -> sb.Operation:
        return sb.Operation(
            source=env_ref,
            limits=limits(case_time, memory),
            solve=sb.SolveOp(config_json=config, solve_source=source, max_steps=2),
        )

    ops = [solve(config, controls_source([action(v) for _, v in controls])) for config, _, controls in plans]
    results = await run(ops, sources)
    response.runs += len(results)
    response.cpu_ms += sum(r.usage.cpu_ms for r in results)
    outcomes: Outcomes = {}
    retry: list[int] = []
    for k, result in enumerate(results):
        parsed = read_controls(result, len(plans[k][2]))
        if parsed is None:
            retry.append(k)
        else:
            outcomes[k] = parsed
    singles = [(k, n) for k in retry for n in range(len(plans[k][2]))]
    single_ops = [solve(plans[k][0], single_control_source(action(plans[k][2][n][1]))) for k, n in singles]
    single_results = await run(single_ops, sources)
    response.runs += len(single_results)
    response.cpu_ms += sum(r.usage.cpu_ms for r in single_results)
    for (k, n), result in zip(singles, single_results, strict=True):
        if result.status != sb.STATUS_OK:
            response.failed_runs += 1
            response.first_failure = response.first_failure or failure(result, "control")
            outcomes.setdefault(k, [(0.0, "")] * len(plans[k][2]))
            continue
        outcomes.setdefault(k, [(0.0, "")] * len(plans[k][2]))[n] = (result.reward, result.observation)
    return outcomes


def report_paid(plans: list[Plan], outcomes: Outcomes, response: vf.CheckNegativeControlsResponse) -> int:
    """How many wrong answers were paid; the first `MAX_PAID_REPORTED` of them go in `response`."""
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
    return paid


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

"""The checks that a verified reward means something, beyond "it can be solved".

A policy trained with RL finds every hole in a reward: a tool that returns the answer (shortcuts),
a `Done` that pays wrong answers (negative controls), observations that differ from run to run
(determinism), answers a blind guess gets right (guessability). Each check is a plan of sandbox
operations (never run here) and a reading of their results; `Verifier` inherits them.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from codegym.contract import analyze_source, answers_equal, canonical_json
from codegym.contract.source import method_source
from codegym.sandbox.v1 import sandbox_service_pb2 as sb
from codegym.verification.v1 import verification_service_pb2 as vf
from services.verification.plans import (
    CASE_MEMORY_MB,
    CASE_TIME_MS,
    DETERMINISM_TESTS,
    HEAP_SHIFT,
    MAX_PAID_REPORTED,
    MAX_STEPS,
    NEGATIVE_MARK,
    PROBE_TIME_MS,
    RESIDENT_STEPS,
    SHORTCUT_FRACTION,
    Sources,
    failure,
    json_value,
    limits,
    status_name,
)

if TYPE_CHECKING:
    from services.dispatcher import SandboxDispatcher


class TrustChecks:
    """The trust checks of `Verifier` (services/verification/checks.py), which provides `_run`
    and `sandbox` (session steps go through it, to the session's worker)."""

    sandbox: SandboxDispatcher

    async def _run(self, ops: Sequence[sb.Operation], sources: Sources) -> list[sb.OperationResult]:
        raise NotImplementedError

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
        cases = [(c.config_json, json_value(c.answer_json)) for c in request.cases]
        cases = [(config, answer) for config, (ok, answer) in cases if ok]
        configs = [config_object(config) for config, _ in cases]
        keys = {key for config in configs for key in config}
        # (tool, parameters filled from the config): each tool callable bare, and each tool whose
        # required parameters are all config keys, with the config's values of the same name.
        probes: list[tuple[str, tuple[str, ...]]] = []
        for tool in spec.tools:
            if tool.name == "Done":
                continue
            if all(p.arg in tool.defaults for p in tool.params):
                probes.append((tool.name, ()))
            named = tuple(p.arg for p in tool.params if p.arg in keys)
            if named and all(p.arg in keys or p.arg in tool.defaults for p in tool.params):
                probes.append((tool.name, named))
        sources = Sources()
        env_ref = sources.ref(request.env_source)
        # Per probe and test, the operation's index (None: the config lacks a required parameter).
        plan: list[list[int | None]] = []
        ops: list[sb.Operation] = []
        for name, named in probes:
            row: list[int | None] = []
            tool = next(t for t in spec.tools if t.name == name)
            for (config_json, _), config in zip(cases, configs, strict=True):
                arguments = {arg: config[arg] for arg in named if arg in config}
                if any(p.arg not in arguments and p.arg not in tool.defaults for p in tool.params):
                    row.append(None)
                    continue
                row.append(len(ops))
                ops.append(
                    sb.Operation(
                        source=env_ref,
                        limits=limits(probe_time),
                        solve=sb.SolveOp(
                            config_json=config_json,
                            solve_source=probe_source(name, arguments),
                            max_steps=2,
                        ),
                    )
                )
            plan.append(row)
        results = await self._run(ops, sources)
        for (name, named), row in zip(probes, plan, strict=True):
            probe = vf.ShortcutProbe(tool=name, arguments=named)
            said: list[tuple[str, str, bool]] = []  # (output, reference answer, output is the answer)
            for index, (_, answer) in zip(row, cases, strict=True):
                if index is None or results[index].status != sb.STATUS_OK:
                    continue
                probe.probed += 1
                output = results[index].observation
                said.append(
                    (output.strip(), canonical_json(answer), answers_equal(output, answer, lenient=True))
                )
            # An output the tool also gave for another reference answer tells nothing about the answer
            # (a constant "-1" where most answers are -1): that is guessability, not a shortcut.
            answers_of: dict[str, set[str]] = {}
            for output, answer_key, _ in said:
                answers_of.setdefault(output, set()).add(answer_key)
            for output, _, hit in said:
                if hit and len(answers_of[output]) == 1:
                    probe.hits += 1
                elif hit:
                    probe.uninformative += 1
            response.probes.append(probe)
            if probe.probed and probe.hits / probe.probed > max_fraction:
                if name not in response.shortcut_tools:
                    response.shortcut_tools.append(name)
                called = f"{name}({', '.join(f'{arg}=config[{arg!r}]' for arg in named)})"
                response.reasons.append(
                    f"shortcut: {called} returns the reference answer on {probe.hits}/{probe.probed} tests"
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
        # Once per environment: the first test whose oracle ran, replayed resident and cold.
        played = next(
            (
                (config, results[2 * k])
                for k, config in enumerate(configs)
                if results[2 * k].status == sb.STATUS_OK and len(results[2 * k].trajectory) > 1
            ),
            None,
        )
        if played is not None:
            config, recorded = played
            actions = list(recorded.trajectory[1::2])[: request.resident_max_steps or RESIDENT_STEPS]
            await self._resident_and_cold(response, request.env_source, config, actions, case_time, memory)
        response.verdict = vf.VERDICT_FAIL if response.reasons else vf.VERDICT_PASS
        return response

    async def _resident_and_cold(
        self,
        response: vf.CheckDeterminismResponse,
        env_source: str,
        config: str,
        actions: Sequence[str],
        case_time: int,
        memory: int,
    ) -> None:
        """Play `actions` through a session (create and steps with its key, served by the resident
        process) and cold (steps without a key, each from the state the previous one returned),
        both from the state the session's create committed; record the first difference."""
        code = env_source
        ref = Sources().ref(code)
        key = f"verify-{secrets.token_hex(8)}"
        step_limits = limits(case_time, memory)
        create = sb.Operation(
            source=ref, limits=step_limits, create=sb.CreateOp(config_json=config, session_key=key)
        )

        async def execute(op: sb.Operation, session: str) -> sb.OperationResult:
            return await self.sandbox.execute(op, code, session)

        try:
            created = await execute(create, key)
            response.runs += 1
            response.cpu_ms += created.usage.cpu_ms
            if created.status != sb.STATUS_OK:
                return  # the environment does not build: solvability's business

            async def play(session: str) -> list[sb.OperationResult]:
                out: list[sb.OperationResult] = []
                state = created.state
                for n, action in enumerate(actions):
                    op = sb.Operation(
                        source=ref,
                        limits=step_limits,
                        seed=n + 1,
                        step=sb.StepOp(state=state, action=action, session_key=session),
                    )
                    result = await execute(op, session)
                    out.append(result)
                    if result.status != sb.STATUS_OK:
                        break
                    state = result.state
                return out

            resident, cold = await asyncio.gather(play(key), play(""))
        finally:
            await self.sandbox.release(key)
        response.runs += len(resident) + len(cold)
        response.cpu_ms += sum(r.usage.cpu_ms for r in (*resident, *cold))
        response.resident_served = sum(1 for r in resident if r.resident)
        difference = step_difference(resident, cold)
        response.resident_steps = min(len(resident), len(cold))
        if difference is None:
            return
        difference.config_json = config
        response.resident_difference.CopyFrom(difference)
        response.reasons.append(
            f"nondeterministic: resident and cold differ at step {difference.step} ({difference.what}) of"
            f" {config[:80]}, after {actions[difference.step - 1][:80]}:"
            f" {difference.first[:80]!r} (resident) vs {difference.second[:80]!r} (cold)"
        )

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


def step_difference(
    first: Sequence[sb.OperationResult], second: Sequence[sb.OperationResult]
) -> vf.TrajectoryDifference | None:
    """Where two step-by-step replays of the same actions first differ (step N = the N-th action)."""
    for n, (a, b) in enumerate(zip(first, second, strict=False), start=1):
        if a.status != b.status:
            return vf.TrajectoryDifference(
                step=n, what="status", first=status_name(a.status), second=status_name(b.status)
            )
        if a.status != sb.STATUS_OK:
            return None
        if a.observation != b.observation:
            return vf.TrajectoryDifference(
                step=n, what="observation", first=a.observation[:300], second=b.observation[:300]
            )
        if abs(a.reward - b.reward) > 1e-9 or a.done != b.done:
            return vf.TrajectoryDifference(
                step=n,
                what="reward",
                first=f"{a.reward:g}{' done' if a.done else ''}",
                second=f"{b.reward:g}{' done' if b.done else ''}",
            )
    return None


def probe_source(tool: str, arguments: dict[str, Any] | None = None) -> str:
    """A solve() that calls one tool first thing (with `arguments`) and returns what it said."""
    action = json.dumps({"name": tool, "parameters": arguments or {}})
    return (
        "def solve(self):\n"
        f"    out = self.step({action!r})\n"
        "    return out[1] if isinstance(out, tuple) and len(out) == 2 else out\n"
    )


def config_object(config_json: str) -> dict[str, Any]:
    """The config as a dict; {} for one that is not a JSON object."""
    ok, value = json_value(config_json)
    return value if ok and isinstance(value, dict) else {}

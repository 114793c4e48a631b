"""The checks that a verified reward means something, beyond "it can be solved".

A policy trained with RL finds every hole in a reward: a tool that returns the answer (shortcuts),
a `Done` that pays wrong answers (negative controls), observations that differ from run to run
(determinism), answers a blind guess gets right (guessability). Each check is a plan of sandbox
operations (never run here) and a reading of their results.

Each is a function of its request and what it runs on, passed in: `run` (how a plan of operations
runs: the verifier's dispatcher batch) and, for determinism's session replay, the dispatcher
itself (a session's steps go to the session's worker). `Verifier` (checks.py) serves them.
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
    MAX_STEPS,
    PROBE_TIME_MS,
    RESIDENT_STEPS,
    SHORTCUT_FRACTION,
    RunOps,
    Sources,
    json_value,
    limits,
    status_name,
)

if TYPE_CHECKING:
    from services.dispatcher import SandboxDispatcher


# ---- shortcuts ------------------------------------------------------------------------------
async def check_shortcuts(run: RunOps, request: vf.CheckShortcutsRequest) -> vf.CheckShortcutsResponse:
    """Each tool called first thing, bare or with the config's values, on every test (with `run`):
    one that returns the reference answer on too many tests is a shortcut."""
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
    results = await run(ops, sources)
    for (name, named), row in zip(probes, plan, strict=True):
        probe = vf.ShortcutProbe(tool=name, arguments=named)
        said: list[tuple[str, str, bool]] = []  # (output, reference answer, output is the answer)
        for index, (_, answer) in zip(row, cases, strict=True):
            if index is None or results[index].status != sb.STATUS_OK:
                continue
            probe.probed += 1
            output = results[index].observation
            said.append((output.strip(), canonical_json(answer), answers_equal(output, answer, lenient=True)))
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


# ---- determinism ----------------------------------------------------------------------------
async def check_determinism(
    run: RunOps, sandbox: SandboxDispatcher, request: vf.CheckDeterminismRequest
) -> vf.CheckDeterminismResponse:
    """The oracle run twice per test (with `run`, the second with a shifted heap and another seed),
    then one trajectory replayed resident and cold through `sandbox`'s sessions."""
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
            seed=second,
            solve=sb.SolveOp(
                config_json=config,
                solve_source=(HEAP_SHIFT + solve) if second else solve,
                max_steps=max_steps,
                record=True,
            ),
        )
        for config in configs
        for second in (0, 1)
    ]
    results = await run(ops, sources)
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
        await resident_and_cold(sandbox, response, request.env_source, config, actions, case_time, memory)
    response.verdict = vf.VERDICT_FAIL if response.reasons else vf.VERDICT_PASS
    return response


async def resident_and_cold(
    sandbox: SandboxDispatcher,
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
        return await sandbox.execute(op, code, session)

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
        await sandbox.release(key)
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
def measure_guessability(request: vf.MeasureGuessabilityRequest) -> vf.MeasureGuessabilityResponse:
    """How often a blind `Done` is right (nothing runs: the reference answers are in the request)."""
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

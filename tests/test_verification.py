"""The verification service's answers to bad and hostile requests, over real gRPC and a real sandbox.

The pipeline tests (test_pipeline.py) drive every check through its verdicts; here each RPC gets
the inputs a caller can get wrong: empty sources, matrices too large, configs that are not
objects, duplicates, unreachable workers, and a budget that runs out.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import grpc
import pytest

from codegym.contract.source import method_source
from codegym.server.auth import ServerAuth
from codegym.verification.v1 import verification_service_pb2 as vf
from codegym.verification.v1 import verification_service_pb2_grpc as vf_grpc
from codegym_client.api.common.v1 import common_pb2 as cm
from codegym_client.channels import aio_channel
from services.verification.service import SERVICE_NAME, VerificationServer
from services.verification.settings import VerificationSettings
from services.verification.solution import find_solution_call
from tests.conftest import ENV_DIR
from tests.helpers.pipeline_cases import ANSWER
from tests.helpers.servers import CodegymServer, worker_fixture

SOURCE = (ENV_DIR / "Sample_0006_I__ArrayGcdEnv.py").read_text()
GOOD_SOLVE = method_source(SOURCE, "solve")


def tasks(*configs: str) -> list[cm.TaskConfig]:
    return [cm.TaskConfig(env_id="Sample_0006_I__ArrayGcdEnv", config_json=c) for c in configs]


worker = worker_fixture(jails=2)


@pytest.fixture
async def stub(worker: CodegymServer) -> AsyncIterator[vf_grpc.VerificationServiceStub]:
    server = VerificationServer(VerificationSettings(sandbox=worker.address, port=0), auth=ServerAuth())
    await server.start()
    try:
        async with aio_channel(server.address, [SERVICE_NAME]) as channel:
            yield vf_grpc.VerificationServiceStub(channel)
    finally:
        await server.stop(grace_s=0)


@pytest.mark.jail
async def test_empty_sources_and_oversized_requests_are_invalid_arguments(
    stub: vf_grpc.VerificationServiceStub,
) -> None:
    calls = [
        stub.CheckEnvironment(vf.CheckEnvironmentRequest(env_source="  ")),
        stub.ValidateUnitTests(vf.ValidateUnitTestsRequest(env_source="")),
        stub.CheckSolvability(vf.CheckSolvabilityRequest(env_source="")),
        stub.CheckShortcuts(vf.CheckShortcutsRequest(env_source="")),
        stub.ValidateUnitTests(
            vf.ValidateUnitTestsRequest(
                env_source=SOURCE, thresholds=vf.UnitTestThresholds(min_valid_ratio=1.5)
            )
        ),
        stub.CheckSolvability(
            vf.CheckSolvabilityRequest(
                env_source=SOURCE,
                tasks=tasks(*[json.dumps({"nums": [i]}) for i in range(201)]),
                solve_sources=[GOOD_SOLVE] * 100,
            )
        ),
        stub.CheckShortcuts(vf.CheckShortcutsRequest(env_source=SOURCE, max_fraction=-0.5)),
    ]
    for call in calls:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details()


@pytest.mark.jail
async def test_environment_check_reports_contract_and_safety(stub: vf_grpc.VerificationServiceStub) -> None:
    broken = await stub.CheckEnvironment(vf.CheckEnvironmentRequest(env_source="class X(:\n"))
    assert broken.verdict == vf.VERDICT_FAIL and broken.reasons[0].startswith("syntax_error:")
    assert broken.main_usage.wall_ms == 0  # nothing ran
    risky = SOURCE.replace("import math\n", "import math\nimport os\n", 1)
    flagged = await stub.CheckEnvironment(vf.CheckEnvironmentRequest(env_source=risky))
    assert flagged.verdict == vf.VERDICT_PASS and any("import: os" in f for f in flagged.safety_findings)
    assert [t.name for t in flagged.tools] == ["Observe", "GetElement", "Remainder", "IsZero", "Done"]
    refused = await stub.CheckEnvironment(vf.CheckEnvironmentRequest(env_source=risky, reject_unsafe=True))
    assert refused.verdict == vf.VERDICT_FAIL and refused.reasons[0].startswith("unsafe:")


@pytest.mark.jail
async def test_unit_tests_bad_configs_and_duplicates(stub: vf_grpc.VerificationServiceStub) -> None:
    configs = ['{"nums": [4, 6]}', '{"nums":[4,6]}', "[1, 2]", "not json", '{"nums": [9, 12]}']
    response = await stub.ValidateUnitTests(
        vf.ValidateUnitTestsRequest(env_source=SOURCE, tasks=tasks(*configs))
    )
    reasons = [t.reason.split(":")[0] for t in response.tests]
    assert reasons == ["", "duplicate", "bad_config", "bad_config", ""]
    assert [t.answer_json for t in response.tests if t.valid] == ["2", "3"]
    assert response.distinct == 2 and response.valid == 2
    assert response.verdict == vf.VERDICT_FAIL and response.reasons[0].startswith("too_few_valid_tests")
    loose = await stub.ValidateUnitTests(
        vf.ValidateUnitTestsRequest(
            env_source=SOURCE, tasks=tasks(*configs), thresholds=vf.UnitTestThresholds(min_valid=2)
        )
    )
    assert loose.verdict == vf.VERDICT_PASS


@pytest.mark.jail
async def test_solvability_edge_cases(stub: vf_grpc.VerificationServiceStub) -> None:
    none = await stub.CheckSolvability(
        vf.CheckSolvabilityRequest(env_source=SOURCE, solve_sources=[GOOD_SOLVE])
    )
    assert none.verdict == vf.VERDICT_FAIL and none.reasons[0].startswith("no_tests")
    empty = await stub.CheckSolvability(
        vf.CheckSolvabilityRequest(
            env_source=SOURCE, tasks=tasks('{"nums": [4, 6]}'), solve_sources=["", " "]
        )
    )
    assert empty.reasons[0].startswith("no_candidates")
    assert [c.outcome for c in empty.candidates] == [vf.CANDIDATE_OUTCOME_EMPTY] * 2
    slow = GOOD_SOLVE.replace(
        "def solve(self):\n", "def solve(self):\n    import time\n    time.sleep(0.3)\n", 1
    )
    budget = await stub.CheckSolvability(
        vf.CheckSolvabilityRequest(
            env_source=SOURCE,
            tasks=tasks(*[json.dumps({"nums": [6 * i, 9 * i]}) for i in range(1, 40)]),
            solve_sources=[slow],
            limits=vf.SolvabilityLimits(budget_ms=200),
        )
    )
    assert budget.verdict == vf.VERDICT_FAIL and budget.reasons[0].startswith("budget_exhausted")
    assert budget.cases_run < 39


@pytest.mark.slow  # over 10 s
async def test_unreachable_sandbox_is_unavailable_not_a_verdict() -> None:
    server = VerificationServer(VerificationSettings(sandbox="127.0.0.1:9", port=0), auth=ServerAuth())
    await server.start()
    try:
        async with aio_channel(server.address, [SERVICE_NAME]) as channel:
            stub = vf_grpc.VerificationServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.ValidateUnitTests(
                    vf.ValidateUnitTestsRequest(
                        env_source=SOURCE,
                        tasks=tasks('{"nums": [4, 6]}'),
                        thresholds=vf.UnitTestThresholds(ref_time_ms=200),
                    ),
                    timeout=60,
                )
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "sandbox" in info.value.details()
    finally:
        await server.stop(grace_s=0)


def test_solution_function_is_found_statically() -> None:
    source = "def helper(x):\n    return x\n\ndef solve_it(nums, k=1):\n    return nums[:k]\n"
    call = find_solution_call(source, ["nums", "k"])
    assert call is not None and call.function == "solve_it" and call.arg_names == ("nums", "k")
    assert call.args_for({"k": 2, "nums": [1]}) == [[1], 2] and call.args_for({"k": 2}) is None
    assert find_solution_call(source, ["other"]) is None
    named = find_solution_call(source, [], entry_point="solve_it", arg_names=["nums"])
    assert named is not None and named.arg_names == ("nums",)
    assert find_solution_call(source, [], entry_point="missing") is None
    assert find_solution_call("import sys\nprint(sys.stdin.read())\n", ["nums"]) is None
    assert find_solution_call("def broken(:\n", ["nums"]) is None


# ---- negative controls, determinism, guessability -------------------------------------------------

PAYS_ANY = SOURCE.replace("correct = answer == ref\n", "correct = True\n", 1)
PAYS_TEXT = SOURCE.replace("correct = answer == ref\n", "correct = answer == ref or answer == str(ref)\n", 1)
# A tool that answers given the config's own values: Answer(nums) with the config's nums.
ANSWERS_FROM_CONFIG = SOURCE.replace(
    '"Done": self.DONE,', '"Answer": 5,\n            "Done": self.DONE,', 1
).replace("    def Done(self, answer: int):", ANSWER, 1)
# Module-level state that changes per step: a resident process keeps it, a cold step starts afresh.
MODULE_STATE = SOURCE.replace("class ArrayGcdEnv(", "_CALLS = [0]\n\n\nclass ArrayGcdEnv(", 1).replace(
    "        return str(self.nums[index])\n",
    "        _CALLS[0] += 1\n        return str(self.nums[index] + _CALLS[0] - 1)\n",
    1,
)
ID_IN_DONE = SOURCE.replace(
    'return f"Your answer: {answer}, ', 'return f"[{id(object())}] Your answer: {answer}, ', 1
)


async def sample_cases(
    stub: vf_grpc.VerificationServiceStub, source: str, configs: list[str]
) -> list[vf.ShortcutCase]:
    response = await stub.ValidateUnitTests(
        vf.ValidateUnitTestsRequest(env_source=source, tasks=tasks(*configs))
    )
    return [
        vf.ShortcutCase(config_json=t.task.config_json, answer_json=t.answer_json)
        for t in response.tests
        if t.valid
    ]


GCD_CONFIGS = [json.dumps({"nums": [6 * i, 9 * i, 3 * i + 3]}) for i in range(1, 9)]


@pytest.mark.jail
async def test_negative_controls_pass_every_sample_and_catch_paying_dones(
    stub: vf_grpc.VerificationServiceStub,
) -> None:
    from codegym_testkit.sample_configs import sample_configs

    for path in sorted(ENV_DIR.glob("*Env.py")):
        env_class = path.stem.split("__", 1)[1]
        source = path.read_text()
        configs = [json.dumps(c) for c in sample_configs(env_class, 8, seed=1)]
        cases = await sample_cases(stub, source, configs)
        controls = await stub.CheckNegativeControls(
            vf.CheckNegativeControlsRequest(env_source=source, cases=cases)
        )
        assert controls.verdict == vf.VERDICT_PASS, (env_class, list(controls.reasons), list(controls.paid))
        assert (
            controls.tests == len(cases) and controls.controls >= 3 * len(cases) and not controls.failed_runs
        )
        assert controls.runs == len(cases)  # one sandbox run per test
        determinism = await stub.CheckDeterminism(
            vf.CheckDeterminismRequest(env_source=source, config_jsons=configs)
        )
        assert determinism.verdict == vf.VERDICT_PASS, (env_class, list(determinism.reasons))
        assert determinism.compared == 5
        # The first oracle trajectory was replayed through a session (resident) and cold too.
        steps = determinism.resident_steps
        assert steps > 0 and determinism.resident_served == steps, (env_class, steps)
        assert determinism.runs == 10 + 1 + 2 * steps
        assert not determinism.HasField("resident_difference")
        shortcuts = await stub.CheckShortcuts(vf.CheckShortcutsRequest(env_source=source, cases=cases))
        assert shortcuts.verdict == vf.VERDICT_PASS, (env_class, list(shortcuts.reasons))

    for bad, kinds in ((PAYS_ANY, None), (PAYS_TEXT, {"as_string"})):
        cases = await sample_cases(stub, bad, GCD_CONFIGS)
        response = await stub.CheckNegativeControls(
            vf.CheckNegativeControlsRequest(env_source=bad, cases=cases)
        )
        assert response.verdict == vf.VERDICT_FAIL
        assert response.reasons[0].startswith("reward_accepts_wrong_answers:")
        paid = response.paid[0]
        assert paid.reward == 1.0 and paid.config_json and paid.answer_json != paid.reference_json
        if kinds is not None:
            assert {p.kind for p in response.paid} == kinds
            assert json.loads(paid.answer_json) == str(json.loads(paid.reference_json))


@pytest.mark.jail
async def test_determinism_catches_per_process_values(stub: vf_grpc.VerificationServiceStub) -> None:
    response = await stub.CheckDeterminism(
        vf.CheckDeterminismRequest(
            env_source=ID_IN_DONE, solve_source=GOOD_SOLVE, config_jsons=GCD_CONFIGS, tests=3
        )
    )
    assert response.verdict == vf.VERDICT_FAIL and response.reasons[0].startswith("nondeterministic:")
    first = response.differences[0]
    assert first.what == "observation" and first.step > 0 and first.first != first.second


@pytest.mark.jail
async def test_guessability(stub: vf_grpc.VerificationServiceStub) -> None:
    cases = [
        vf.ShortcutCase(config_json=str(i), answer_json=a) for i, a in enumerate(["true", "false", "true"])
    ]
    booleans = await stub.MeasureGuessability(vf.MeasureGuessabilityRequest(cases=cases))
    assert list(booleans.guess_rates) == [0.5] * 3 and booleans.guess_rate == 0.5
    numbers = [vf.ShortcutCase(config_json=str(i), answer_json=a) for i, a in enumerate(["1", "1", "2", "1"])]
    response = await stub.MeasureGuessability(
        vf.MeasureGuessabilityRequest(cases=numbers, max_guess_rate=0.7)
    )
    assert list(response.guess_rates) == [0.75, 0.75, 0.25, 0.75] and response.most_frequent_json == "1"
    assert response.verdict == vf.VERDICT_FAIL and response.reasons[0].startswith("guessable:")


@pytest.mark.jail
async def test_shortcut_with_arguments_from_the_config(stub: vf_grpc.VerificationServiceStub) -> None:
    configs = [json.dumps({"nums": [6 * i, 9 * i]}) for i in range(1, 9)]  # answers 3, 6, ..., 24
    cases = await sample_cases(stub, ANSWERS_FROM_CONFIG, configs)
    response = await stub.CheckShortcuts(
        vf.CheckShortcutsRequest(env_source=ANSWERS_FROM_CONFIG, cases=cases)
    )
    assert response.verdict == vf.VERDICT_FAIL and list(response.shortcut_tools) == ["Answer"]
    assert response.reasons[0].startswith("shortcut: Answer(nums=config['nums']) returns")
    probes = {(p.tool, tuple(p.arguments)): (p.hits, p.probed) for p in response.probes}
    assert probes[("Answer", ("nums",))] == (len(cases), len(cases))
    assert probes[("Observe", ())] == (0, len(cases))
    assert ("GetElement", ()) not in probes  # its `index` is no config key


@pytest.mark.jail
async def test_resident_and_cold_differ_with_module_state(stub: vf_grpc.VerificationServiceStub) -> None:
    configs = [json.dumps({"nums": [6, 9, 12]}), json.dumps({"nums": [10, 4]})]
    response = await stub.CheckDeterminism(
        vf.CheckDeterminismRequest(env_source=MODULE_STATE, config_jsons=configs)
    )
    # Each oracle run is one process: both runs agree; resident steps keep _CALLS, cold ones do not.
    assert not response.differences
    assert response.verdict == vf.VERDICT_FAIL
    assert response.reasons[0].startswith(
        "nondeterministic: resident and cold differ at step 3 (observation)"
    )
    d = response.resident_difference
    assert d.config_json == configs[0] and d.step == 3 and (d.first, d.second) == ("10", "9")
    assert response.resident_steps >= 3 and response.resident_served == response.resident_steps

"""The runtime end to end: real sandbox worker processes (real nsjail), a real runtime process, the
project's clients over gRPC on loopback. Observations are compared with the environments run
in-process (in a child interpreter, so env code stays out of the test process)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest

from codegym.contract import parse_ability, split_env_id
from codegym.library.store import Library
from codegym_client.actions import BEGIN, END
from codegym_client.api.runtime.v1 import runtime_service_pb2 as rt
from codegym_client.async_client import AsyncRuntimeClient
from codegym_client.gym_env import OnlineGymEnv, RemoteEnv
from codegym_client.runtime_client import RuntimeClient
from tests.conftest import (
    ENV_DIR,
    FIXTURE_ENVS,
    ROOT,
    SAMPLES,
    SHARED_DATA,
    sample_tasks,
    training_instances,
)
from tests.helpers.libraries import library_fixture
from tests.helpers.processes import (
    assert_all_gone,
    count,
    listening_ports,
    port_free,
    process_tree,
    sleeping_in_jails,
    wait_for,
    wait_until,
)
from tests.helpers.servers import (
    CodegymServer,
    deployed_runtime,
    start_runtime,
    start_workers,
    workers_fixture,
)
from tests.helpers.trajectories import record

RUNTIME_ENVS = ROOT / "tests" / "fixtures" / "runtime_envs"
COUNTER = "Test_0001_I__CounterEnv"


def env_path(env_id: str) -> Path:
    for folder in (ENV_DIR, FIXTURE_ENVS, RUNTIME_ENVS):
        if (folder / f"{env_id}.py").exists():
            return folder / f"{env_id}.py"
    raise FileNotFoundError(env_id)


def in_process(tasks: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Oracle trajectories recorded by running each env's solve() in a child interpreter."""
    jobs = [{"path": str(env_path(e)), "class": split_env_id(e)[1], "config": c} for e, c in tasks]
    return record(jobs)


library = library_fixture(
    [ENV_DIR, SAMPLES / "tasks.jsonl", FIXTURE_ENVS, SHARED_DATA / "training_instance_sample.jsonl"],
    [RUNTIME_ENVS / f"{COUNTER}.py"],
)
workers = workers_fixture()


@pytest.fixture(scope="module")
def runtime(library: Path, workers: list[CodegymServer]) -> Iterator[CodegymServer]:
    proc = start_runtime(library, workers)
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def client(runtime: CodegymServer) -> Iterator[RuntimeClient]:
    with RuntimeClient(runtime.address, timeout_s=60) as c:
        yield c


@pytest.fixture(scope="module")
def sample_runtime(request: pytest.FixtureRequest) -> str:
    """The address of a runtime serving the sample library: CODEGYM_TEST_RUNTIME when set (a
    deployed runtime, e.g. `codegym up`), else this module's own runtime (started only then)."""
    return deployed_runtime() or request.getfixturevalue("runtime").address


@pytest.fixture(scope="module")
def sample_client(sample_runtime: str) -> Iterator[RuntimeClient]:
    with RuntimeClient(sample_runtime, timeout_s=60) as c:
        yield c


def replay(client: RuntimeClient, env_id: str, config: dict[str, Any], expected: dict[str, Any]) -> None:
    created = client.create_session(env_id=env_id, config=config)
    assert created.observation == expected["first"]
    for i, (action, observation) in enumerate(expected["steps"]):
        response = client.step(created.session_id, action)
        assert not response.HasField("error"), response.error
        assert response.observation == observation, (env_id, i, action)
        assert response.step_index == i + 1
    assert response.done and not response.truncated
    assert response.reward == expected["reward"] == 1
    assert client.close_session(created.session_id)


# ---- library --------------------------------------------------------------------------------------


def test_library_import_is_idempotent_and_reports_what_it_skipped(tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "NoDoubleUnderscoreEnv.py").write_text("x = 1\n")
    (bad / "Bad_1_I__BrokenEnv.py").write_text("class BrokenEnv(:\n")
    (bad / "Bad_2_I__OtherNameEnv.py").write_text(
        (ENV_DIR / "Sample_0001_I__MaxSubarraySumEnv.py").read_text()
    )
    lines = [
        json.dumps({"ability": 'codegym_v1@Nope_1_I__MissingEnv@{"a": 1}'}),
        json.dumps({"ability": "wrong@Sample_0001_I__MaxSubarraySumEnv@{}"}),
        "{not json",
        json.dumps(
            {"env_id": "Sample_0001_I__MaxSubarraySumEnv", "config": {"nums": [1]}, "difficulty": "extreme"}
        ),
        json.dumps({"question_id": "q1"}),
    ]
    (bad / "tasks.jsonl").write_text("\n".join(lines) + "\n")
    db = tmp_path / "lib.db"
    with Library(db) as lib:
        first = lib.import_paths([ENV_DIR, SAMPLES / "tasks.jsonl", bad])
        second = lib.import_paths([ENV_DIR, SAMPLES / "tasks.jsonl"])
        assert lib.counts() == (12, 108)
    assert len(first.added) == 12 and first.tasks_added == 108
    assert second.added == [] and second.updated == [] and len(second.unchanged) == 12
    assert second.tasks_added == 0 and second.tasks_present == 108
    reasons = {
        Path(where.split(":")[0]).name + where[len(where.split(":")[0]) :]: why
        for where, why in first.skipped
    }
    assert len(first.skipped) == 8, first.skipped
    assert "not {code_id}__{EnvClass}" in reasons["NoDoubleUnderscoreEnv.py"]
    assert "syntax" in reasons["Bad_1_I__BrokenEnv.py"].lower()
    assert "defines MaxSubarraySumEnv, not OtherNameEnv" in reasons["Bad_2_I__OtherNameEnv.py"]
    assert "not in the library" in reasons["tasks.jsonl:1"]
    assert "prefix" in reasons["tasks.jsonl:2"]
    assert "Expecting property name" in reasons["tasks.jsonl:3"]
    assert "extreme" in reasons["tasks.jsonl:4"]
    assert "neither 'ability'" in reasons["tasks.jsonl:5"]


def test_training_instances_bring_task_text_and_oracle_rounds(library: Path) -> None:
    with Library(library) as lib:
        for item in training_instances():
            ability = parse_ability(item["ability"])
            record_ = lib.get(ability.env_id)
            assert record_ is not None
            assert record_.tools_text == item["prompt"][0]["content"]
            assert record_.task_text and record_.task_text in item["prompt"][1]["content"]
            rounds = [t.solve_fc_round for t in record_.tasks if json.loads(t.config_json) == ability.config]
            assert rounds == [item["extra_info"]["solve_fc_round"]]


# ---- playing episodes through every client --------------------------------------------------------


@pytest.mark.jail
@pytest.mark.deployable
def test_every_sample_task_reaches_reward_1_with_in_process_observations(
    sample_client: RuntimeClient,
) -> None:
    tasks = [(t["env_id"], t["config"]) for t in sample_tasks()]
    expected = in_process(tasks)
    for (env_id, config), exp in zip(tasks, expected, strict=True):
        replay(sample_client, env_id, config, exp)


@pytest.mark.jail
@pytest.mark.deployable
def test_every_sample_task_at_32_sessions_matches_in_process(sample_runtime: str) -> None:
    """The 108 sample episodes, 32 at a time: resident, cold and coalesced steps all give the recording."""
    tasks = [(t["env_id"], t["config"]) for t in sample_tasks()]
    expected = in_process(tasks)

    async def main() -> list[list[str]]:
        limit = asyncio.Semaphore(32)
        async with AsyncRuntimeClient(sample_runtime, timeout_s=120) as client:

            async def play(index: int) -> list[str]:
                env_id, config = tasks[index]
                async with limit:
                    created = await client.create_session(env_id=env_id, config=config)
                    seen = [created.observation]
                    for action, _ in expected[index]["steps"]:
                        response = await client.step(created.session_id, action)
                        assert not response.HasField("error"), response.error
                        seen.append(response.observation)
                    assert response.done and response.reward == 1.0
                    await client.close_session(created.session_id)
                    return seen

            return await asyncio.gather(*(play(i) for i in range(len(tasks))))

    for exp, seen in zip(expected, asyncio.run(main()), strict=True):
        assert seen == [exp["first"], *(o for _, o in exp["steps"])]


@pytest.mark.jail
@pytest.mark.deployable
def test_step_stream_drives_many_sessions_over_one_call(sample_runtime: str) -> None:
    tasks = [(t["env_id"], t["config"]) for t in sample_tasks()][::12]
    expected = in_process(tasks)

    async def main() -> tuple[dict[str, list[str]], list[rt.StepStreamResponse]]:
        async with AsyncRuntimeClient(sample_runtime, timeout_s=60) as client:
            created = [await client.create_session(env_id=e, config=c) for e, c in tasks]
            stream = client.step_stream()
            cursor = {s.session_id: 0 for s in created}
            plans = {s.session_id: exp["steps"] for s, exp in zip(created, expected, strict=True)}
            seen: dict[str, list[str]] = {s.session_id: [s.observation] for s in created}
            # Two steps of each session up front (they must apply in order), and two bad requests.
            for sid in cursor:
                for k in range(2):
                    await stream.send(sid, plans[sid][k][0], tag=f"{sid}:{k}")
                cursor[sid] = 2
            await stream.send("f" * 32, '{"name": "Observe", "parameters": {}}', tag="unknown")
            await stream.send(created[0].session_id, "{not json", tag="malformed")
            odd: list[rt.StepStreamResponse] = []
            outstanding = 2 * len(cursor) + 2
            while outstanding:
                answer = await stream.recv()
                assert answer is not None
                outstanding -= 1
                if answer.tag in ("unknown", "malformed"):
                    odd.append(answer)
                    continue
                assert answer.code == 0, answer.message
                sid = answer.session_id
                seen[sid].append(answer.response.observation)
                if cursor[sid] < len(plans[sid]):
                    await stream.send(sid, plans[sid][cursor[sid]][0], tag=f"{sid}:{cursor[sid]}")
                    cursor[sid] += 1
                    outstanding += 1
            await stream.done_sending()
            assert await stream.recv() is None
            return seen, odd

    seen, odd = asyncio.run(main())
    for exp, observations in zip(expected, seen.values(), strict=True):
        assert observations == [exp["first"], *(o for _, o in exp["steps"])]
    by_tag = {a.tag: a for a in odd}
    assert by_tag["unknown"].code == grpc.StatusCode.NOT_FOUND.value[0]
    assert by_tag["malformed"].code == 0
    assert by_tag["malformed"].response.error.code == rt.STEP_ERROR_CODE_INVALID_ACTION


@pytest.mark.jail
@pytest.mark.deployable
def test_clients_take_openai_tool_call_messages_as_actions(sample_runtime: str) -> None:
    from types import SimpleNamespace

    env_id, config = next((t["env_id"], t["config"]) for t in sample_tasks() if t["difficulty"] == "medium")
    (expected,) = in_process([(env_id, config)])

    def message(action: str, n: int, sdk: bool) -> Any:
        parsed = json.loads(action)
        arguments = json.dumps(parsed["parameters"])
        if sdk:  # what the openai package returns: attributes, not keys
            function = SimpleNamespace(name=parsed["name"], arguments=arguments)
            return SimpleNamespace(content=None, tool_calls=[SimpleNamespace(id=f"c{n}", function=function)])
        call = {
            "id": f"c{n}",
            "type": "function",
            "function": {"name": parsed["name"], "arguments": arguments},
        }
        return {"role": "assistant", "content": None, "tool_calls": [call]}

    online = OnlineGymEnv.from_env_str(f"codegym_v1@{env_id}@{json.dumps(config)}", target=sample_runtime)
    try:
        two = message(expected["steps"][0][0], 0, False)
        two["tool_calls"] = two["tool_calls"] * 2
        assert online.step(two).startswith("Error: call one tool per step")
        for i, (action, observation) in enumerate(expected["steps"]):
            assert online.step(message(action, i, sdk=i % 2 == 1)) == observation
        assert online.finished and online.reward == 1.0
    finally:
        online.release()
    remote = RemoteEnv(sample_runtime, env_id=env_id, config=config)
    try:
        remote.reset()
        for i, (action, observation) in enumerate(expected["steps"]):
            seen, reward, terminated, _, _ = remote.step(message(action, i, sdk=i % 2 == 0))
            assert seen == observation
        assert terminated and reward == 1.0
    finally:
        remote.close()


@pytest.mark.jail
def test_training_instance_abilities_through_online_adapter(runtime: CodegymServer) -> None:
    instances = training_instances()
    abilities = [parse_ability(i["ability"]) for i in instances]
    expected = in_process([(a.env_id, a.config) for a in abilities])
    for item, exp in zip(instances, expected, strict=True):
        env = OnlineGymEnv.from_env_str(item["ability"], target=runtime.address)
        try:
            assert env.observation == exp["first"]
            assert env.tools_text == item["prompt"][0]["content"]
            for i, (action, observation) in enumerate(exp["steps"]):
                # Every other step arrives as a model turn with the function-call markers.
                turn = f"thinking...{BEGIN}[{action}]{END}" if i % 2 else action
                assert env.step(turn) == observation
            assert env.finished and env.reward == 1.0
            assert env.step_count == len(exp["steps"])
            assert env.step('{"name": "Observe", "parameters": {}}').startswith("Error: ")
        finally:
            env.release()


@pytest.mark.jail
@pytest.mark.deployable
def test_async_client_plays_one_task_of_every_env_concurrently(sample_runtime: str) -> None:
    tasks = [(t["env_id"], t["config"]) for t in sample_tasks() if t["difficulty"] == "medium"][::3]
    expected = in_process(tasks)

    async def play(client: AsyncRuntimeClient, env_id: str, config: dict[str, Any]) -> list[str]:
        created = await client.create_session(env_id=env_id, config=config)
        seen = [created.observation]
        for action in exp_by_env[env_id]["steps"]:
            seen.append((await client.step(created.session_id, action[0])).observation)
        assert (await client.get_session(created.session_id)).status == rt.SESSION_STATUS_DONE
        await client.close_session(created.session_id)
        return seen

    exp_by_env = {e: x for (e, _), x in zip(tasks, expected, strict=True)}

    async def main() -> list[list[str]]:
        async with AsyncRuntimeClient(sample_runtime) as client:
            return await asyncio.gather(*(play(client, e, c) for e, c in tasks))

    results = asyncio.run(main())
    for (env_id, _), seen in zip(tasks, results, strict=True):
        exp = exp_by_env[env_id]
        assert seen == [exp["first"], *(o for _, o in exp["steps"])]


@pytest.mark.jail
@pytest.mark.deployable
def test_gymnasium_adapter(sample_client: RuntimeClient) -> None:
    task = next(t for t in sample_tasks() if t["env_id"].endswith("CountIslandsEnv"))
    (exp,) = in_process([(task["env_id"], task["config"])])
    env = RemoteEnv(sample_client, env_id=task["env_id"], config=task["config"])
    try:
        observation, info = env.reset()
        assert observation == exp["first"] and "def GetCell" in info["tools_text"]
        for action, expected in exp["steps"]:
            observation, reward, terminated, truncated, info = env.step(action)
            assert observation == expected and "error" not in info
        assert (reward, terminated, truncated) == (1.0, True, False)
        observation, _ = env.reset()  # same session, back to its own task
        assert observation == exp["first"]
        _, _, _, _, info = env.step({"name": "Nope", "parameters": {}})
        assert info["error"] == "STEP_ERROR_CODE_UNKNOWN_TOOL" and info["step_index"] == 0
    finally:
        env.close()


# ---- bad inputs -----------------------------------------------------------------------------------


def rpc_error(call: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


@pytest.mark.jail
def test_create_session_refusals(client: RuntimeClient) -> None:
    err = rpc_error(lambda: client.create_session(env_id="Nope_1_I__NoSuchEnv", config={}))
    assert err.code() == grpc.StatusCode.NOT_FOUND and "Nope_1_I__NoSuchEnv" in err.details()
    err = rpc_error(lambda: client.create_session(env_id=f"{COUNTER}", config="{target: 3"))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "neither JSON" in err.details()
    err = rpc_error(lambda: client.create_session(env_id=COUNTER, config={"wrong": 1}))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "config needs 'target'" in err.details()
    err = rpc_error(lambda: client.create_session(ability="codegym_v2@X__YEnv@{}"))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "prefix" in err.details()
    err = rpc_error(
        lambda: client.create_session(env_id="Sample_0001_I__MaxSubarraySumEnv", env_str="OtherEnv@{}")
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    err = rpc_error(lambda: client.create_session(env_id=COUNTER, config={"target": 1}, max_steps=100000))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_steps" in err.details()
    created = client.create_session(env_str='CounterEnv@{"target": 2}')  # by class name alone
    assert created.env_id == COUNTER and created.observation == "Counter at 0; reach 2."


def counter_session(client: RuntimeClient, **options: Any) -> str:
    return client.create_session(env_id=COUNTER, config={"target": 3}, **options).session_id


@pytest.mark.jail
@pytest.mark.parametrize(
    ("action", "code", "words"),
    [
        ("{not json", rt.STEP_ERROR_CODE_INVALID_ACTION, "not valid JSON"),
        ('{"parameters": {}}', rt.STEP_ERROR_CODE_INVALID_ACTION, '"name"'),
        ('{"name": "Add", "parameters": [1]}', rt.STEP_ERROR_CODE_INVALID_ACTION, "must be an object"),
        (
            '[{"name": "Observe"}, {"name": "Observe"}]',
            rt.STEP_ERROR_CODE_INVALID_ACTION,
            "one function call",
        ),
        ('{"name": "Exec", "parameters": {}}', rt.STEP_ERROR_CODE_UNKNOWN_TOOL, "Observe, Add, Boom"),
        (
            '{"name": "Add", "parameters": {"amount": "' + "x" * 70000 + '"}}',
            rt.STEP_ERROR_CODE_INVALID_ACTION,
            "bytes",
        ),
        ('{"name": "Boom", "parameters": {}}', rt.STEP_ERROR_CODE_ENV_ERROR, "boom"),
        ('{"name": "Spin", "parameters": {}}', rt.STEP_ERROR_CODE_STEP_TIMEOUT, "timed out"),
        ('{"name": "Hog", "parameters": {}}', rt.STEP_ERROR_CODE_SANDBOX_LIMIT, "memory"),
    ],
)
def test_step_errors_are_typed_and_change_nothing(
    client: RuntimeClient, action: str, code: int, words: str
) -> None:
    # Only the endless loop gets a short deadline: a memory bomb must hit its limit, not the clock.
    session = counter_session(client, step_timeout_ms=500 if "Spin" in action else 10_000)
    assert client.step(session, '{"name": "Add", "parameters": {"amount": 2}}').observation == "2"
    response = client.step(session, action)
    assert response.error.code == code, response
    assert words in response.error.message and response.observation == response.error.message
    assert response.step_index == 1 and not response.done
    # The failed step left the committed state alone: the counter is still 2, one step taken.
    after = client.step(session, '{"name": "Observe", "parameters": {}}')
    assert (after.observation, after.step_index) == ("2", 2)
    client.close_session(session)


@pytest.mark.jail
def test_structured_tool_call_and_one_element_list(client: RuntimeClient) -> None:
    session = counter_session(client)
    response = client.step(session, rt.ToolCall(name="Add", parameters_json='{"amount": 5}'))
    assert response.observation == "5"
    response = client.step(session, '[{"name": "Add", "parameters": {"amount": -2}}]')
    assert response.observation == "3"
    response = client.step(session, rt.ToolCall(name="Add", parameters_json="{oops"))
    assert response.error.code == rt.STEP_ERROR_CODE_INVALID_ACTION


@pytest.mark.jail
def test_oversized_message_is_refused_by_the_server(client: RuntimeClient, runtime: CodegymServer) -> None:
    session = counter_session(client)
    unlimited = grpc.insecure_channel(runtime.address, options=[("grpc.max_send_message_length", -1)])
    with unlimited:
        step = unlimited.unary_unary(
            "/codegym.runtime.v1.RuntimeService/Step",
            request_serializer=rt.StepRequest.SerializeToString,
            response_deserializer=rt.StepResponse.FromString,
        )
        request = rt.StepRequest(session_id=session, action_json="x" * (17 * 1024 * 1024))
        err = rpc_error(lambda: step(request, timeout=30))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert client.step(session, '{"name": "Observe", "parameters": {}}').step_index == 1


@pytest.mark.jail
def test_unknown_session_done_session_and_truncation(client: RuntimeClient) -> None:
    err = rpc_error(lambda: client.step("no-such-session", '{"name": "Observe", "parameters": {}}'))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    session = counter_session(client)
    client.step(session, {"name": "Add", "parameters": {"amount": 3}})
    done = client.step(session, {"name": "Done", "parameters": {"answer": 3}})
    assert done.done and not done.truncated and done.reward == 1.0
    err = rpc_error(lambda: client.step(session, {"name": "Observe", "parameters": {}}))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "Reset" in err.details()
    view = client.get_session(session)
    assert (view.status, view.step_index, view.reward) == (rt.SESSION_STATUS_DONE, 2, 1.0)
    assert client.reset(session) == "Counter at 0; reach 3."
    view = client.get_session(session)
    assert (view.status, view.step_index, view.reward) == (rt.SESSION_STATUS_ACTIVE, 0, 0.0)
    assert client.step(session, {"name": "Observe", "parameters": {}}).observation == "0"

    capped = counter_session(client, max_steps=3)
    results = [client.step(capped, {"name": "Add", "parameters": {"amount": 1}}) for _ in range(3)]
    assert [(r.done, r.truncated) for r in results] == [(False, False), (False, False), (True, True)]
    assert client.get_session(capped).status == rt.SESSION_STATUS_TRUNCATED
    err = rpc_error(lambda: client.step(capped, {"name": "Observe", "parameters": {}}))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "truncated" in err.details()
    assert client.close_session(capped) and not client.close_session(capped)
    assert rpc_error(lambda: client.get_session(capped)).code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.jail
def test_concurrent_steps_on_one_session_are_serialized(client: RuntimeClient) -> None:
    session = counter_session(client)
    with ThreadPoolExecutor(16) as pool:
        responses = list(
            pool.map(lambda _: client.step(session, {"name": "Add", "parameters": {"amount": 1}}), range(32))
        )
    assert sorted(r.step_index for r in responses) == list(range(1, 33))
    assert sorted(int(r.observation) for r in responses) == list(range(1, 33))
    assert client.step(session, {"name": "Observe", "parameters": {}}).observation == "32"


@pytest.mark.jail
def test_closing_a_session_during_its_step_does_not_bring_it_back(
    client: RuntimeClient, workers: list[CodegymServer]
) -> None:
    session = counter_session(client)
    assert sleeping_in_jails(*(w.pid for w in workers)) == []
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(client.step, session, {"name": "Slow", "parameters": {"ms": 1500}})
        # The step has started: its process in a jail sleeps in the tool.
        wait_until(lambda: bool(sleeping_in_jails(*(w.pid for w in workers))), 20, "the Slow step to start")
        assert client.close_session(session)
        with pytest.raises(grpc.RpcError) as info:
            pending.result(timeout=30)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and "closed during the step" in info.value.details()
    assert rpc_error(lambda: client.get_session(session)).code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.jail
def test_batch_step(client: RuntimeClient) -> None:
    sessions = [counter_session(client) for _ in range(4)]
    results = client.batch_step(
        [(s, {"name": "Add", "parameters": {"amount": i}}) for i, s in enumerate(sessions)]
        + [("no-such-session", {"name": "Observe", "parameters": {}})]
    )
    assert [r.response.observation for r in results[:4]] == ["0", "1", "2", "3"]
    assert results[4].code == grpc.StatusCode.NOT_FOUND.value[0] and "no-such-session" in results[4].message
    err = rpc_error(lambda: client.batch_step([(sessions[0], "{}"), (sessions[0], "{}")]))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "distinct" in err.details()


@pytest.mark.jail
def test_list_and_get_envs(client: RuntimeClient) -> None:
    envs = client.list_envs(page_size=4)
    assert len(envs) == 16 and [e.env_id for e in envs] == sorted(e.env_id for e in envs)

    async def listed_async() -> list[Any]:
        async with AsyncRuntimeClient(client.target) as aio:
            return await aio.list_envs(page_size=5)

    assert asyncio.run(listed_async()) == envs  # both clients: the same list
    assert [e.env_id[:11] for e in client.list_envs(prefix="Sample_000")] == [
        f"Sample_000{i}" for i in range(1, 10)
    ]
    samples = [e for e in envs if e.env_id.startswith("Sample_")]
    assert all(e.task_count == 9 for e in samples)
    env = client.get_env("Sample_0004_I__CountIslandsEnv")
    assert len(env.tasks) == 9 and {t.difficulty for t in env.tasks} == {1, 2, 3}
    assert [t.name for t in env.tools] == [
        "Observe",
        "GetCell",
        "MarkVisited",
        "IsVisited",
        "GetNeighbors",
        "Done",
    ]
    schema = json.loads(env.tools[1].json_schema)
    assert schema["function"]["parameters"]["required"] == ["row", "col"]
    assert "islands" in env.task_text
    err = rpc_error(lambda: client.get_env("Nope_1_I__NoEnv"))
    assert err.code() == grpc.StatusCode.NOT_FOUND


# ---- limits: TTL, capacity -----------------------------------------------------------------------


@pytest.mark.jail
def test_idle_sessions_expire(library: Path, workers: list[CodegymServer]) -> None:
    # A session expires `ttl` after its last use, by the runtime's monotonic clock (this one too):
    # `idle` is last used at its creation, `kept` by a step half a TTL later. Asking about a
    # session (GetSession) does not renew it, so the test can watch `idle` go.
    ttl = 3.0
    proc = start_runtime(library, workers, "--session-ttl-s", str(ttl))
    try:
        with RuntimeClient(proc.address) as c:

            def gone(session_id: str) -> bool:
                try:
                    c.get_session(session_id)
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.NOT_FOUND, exc
                    return True
                return False

            before = time.monotonic()
            kept, idle = counter_session(c), counter_session(c)
            created = time.monotonic()
            assert c.get_session(idle).expires_in_s <= ttl
            wait_until(lambda: time.monotonic() - created > ttl / 2, 10, "half the TTL to pass")
            c.step(kept, {"name": "Observe", "parameters": {}})
            wait_until(lambda: gone(idle), 2 * ttl, "the idle session to expire")
            # Never before its TTL: it was last used after `before`.
            assert time.monotonic() - before > ttl
            # `kept` expires half a TTL after `idle` at the earliest: the step renewed it.
            assert c.get_session(kept).step_index == 1
    finally:
        assert proc.stop() == 0


@pytest.mark.jail
def test_capacity_limit_answers_resource_exhausted_with_retry_hint(
    library: Path, workers: list[CodegymServer]
) -> None:
    proc = start_runtime(library, workers, "--max-sessions", "2")
    try:
        with RuntimeClient(proc.address) as c:
            first, _ = counter_session(c), counter_session(c)
            err = rpc_error(lambda: counter_session(c))
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "session limit" in err.details()
            assert ("retry-after-ms", "1000") in tuple(err.trailing_metadata() or ())
            assert c.close_session(first)
            assert c.step(counter_session(c), {"name": "Observe", "parameters": {}}).observation == "0"
    finally:
        assert proc.stop() == 0


# ---- losing workers ------------------------------------------------------------------------------


@pytest.mark.jail
def test_killing_a_worker_mid_episode_loses_no_session(library: Path) -> None:
    workers = start_workers()
    proc = start_runtime(library, workers)
    hard = [(t["env_id"], t["config"]) for t in sample_tasks() if t["difficulty"] == "hard"][::2]
    expected = in_process(hard)
    progress = [0] * len(hard)
    halfway = threading.Barrier(len(hard) + 1, timeout=60)
    try:
        with RuntimeClient(proc.address, timeout_s=60) as c:

            def play(index: int) -> list[str]:
                env_id, config = hard[index]
                exp = expected[index]
                created = c.create_session(env_id=env_id, config=config)
                seen = [created.observation]
                for i, (action, _) in enumerate(exp["steps"]):
                    if i == min(3, len(exp["steps"]) // 2):
                        halfway.wait()  # every episode is in flight when the worker dies
                    response = c.step(created.session_id, action)
                    assert not response.HasField("error"), response.error
                    seen.append(response.observation)
                    progress[index] += 1
                assert response.reward == 1.0 and response.done
                return seen

            with ThreadPoolExecutor(len(hard)) as pool:
                futures = [pool.submit(play, i) for i in range(len(hard))]
                halfway.wait()
                os.killpg(workers[0].pid, signal.SIGKILL)
                results = [f.result(timeout=120) for f in futures]
            for exp, seen in zip(expected, results, strict=True):
                assert seen == [exp["first"], *(o for _, o in exp["steps"])]
            assert min(progress) > 3

            # Restart the killed worker on its port; then kill a worker while a step runs on it (the
            # other one when both run one): its steps are re-run on the worker left, exactly once.
            port = workers[0].address.rsplit(":", 1)[1]
            workers[0].stop()
            workers[0] = CodegymServer(["serve", "sandbox", "--port", port, "--jails", "1"])
            slow = [counter_session(c) for _ in range(4)]
            with ThreadPoolExecutor(4) as pool:
                pending = [pool.submit(c.step, s, {"name": "Slow", "parameters": {"ms": 1500}}) for s in slow]
                # A step is in flight: a worker's jail runs it (it sleeps in the tool; a jail runs one
                # request at a time, the others wait their turn).
                wait_until(
                    lambda: bool(sleeping_in_jails(*(w.pid for w in workers))), 20, "a Slow step to start"
                )
                victim = 1 if sleeping_in_jails(workers[1].pid) else 0
                os.killpg(workers[victim].pid, signal.SIGKILL)
                done = [f.result(timeout=60) for f in pending]
            assert [(r.observation, r.step_index, r.HasField("error")) for r in done] == [("1", 1, False)] * 4
            workers[victim].stop()
            for _ in range(5):
                response = c.step(slow[0], {"name": "Add", "parameters": {"amount": 1}})
                assert not response.HasField("error")
            assert response.observation == "6" and response.step_index == 6
    finally:
        proc.stop()
        for worker in workers:
            worker.stop()


# ---- codegym up + demo ---------------------------------------------------------------------------


@pytest.mark.jail
def test_codegym_up_and_demo(tmp_path: Path) -> None:
    up = CodegymServer(["up", "--library", str(tmp_path / "lib.db"), "--port", "0", "--jails", "1"])
    try:
        lines = [json.loads(x) for x in (SAMPLES / "trajectories.jsonl").read_text().splitlines()]
        few = tmp_path / "few.jsonl"
        few.write_text("".join(json.dumps(x) + "\n" for x in lines[::9]))
        import subprocess
        import sys

        demo = subprocess.run(
            [
                sys.executable,
                "-m",
                "codegym_cli.cli",
                "demo",
                "--target",
                up.address,
                "--trajectories",
                str(few),
                "--random-episodes",
                "1",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert demo.returncode == 0, demo.stdout + demo.stderr
        assert "Sample_0012_I__SearchInsertEnv" in demo.stdout and "1/1" in demo.stdout
        assert "steps/s" in demo.stdout and "problem" not in demo.stdout
        # Everything `codegym up` runs, down to the processes inside the workers' jails.
        tree = process_tree(up.pid)
        assert count(tree, "serve sandbox") == 2 and count(tree, "serve runtime") == 1, tree
        assert count(tree, "nsjail") == 2 and count(tree, "/sandbox/zygote.py") >= 4, tree  # zygotes + spares
        ports = listening_ports({pid for pid, _ in tree})
        assert len(ports) >= 3, ports  # the runtime and the two workers
    finally:
        assert up.stop() == 0
    assert "codegym up: stopped" in up.text
    # Every process it started is gone, the jailed ones included, and every port it listened on is free.
    assert_all_gone(tree)
    assert wait_for(lambda: all(port_free(p) for p in ports), 5), [p for p in ports if not port_free(p)]


@pytest.mark.jail
def test_codegym_up_restarts_a_killed_worker_and_every_episode_finishes(tmp_path: Path) -> None:
    up = CodegymServer(["up", "--library", str(tmp_path / "lib.db"), "--port", "0", "--jails", "1"])
    try:
        deadline = time.monotonic() + 30
        while "sandbox worker 2 at" not in up.text and time.monotonic() < deadline:
            time.sleep(0.05)
        pid = int(re.search(r"sandbox worker 1 at \S+ \(pid (\d+)\)", up.text).group(1))  # type: ignore[union-attr]
        lines = [json.loads(x) for x in (SAMPLES / "trajectories.jsonl").read_text().splitlines()]
        episodes = [t for t in lines if len(t["steps"]) >= 20][:16]
        killed = threading.Event()

        def play(expected: dict[str, Any]) -> None:
            with RuntimeClient(up.address, timeout_s=60) as c:
                created = c.create_session(env_id=expected["env_id"], config=expected["config"])
                assert created.observation == expected["first"]
                for i, (action, observation) in enumerate(expected["steps"]):
                    if i == 5 and not killed.is_set():
                        killed.set()
                        os.killpg(pid, signal.SIGKILL)
                    response = c.step(created.session_id, action)
                    assert not response.HasField("error"), response.error
                    assert response.observation == observation
                assert response.done and response.reward == 1

        with ThreadPoolExecutor(8) as pool:
            for future in [pool.submit(play, t) for t in episodes]:
                future.result(timeout=120)
        assert killed.is_set()
        deadline = time.monotonic() + 30
        while "sandbox worker 1 back at" not in up.text and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "sandbox worker 1 exited with -9; restarting" in up.text
        assert "sandbox worker 1 back at" in up.text and up.proc.poll() is None
    finally:
        assert up.stop() == 0


@pytest.mark.slow  # over 10 s
def test_library_command_line(tmp_path: Path) -> None:
    import subprocess
    import sys

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "codegym_cli.cli",
                "library",
                *args,
                "--library",
                str(tmp_path / "lib.db"),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )

    broken = tmp_path / "Bad_1_I__BrokenEnv.py"
    broken.write_text("class BrokenEnv(:\n")
    first = cli("import", str(ENV_DIR), str(SAMPLES / "tasks.jsonl"), str(broken))
    assert first.returncode == 0 and "12 added" in first.stdout and "108 new task configs" in first.stdout
    assert "skipped" in first.stderr and "Bad_1_I__BrokenEnv.py" in first.stderr
    again = cli("import", str(ENV_DIR), str(SAMPLES / "tasks.jsonl"), str(broken), "--strict")
    assert again.returncode == 1 and "0 added, 0 updated, 12 unchanged" in again.stdout
    listed = cli("list", "--json")
    rows = [json.loads(x) for x in listed.stdout.splitlines()]
    assert len(rows) == 12 and all(r["tasks"] == 9 for r in rows)
    shown = cli("show", "Sample_0004_I__CountIslandsEnv")
    assert (
        shown.returncode == 0
        and "def GetCell(row: int, col: int):" in shown.stdout
        and "[easy]" in shown.stdout
    )
    missing = cli("show", "Nope_1_I__NoEnv")
    assert missing.returncode == 1 and "no environment" in missing.stderr


def test_a_port_in_use_is_a_clear_error(library: Path) -> None:
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "codegym_cli.cli",
                "serve",
                "runtime",
                "--port",
                port,
                "--library",
                str(library),
                "--sandbox",
                "127.0.0.1:1",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
    assert result.returncode == 1 and f"cannot bind 127.0.0.1:{port}" in result.stderr
    assert "Traceback" not in result.stderr

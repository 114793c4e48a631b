"""The OpenEnv gateway end to end, with the unmodified `openenv` package's clients: a real sandbox
worker (real nsjail), a real runtime serving the sample library, and `codegym serve openenv` in
front of it, all on loopback port 0. Sessions are checked in the runtime itself."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from openenv.core.env_server.mcp_types import ListToolsObservation
from openenv.core.generic_client import GenericEnvClient
from openenv.core.mcp_client import MCPToolClient
from websockets.asyncio.client import connect

from codegym.library import Library
from codegym_cli.oracle import read_trajectories
from codegym_client.errors import SessionNotFound
from codegym_client.runtime_client import RuntimeClient
from tests.conftest import ENV_DIR, EXAMPLES, FIXTURE_ENVS, SHARED_DATA, training_instances
from tests.helpers.openenv_play import play_tool_calls, rows
from tests.helpers.servers import ServerProcess


def wait_true(condition: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Seconds until `condition` held; fails the test after `timeout_s`."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.02)
    return time.monotonic() - start


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("library") / "library.db"
    with Library(path) as lib:
        lib.import_paths(
            [ENV_DIR, EXAMPLES / "tasks.jsonl", FIXTURE_ENVS, SHARED_DATA / "training_instance_sample.jsonl"]
        )
    return path


@pytest.fixture(scope="module")
def runtime(library: Path) -> Iterator[str]:
    worker = ServerProcess(["serve", "sandbox", "--port", "0", "--jails", "2"])
    try:
        rt = ServerProcess(
            ["serve", "runtime", "--port", "0", "--library", str(library), "--sandbox", worker.address]
        )
        try:
            yield rt.address
        finally:
            rt.stop()
    finally:
        worker.stop()


def start_gateway(runtime: str, *extra: str) -> ServerProcess:
    return ServerProcess(["serve", "openenv", "--runtime", runtime, "--port", "0", *extra])


@pytest.fixture(scope="module")
def gateway(runtime: str) -> Iterator[str]:
    proc = start_gateway(runtime)
    try:
        yield f"http://{proc.address}"
    finally:
        assert proc.stop() == 0, proc.text[-3000:]


@pytest.fixture(scope="module")
def runtime_client(runtime: str) -> Iterator[RuntimeClient]:
    with RuntimeClient(runtime, timeout_s=60) as client:
        yield client


def session_gone(client: RuntimeClient, session_id: str) -> bool:
    try:
        client.get_session(session_id)
    except SessionNotFound:
        return True
    return False


def http(url: str, method: str = "GET", body: bytes | None = None) -> tuple[int, Any]:
    request = urllib.request.Request(url, data=body, method=method)
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


async def test_generic_client_plays_rows_to_reward_1(gateway: str) -> None:
    for row, steps in rows(3):
        async with GenericEnvClient(base_url=gateway) as env:
            result = await env.reset(**row)
            assert result.done is False and result.reward is None
            first = result.observation
            assert first["task"] and first["tools_text"]
            names = {t["name"] for t in first["tools"]}
            assert all(t["input_schema"]["type"] == "object" for t in first["tools"])
            for i, (action, expected) in enumerate(steps):
                assert action["name"] in names
                if i % 2:  # OpenEnv's tool call and CodeGym's native action, alternately
                    step = {
                        "type": "call_tool",
                        "tool_name": action["name"],
                        "arguments": action["parameters"],
                    }
                else:
                    step = action
                result = await env.step(step)
                assert result.observation["result"] == expected  # the env's observation, unchanged
                assert result.observation["tool_name"] == action["name"]
                last = i == len(steps) - 1
                assert result.done is last
                assert result.reward == (1.0 if last else None)
                assert result.observation["metadata"]["truncated"] is False
            state = await env.state()
            assert state["step_count"] == len(steps)
            assert state["episode_id"] == first["metadata"]["episode_id"]


async def test_training_instance_row_resets(gateway: str) -> None:
    row = training_instances()[0]
    async with GenericEnvClient(base_url=gateway) as env:
        result = await env.reset(**row, seed=7, episode_id="ep-1")
        assert result.metadata["episode_id"] == "ep-1"
        tools = {t["name"] for t in result.observation["tools"]}
        assert "Observe" in tools and "Done" in tools
        result = await env.step({"type": "call_tool", "tool_name": "Observe", "arguments": {}})
        assert result.observation["error"] is None and result.observation["result"]
        assert (await env.state())["step_count"] == 1


async def test_mcp_tool_client_verifiers_sequence(gateway: str) -> None:
    """schema → list_tools → reset(**row) → steps, the order verifiers uses; summed reward 1."""
    status, schema = http(f"{gateway}/schema")
    assert status == 200 and schema["action"]["title"] == "CallToolAction"
    for row, steps in rows(2):
        async with MCPToolClient(base_url=gateway) as env:
            assert await env.list_tools() == []  # the tools depend on the environment: none before reset
            reset = await env.reset(**row)
            assert isinstance(reset.observation, ListToolsObservation)
            tools = await env.list_tools(use_cache=False)
            assert {t.name for t in tools} >= {a["name"] for a, _ in steps}
            first, expected = steps[0]
            assert await env.call_tool(first["name"], **first["parameters"]) == expected
            assert await play_tool_calls(env, steps[1:]) == 1.0


async def test_second_reset_closes_the_first_session(gateway: str, runtime_client: RuntimeClient) -> None:
    (row1, _), (row2, _) = rows(2)
    async with GenericEnvClient(base_url=gateway) as env:
        first = (await env.reset(**row1)).metadata["session_id"]
        runtime_client.get_session(first)
        second = (await env.reset(**row2)).metadata["session_id"]
        assert second != first
        assert session_gone(runtime_client, first)
        runtime_client.get_session(second)
    wait_true(lambda: session_gone(runtime_client, second), 10, "the closed client's session to close")


async def test_dropped_and_idle_sockets_are_reaped(runtime: str, runtime_client: RuntimeClient) -> None:
    (row, _), *_ = rows(1)
    proc = start_gateway(runtime, "--idle-timeout-s", "2")
    try:
        url = f"ws://{proc.address}/ws"
        # A socket dropped without a close frame (the TCP connection aborted).
        ws = await connect(url)
        await ws.send(json.dumps({"type": "reset", "data": row}))
        dropped = json.loads(await ws.recv())["data"]["metadata"]["session_id"]
        ws.transport.abort()
        await asyncio.to_thread(wait_true, lambda: session_gone(runtime_client, dropped), 5, "drop")
        # A socket that stays open but says nothing: reaped within the idle limit (2 s).
        ws = await connect(url)
        await ws.send(json.dumps({"type": "reset", "data": row}))
        idle = json.loads(await ws.recv())["data"]["metadata"]["session_id"]
        took = await asyncio.to_thread(wait_true, lambda: session_gone(runtime_client, idle), 6, "reap")
        assert took < 5
        said = json.loads(await ws.recv())
        assert said["data"]["code"] == "SESSION_ERROR" and "idle" in said["data"]["message"]
        await ws.close()
    finally:
        assert proc.stop() == 0, proc.text[-3000:]


async def test_over_the_cap_answers_capacity_reached(runtime: str) -> None:
    (row, _), *_ = rows(1)
    proc = start_gateway(runtime, "--max-sessions", "2")
    try:
        base = f"http://{proc.address}"
        held = [GenericEnvClient(base_url=base) for _ in range(2)]
        for env in held:
            await env.connect()
            await env.reset(**row)
        async with GenericEnvClient(base_url=base) as extra:
            with pytest.raises(RuntimeError, match="CAPACITY_REACHED"):
                await extra.reset(**row)
            await held[0].close()
            deadline = time.monotonic() + 10
            while True:  # the closed socket's slot comes back
                try:
                    assert (await extra.reset(**row)).done is False
                    break
                except RuntimeError:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.05)
        await held[1].close()
    finally:
        assert proc.stop() == 0, proc.text[-3000:]


async def test_hostile_messages_get_openenv_errors(gateway: str) -> None:
    (row, steps), *_ = rows(1)
    url = gateway.replace("http://", "ws://") + "/ws"
    cases: list[tuple[str | bytes, str]] = [
        ("not json", "INVALID_JSON"),
        (b"\xff\xfe binary", "INVALID_JSON"),
        ("[1, 2]", "VALIDATION_ERROR"),
        (json.dumps({"type": "dance"}), "UNKNOWN_TYPE"),
        (json.dumps({"data": {}}), "UNKNOWN_TYPE"),
        (json.dumps({"type": "step"}), "VALIDATION_ERROR"),
        (json.dumps({"type": "step", "data": [1]}), "VALIDATION_ERROR"),
        (json.dumps({"type": "step", "data": {"type": "call_tool"}}), "VALIDATION_ERROR"),
        (
            json.dumps({"type": "step", "data": {"type": "call_tool", "tool_name": "X", "arguments": 3}}),
            "VALIDATION_ERROR",
        ),
        (json.dumps({"type": "step", "data": {"name": "Observe", "parameters": {}}}), "SESSION_ERROR"),
        (json.dumps({"type": "reset", "data": {}}), "VALIDATION_ERROR"),
        (json.dumps({"type": "reset", "data": {"seed": -1, "ability": row["ability"]}}), "VALIDATION_ERROR"),
        (json.dumps({"type": "reset", "data": {"env": "Nope_1_I__NoEnv", "config": {}}}), "VALIDATION_ERROR"),
        (json.dumps({"type": "reset", "data": {"ability": "codegym_v1@garbage"}}), "VALIDATION_ERROR"),
        (json.dumps({"type": "step", "data": {"name": "x" * (2 << 20)}}), "VALIDATION_ERROR"),
    ]
    async with connect(url, max_size=None) as ws:
        for message, code in cases:
            await ws.send(message)
            answer = json.loads(await ws.recv())
            assert answer["type"] == "error", (message[:80], answer)
            assert answer["data"]["code"] == code, (message[:80], answer)
        # The same socket still plays.
        await ws.send(json.dumps({"type": "reset", "data": row}))
        assert json.loads(await ws.recv())["type"] == "observation"
        action, expected = steps[0]
        await ws.send(json.dumps({"type": "step", "data": action}))
        assert json.loads(await ws.recv())["data"]["observation"]["result"] == expected
        await ws.send(json.dumps({"type": "step", "data": {"name": "NoSuchTool", "parameters": {}}}))
        answer = json.loads(await ws.recv())["data"]["observation"]
        assert answer["error"]["error_type"] == "tool_not_found" and answer["result"]
    status, health = http(f"{gateway}/health")
    assert status == 200 and health["status"] == "healthy"


def test_http_routes(gateway: str) -> None:
    assert http(f"{gateway}/health") == (200, {"status": "healthy"})
    status, metadata = http(f"{gateway}/metadata")
    assert status == 200 and metadata["name"]
    for route in ("reset", "step"):
        status, body = http(f"{gateway}/{route}", "POST", b"{}")
        assert status == 409 and "WebSocket" in body["error"]
    status, answer = http(f"{gateway}/mcp", "POST", b"{not json")
    assert status == 200 and answer["error"]["code"] == -32700


ONE_ENV = "Sample_0006_I__ArrayGcdEnv"


@pytest.fixture(scope="module")
def one_env_gateway(runtime: str) -> Iterator[str]:
    proc = start_gateway(runtime, "--env", ONE_ENV)
    try:
        yield f"http://{proc.address}"
    finally:
        assert proc.stop() == 0, proc.text[-3000:]


async def test_one_env_gateway_plays_verifiers_openenv_sequence(
    one_env_gateway: str, runtime_client: RuntimeClient
) -> None:
    """verifiers' OpenEnvEnv (MCP mode): connect, list the tools once before any reset (they
    become the prompt's tools for every row), reset with a seed only, then one CallToolAction per
    tool call, the episode's reward being the sum of the step rewards."""
    tasks = [t.config_json for t in runtime_client.get_env(ONE_ENV).tasks]
    recorded = {json.dumps(t["config"], sort_keys=True): t for t in read_trajectories(EXAMPLES / "trajectories.jsonl")
                if t["env_id"] == ONE_ENV and t["reward"] == 1.0}  # fmt: skip
    seed = next(i for i, c in enumerate(tasks) if json.dumps(json.loads(c), sort_keys=True) in recorded)
    trajectory = recorded[json.dumps(json.loads(tasks[seed]), sort_keys=True)]
    async with MCPToolClient(base_url=one_env_gateway) as env:
        tools = await env.list_tools()  # before any reset
        expected = {t.name for t in runtime_client.get_env(ONE_ENV).tools}
        assert {t.name for t in tools} == expected and all(t.input_schema["type"] == "object" for t in tools)
        reset = await env.reset(seed=seed + len(tasks))  # the seed picks the task: seed % count
        assert not reset.done
        steps = [(json.loads(action), observation) for action, observation in trajectory["steps"]]
        assert await play_tool_calls(env, steps) == 1.0
    # Without a seed the task is any of the environment's; a config still names one.
    async with GenericEnvClient(base_url=one_env_gateway) as generic:
        state = await generic.reset()
        assert state.metadata["env_id"] == ONE_ENV
        named = await generic.reset(config=json.loads(tasks[0]))
        session = runtime_client.get_session(named.metadata["session_id"])
        assert session.env_id == ONE_ENV

"""The OpenEnv gateway end to end, with the unmodified `openenv` package's clients: a real sandbox
worker (real nsjail), a real runtime serving the sample library, and `codegym serve openenv` in
front of it, all on loopback port 0. Sessions are checked in the runtime itself."""

from __future__ import annotations

import asyncio
import json
import random
import re
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openenv.core.env_server.mcp_types import CallToolAction, ListToolsObservation
from openenv.core.generic_client import GenericEnvClient
from openenv.core.mcp_client import MCPToolClient
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from codegym.procs import codegym_command
from codegym_client.errors import SessionNotFound
from codegym_client.runtime_client import RuntimeClient
from codegym_jobs.oracle import read_trajectories
from codegym_testkit.waiting import wait_until
from tests.conftest import ENV_DIR, FIXTURE_ENVS, SAMPLES, SHARED_DATA, training_instances
from tests.helpers.libraries import library_fixture
from tests.helpers.openenv_play import play_tool_calls, rows
from tests.helpers.servers import CodegymServer, workers_fixture

pytestmark = pytest.mark.jail  # every test here starts a sandbox worker


library = library_fixture(
    [ENV_DIR, SAMPLES / "tasks.jsonl", FIXTURE_ENVS, SHARED_DATA / "training_instance_sample.jsonl"]
)
worker = workers_fixture(1, jails=2, addresses=True, clean_stop=False)


def start_runtime(library: Path, worker: str, *extra: str) -> CodegymServer:
    return CodegymServer(
        ["serve", "runtime", "--port", "0", "--library", str(library), "--sandbox", worker, *extra]
    )


@pytest.fixture(scope="module")
def runtime(library: Path, worker: str) -> Iterator[str]:
    rt = start_runtime(library, worker)
    try:
        yield rt.address
    finally:
        rt.stop()


def start_gateway(runtime: str, *extra: str) -> CodegymServer:
    return CodegymServer(["serve", "openenv", "--runtime", runtime, "--port", "0", *extra])


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
    wait_until(lambda: session_gone(runtime_client, second), 10, "the closed client's session to close")


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
        await asyncio.to_thread(wait_until, lambda: session_gone(runtime_client, dropped), 5, "drop")
        # A socket that stays open but says nothing: reaped within the idle limit (2 s).
        ws = await connect(url)
        await ws.send(json.dumps({"type": "reset", "data": row}))
        idle = json.loads(await ws.recv())["data"]["metadata"]["session_id"]
        took = await asyncio.to_thread(wait_until, lambda: session_gone(runtime_client, idle), 6, "reap")
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


async def test_closes_in_flight_never_count_against_new_sessions(
    runtime: str, runtime_client: RuntimeClient
) -> None:
    """Issue #31: 1,024 OpenEnv clients, each closing its socket and at once opening the next
    episode's, drew CAPACITY_REACHED while their closes were in flight. Here `--max-sessions`
    clients hold an episode each, then all close and open the next at once, round after round: no
    refusal, and every closed session is gone from the runtime."""
    (row, _), *_ = rows(1)
    limit = 16
    proc = start_gateway(runtime, "--max-sessions", str(limit))
    try:
        url = f"ws://{proc.address}/ws"
        opened: list[str] = []
        held: list[ClientConnection] = []
        for _ in range(6):
            await asyncio.gather(*(ws.close() for ws in held))
            held = list(await asyncio.gather(*(connect(url) for _ in range(limit))))
            answers = await asyncio.gather(*(reset_on(ws, row) for ws in held))
            assert [a["type"] for a in answers] == ["observation"] * limit, [
                a["data"] for a in answers if a["type"] == "error"
            ]
            opened += [a["data"]["metadata"]["session_id"] for a in answers]
        await asyncio.gather(*(ws.close() for ws in held))
        await asyncio.to_thread(
            wait_until,
            lambda: all(session_gone(runtime_client, s) for s in opened),
            20,
            "every closed session to be gone",
        )
    finally:
        assert proc.stop() == 0, proc.text[-3000:]


async def test_the_default_limit_is_the_runtimes_session_cap(library: Path, worker: str) -> None:
    """No `--max-sessions`: the gateway keeps no cap of its own, and the runtime's (here 2) answers
    as CAPACITY_REACHED, retryable, with the runtime's reason and hint."""
    (row, _), *_ = rows(1)
    rt = start_runtime(library, worker, "--max-sessions", "2", "--no-record")
    proc = start_gateway(rt.address)
    try:
        url = f"ws://{proc.address}/ws"
        held = [await connect(url) for _ in range(3)]
        answers = [await reset_on(ws, row) for ws in held]
        assert [a["type"] for a in answers] == ["observation", "observation", "error"], answers
        refused = answers[-1]["data"]
        assert refused["code"] == "CAPACITY_REACHED" and refused["reason"] == "CAPACITY", refused
        assert refused["retryable"] is True and "session limit reached (2 open)" in refused["message"]
        await held[0].close()  # its slot comes back once the runtime has closed it
        deadline = time.monotonic() + 10
        while (answer := await reset_on(held[2], row))["type"] != "observation":
            assert time.monotonic() < deadline, answer
            await asyncio.sleep(0.05)
        for ws in held[1:]:
            await ws.close()
    finally:
        assert proc.stop() == 0, proc.text[-3000:]
        assert rt.stop() == 0, rt.text[-3000:]


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


def recorded_seeds(runtime_client: RuntimeClient, env_id: str) -> dict[int, dict[str, Any]]:
    """The `seed`s a one-environment gateway plays a recorded oracle episode of (a seed picks the
    task config number seed % count), with the recorded trajectory."""
    tasks = [t.config_json for t in runtime_client.get_env(env_id).tasks]
    recorded = {
        json.dumps(t["config"], sort_keys=True): t
        for t in read_trajectories(SAMPLES / "trajectories.jsonl")
        if t["env_id"] == env_id and t["reward"] == 1.0
    }
    keys = [json.dumps(json.loads(c), sort_keys=True) for c in tasks]
    return {i: recorded[key] for i, key in enumerate(keys) if key in recorded}


async def test_one_env_gateway_plays_mcp_tool_client_sequence(
    one_env_gateway: str, runtime_client: RuntimeClient
) -> None:
    """OpenEnv's MCPToolClient against a one-environment gateway (the older verifiers OpenEnvEnv,
    in MCP mode): list the tools once before any reset, reset with a seed only, then one
    CallToolAction per tool call, the episode's reward being the sum of the step rewards."""
    tasks = [t.config_json for t in runtime_client.get_env(ONE_ENV).tasks]
    seed, trajectory = next(iter(recorded_seeds(runtime_client, ONE_ENV).items()))
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


# verifiers 0.4's OpenEnvEnv (`verifiers.v1.tasksets.openenv`, `pip install 'verifiers[openenv]'`),
# mirrored call for call without installing verifiers: its `run` opens a GenericEnvClient on the
# taskset's `base_url`, GETs /schema, and when the action is titled CallToolAction (ours is) steps
# {"type": "list_tools"} BEFORE the reset, every episode, for the tools it offers the model
# (`available_tools` in the action schema of every user turn); then `reset(**resets[i])`; then each
# model reply, parsed by `parse_action`, is one `step`, the rewards summed until `done`.


def verifiers_parse_action(message: str, action_schema: dict[str, Any]) -> dict[str, Any]:
    """verifiers.v1.tasksets.openenv.taskset.parse_action (0.4.0), as it is."""
    message = message.strip()
    if message.startswith("```") and message.endswith("```"):
        message = "\n".join(message.splitlines()[1:-1]).strip()
    try:
        action = json.loads(message)
    except json.JSONDecodeError:
        action = message
    if isinstance(action, dict):
        return action
    required = action_schema.get("required", [])
    if len(required) != 1:
        raise ValueError("non-object actions require exactly one required field")
    return {required[0]: action}


async def verifiers_episode(
    base_url: str, reset: dict[str, Any], replies: list[str]
) -> tuple[list[dict[str, Any]], float, bool, list[dict[str, Any]]]:
    """One task of verifiers' OpenEnvEnv.run, the model's replies given: (the tools it offered the
    model, the summed reward, whether the episode ended, the observations it showed the model)."""
    client = GenericEnvClient(base_url=base_url)
    total = 0.0
    shown: list[dict[str, Any]] = []
    async with client:
        http_base = client._base_url.replace("ws://", "http://", 1).replace("wss://", "https://", 1)
        status, schema = await asyncio.to_thread(http, f"{http_base}/schema")
        assert status == 200
        action_schema = schema["action"]
        tools: list[dict[str, Any]] = []
        if action_schema.get("title") in {"Action", "CallToolAction", "ListToolsAction"}:
            result = await client.step({"type": "list_tools"})
            tools = result.observation["tools"]
            action_schema = CallToolAction.model_json_schema() | {"available_tools": tools}
        result = await client.reset(**reset)
        # The user turn: {"observation", "action_schema"} as JSON (it must serialize).
        shown.append(
            json.loads(json.dumps({"observation": result.observation, "action_schema": action_schema}))
        )
        for reply in replies:
            if result.done:
                break
            result = await client.step(verifiers_parse_action(reply, action_schema))
            total += result.reward or 0.0
            if result.done:
                break
            shown.append({"observation": result.observation})
    return tools, total, bool(result.done), shown


def model_replies(trajectory: dict[str, Any]) -> list[str]:
    """A recorded oracle episode as the model's replies: CallToolAction JSON, one per step (the
    second fenced, as models often answer)."""
    replies = []
    for i, (action, _) in enumerate(trajectory["steps"]):
        parsed = json.loads(action)
        call = {"type": "call_tool", "tool_name": parsed["name"], "arguments": parsed["parameters"]}
        text = json.dumps(call)
        replies.append(f"```json\n{text}\n```" if i == 1 else text)
    return replies


async def test_verifiers_openenv_env_plays_a_one_env_gateway_to_reward_1(
    one_env_gateway: str, gateway: str, runtime_client: RuntimeClient
) -> None:
    """docs/trainers/verifiers.md's configuration: `[env.taskset] id = "openenv"`, `base_url` a
    `codegym serve openenv --env ENV_ID` gateway, `resets = [{seed = ...}, ...]`."""
    env_tools = {t.name for t in runtime_client.get_env(ONE_ENV).tools}
    seeds = recorded_seeds(runtime_client, ONE_ENV)
    count = len(runtime_client.get_env(ONE_ENV).tasks)
    played = 0
    for seed, trajectory in list(seeds.items())[:3]:
        for reset in ({"seed": seed}, {"seed": seed + count}):  # seed % count: the same task
            tools, total, done, shown = await verifiers_episode(
                one_env_gateway, reset, model_replies(trajectory)
            )
            assert {t["name"] for t in tools} == env_tools  # offered to the model before the reset
            assert all(t["input_schema"]["type"] == "object" for t in tools)
            assert shown[0]["observation"]["observation"] == trajectory["first"]
            assert done and total == 1.0, (seed, total)
            played += 1
    assert played >= 2
    # verifiers' default `resets = [{}]`: any one of the environment's tasks.
    tools, _, _, shown = await verifiers_episode(one_env_gateway, {}, [])
    assert tools and shown[0]["observation"]["metadata"]["env_id"] == ONE_ENV
    # The multi-environment gateway cannot know the tools before the reset: the model would be
    # offered none (why verifiers needs one gateway per environment).
    row, _ = rows(1)[0]
    tools, _, _, shown = await verifiers_episode(gateway, row, [])
    assert tools == [] and shown[0]["observation"]["tools"]


# The session count and a rolling update ------------------------------------------------------


def metrics_address(proc: CodegymServer) -> str:
    wait_until(lambda: re.search(r"metrics on (127\.0\.0\.1:\d+)", proc.text) is not None, 10, "metrics")
    found = re.search(r"metrics on (127\.0\.0\.1:\d+)", proc.text)
    assert found is not None
    return found.group(1)


def sessions_gauge(address: str) -> float:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    found = re.search(r"^codegym_openenv_sessions_open (\S+)$", text, re.MULTILINE)
    assert found is not None, text[:2000]
    return float(found.group(1))


def mcp_call(base: str, method: str, params: dict[str, Any]) -> dict[str, Any]:
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": method, "params": params}).encode()
    status, answer = http(f"{base}/mcp", "POST", body)
    assert status == 200, answer
    return answer


async def reset_on(ws: ClientConnection, row: dict[str, Any]) -> dict[str, Any]:
    await ws.send(json.dumps({"type": "reset", "data": row}))
    return json.loads(await ws.recv())


async def test_concurrent_close_and_tool_call_keep_the_session_count(
    runtime: str, runtime_client: RuntimeClient
) -> None:
    """A production-mode MCP session (HTTP token, socket attached, reset on the socket) closed
    while an HTTP `tools/call` steps it, many times and many ways: the gauge never goes below
    zero or above the limit and settles on the sessions really open in the runtime; then
    `--max-sessions N` admits N sessions and refuses the next with CAPACITY_REACHED."""
    (row, steps), *_ = rows(1)
    limit = 3
    proc = start_gateway(runtime, "--max-sessions", str(limit), "--metrics-port", "0")
    try:
        base, url = f"http://{proc.address}", f"ws://{proc.address}/ws"
        metrics = metrics_address(proc)
        kept = await connect(url)  # one session open throughout
        kept_session = (await reset_on(kept, row))["data"]["metadata"]["session_id"]
        action = steps[0][0]
        raced: list[str] = []
        seen: list[float] = []
        rng = random.Random(25)
        for i in range(40):
            token = (await asyncio.to_thread(mcp_call, base, "openenv/session/create", {}))["result"][
                "session_id"
            ]
            ws = await connect(f"{url}?session_id={token}")
            raced.append((await reset_on(ws, row))["data"]["metadata"]["session_id"])
            call = {"name": action["name"], "arguments": action["parameters"], "session_id": token}
            calls = [asyncio.to_thread(mcp_call, base, "tools/call", call) for _ in range(1 + i % 2)]

            async def close(how: int = i % 4, ws: ClientConnection = ws, token: str = token) -> None:
                await asyncio.sleep(rng.uniform(0, 0.004))
                if how == 1:  # OpenEnv's MCP close first (the session then closes with its socket)
                    await asyncio.to_thread(mcp_call, base, "openenv/session/close", {"session_id": token})
                if how == 2:  # the socket dropped without a close frame
                    ws.transport.abort()
                    return
                if how == 3:  # a close message
                    await ws.send(json.dumps({"type": "close"}))
                await ws.close()

            finished = await asyncio.gather(*calls, close())
            for answer in finished[:-1]:  # a step's result, or a session error: never a crash
                assert isinstance(answer, dict) and ("result" in answer or "error" in answer), answer
            seen.append(await asyncio.to_thread(sessions_gauge, metrics))
        assert min(seen) >= 0 and max(seen) <= limit, seen

        def settled() -> bool:
            return sessions_gauge(metrics) == 1 and all(session_gone(runtime_client, s) for s in raced)

        await asyncio.to_thread(wait_until, settled, 10, "the count to settle on the one open session")
        runtime_client.get_session(kept_session)  # the one the count says is open is open
        await kept.close()
        await asyncio.to_thread(wait_until, lambda: sessions_gauge(metrics) == 0, 10, "the count to reach 0")

        # N + 1 open attempts, one after another: the last refused, the others fine.
        held = [await connect(url) for _ in range(limit + 1)]
        answers = [await reset_on(ws, row) for ws in held]
        assert [a["type"] for a in answers] == ["observation"] * limit + ["error"], answers
        assert answers[-1]["data"]["code"] == "CAPACITY_REACHED"
        assert answers[-1]["data"]["max_sessions"] == limit
        assert await asyncio.to_thread(sessions_gauge, metrics) == limit
        for ws in held:
            await ws.close()
        await asyncio.to_thread(wait_until, lambda: sessions_gauge(metrics) == 0, 10, "the count to reach 0")
        # ... and all at once: exactly one refused.
        held = [await connect(url) for _ in range(limit + 1)]
        answers = await asyncio.gather(*(reset_on(ws, row) for ws in held))
        assert sorted(a["type"] for a in answers) == ["error"] + ["observation"] * limit, answers
        assert [a["data"]["code"] for a in answers if a["type"] == "error"] == ["CAPACITY_REACHED"]
        for ws in held:
            await ws.close()
        await asyncio.to_thread(wait_until, lambda: sessions_gauge(metrics) == 0, 10, "the count to reach 0")
    finally:
        assert proc.stop() == 0, proc.text[-3000:]


async def step_on(ws: ClientConnection, action: dict[str, Any]) -> dict[str, Any]:
    await ws.send(json.dumps({"type": "step", "data": action}))
    return json.loads(await ws.recv())


async def test_sigterm_lets_open_episodes_finish(runtime: str, runtime_client: RuntimeClient) -> None:
    """A rolling update: after SIGTERM the gateway refuses new sockets and episodes (/health 503),
    an open episode steps to its end, one left unfinished is closed (told why, close code 1012)
    when `--grace-s` runs out, and the process exits 0 soon after."""
    (row, steps), *_ = rows(1)
    grace = 6.0
    proc = start_gateway(runtime, "--grace-s", str(grace))
    try:
        base, url = f"http://{proc.address}", f"ws://{proc.address}/ws"
        playing, idle = await connect(url), await connect(url)
        sessions = [(await reset_on(ws, row))["data"]["metadata"]["session_id"] for ws in (playing, idle)]
        half = len(steps) // 2
        for action, expected in steps[:half]:
            assert (await step_on(playing, action))["data"]["observation"]["result"] == expected
        start = time.monotonic()
        proc.proc.send_signal(signal.SIGTERM)
        await asyncio.to_thread(
            wait_until, lambda: http(f"{base}/health")[0] == 503, 3, "/health to say draining"
        )
        assert http(f"{base}/health") == (503, {"status": "draining"})
        # Liveness stays green: a draining gateway is not a hung one.
        assert http(f"{base}/live") == (200, {"status": "draining"})
        with pytest.raises(InvalidStatus) as refused:
            await connect(url)
        assert refused.value.response.status_code == 503
        # The open episode steps to its end.
        for i, (action, expected) in enumerate(steps[half:]):
            answer = (await step_on(playing, action))["data"]
            assert answer["observation"]["result"] == expected
            assert answer["done"] is (half + i == len(steps) - 1)
        assert answer["reward"] == 1.0
        # A new episode on the same socket is refused: the client goes to another replica.
        refusal = (await reset_on(playing, row))["data"]
        assert refusal["code"] == "CAPACITY_REACHED" and refusal["reason"] == "DRAINING", refusal
        # The idle socket's episode never ends: closed when the grace runs out, told why.
        said = json.loads(await asyncio.wait_for(idle.recv(), grace + 5))
        took = time.monotonic() - start
        assert said["type"] == "error" and "shutting down" in said["data"]["message"], said
        assert grace - 0.5 <= took <= grace + 3, took
        with pytest.raises(ConnectionClosed):
            await idle.recv()
        assert idle.close_code == 1012
        code = await asyncio.to_thread(proc.proc.wait, 15)
        exited = time.monotonic() - start
        assert code == 0 and exited <= grace + 5, (code, exited, proc.text[-3000:])
        assert all(session_gone(runtime_client, s) for s in sessions)
        assert "Traceback" not in proc.text and "grace of 6 s over: closing 1 episodes" in proc.text, (
            proc.text
        )
    finally:
        proc.stop()

    # Episodes that all end before the grace: the gateway exits then, not at the end of the grace.
    proc = start_gateway(runtime)  # the default grace: 30 s
    try:
        url = f"ws://{proc.address}/ws"
        async with connect(url) as ws:
            await reset_on(ws, row)
            start = time.monotonic()
            proc.proc.send_signal(signal.SIGTERM)
            for action, expected in steps:
                assert (await step_on(ws, action))["data"]["observation"]["result"] == expected
        code = await asyncio.to_thread(proc.proc.wait, 35)
        assert code == 0 and time.monotonic() - start < 5, (code, time.monotonic() - start)
    finally:
        proc.stop()


async def test_codegym_up_starts_one_gateway_per_environment(tmp_path: Path) -> None:
    """`codegym up --openenv-env ENV_ID[=PORT]`: one `--env` gateway per environment, each on its
    own port and printed with its address, each offering its environment's tools before a reset
    (verifiers' sequence); an environment the library lacks stops `up` with a message."""
    other = "Sample_0001_I__MaxSubarraySumEnv"
    library = tmp_path / "lib.db"
    args = [
        "up",
        "--library",
        str(library),
        "--port",
        "0",
        "--workers",
        "1",
        "--jails",
        "1",
        "--openenv-env",
        ONE_ENV,
        "--openenv-env",
        other,
    ]
    up = CodegymServer(args, timeout=120)
    try:
        await asyncio.to_thread(wait_until, lambda: "Ctrl-C stops everything" in up.text, 60, "codegym up")
        urls = dict(re.findall(r"openenv gateway (\S+): OpenEnv base_url (http://\S+)", up.text))
        assert set(urls) == {ONE_ENV, other}, up.text
        assert len(set(urls.values())) == 2
        with RuntimeClient(up.address, timeout_s=60) as client:
            for env_id, url in urls.items():
                tools, _, done, shown = await verifiers_episode(url, {"seed": 0}, [])
                assert {t["name"] for t in tools} == {t.name for t in client.get_env(env_id).tools}
                assert shown[0]["observation"]["metadata"]["env_id"] == env_id and not done
    finally:
        assert up.stop() == 0, up.text[-3000:]
    proc = await asyncio.create_subprocess_exec(
        *codegym_command(
            ["up", "--library", str(library), "--port", "0", "--openenv-env", "Nope_1_I__NoEnv"]
        ),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    said, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode != 0 and b"'Nope_1_I__NoEnv' is not in the library" in said, said

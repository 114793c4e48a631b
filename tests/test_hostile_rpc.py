"""Hostile input on every runtime RPC, the clients' typed errors, and `codegym demo` with no runtime.

Every answer to a hostile request must be a clear, typed one: a step error for a step the runtime
cannot read (the session unchanged), INVALID_ARGUMENT or NOT_FOUND for any other request, never
gRPC's UNKNOWN and never a Python exception's text. Real sandbox workers and a real runtime process
on loopback, as in test_runtime.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import pickle
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from codegym.server.auth import TRAINER, Identity, write_tokens
from codegym.server.grpcutil import ManagedServer
from codegym_client import (
    AsyncRuntimeClient,
    CapacityExceeded,
    CodeGymError,
    EnvFailed,
    EnvNotFound,
    InvalidRequest,
    RuntimeClient,
    RuntimeUnavailable,
    SessionDone,
    SessionNotFound,
)
from codegym_client.api.runtime.v1 import runtime_service_pb2 as rt
from codegym_client.channels import TOKEN_ENV
from services.dispatcher import SandboxDispatcher
from services.runtime.catalog import Catalog
from services.runtime.config import RuntimeConfig
from services.runtime.service import SERVICE_NAME, RuntimeServicer, add_to_server
from services.runtime.sessions import InMemorySessionStore, Session
from tests import test_runtime as base
from tests.conftest import ROOT, SAMPLES
from tests.helpers.servers import CodegymServer, workers_fixture

COUNTER = base.COUNTER
INVALID_ACTION = rt.STEP_ERROR_CODE_INVALID_ACTION
UNKNOWN_TOOL = rt.STEP_ERROR_CODE_UNKNOWN_TOOL
TWO_MB = 2 * 1024 * 1024
HOSTILE_TOKEN = "hostile-trainer-token"
DEEP = 5000
OBSERVE = '{"name": "Observe", "parameters": {}}'
PYTHON_TEXT = ("Traceback", "Unexpected <class", 'File "', "RecursionError", "DecodeError")

# The library of test_runtime (sample envs + the counter); our own worker and runtime processes.
library = base.library
workers = workers_fixture(1)


@pytest.fixture(scope="module", params=["open", "tokens"])
def runtime(
    request: pytest.FixtureRequest,
    library: Path,
    workers: list[CodegymServer],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[CodegymServer]:
    """The runtime process every hostile request goes to: open, and again taking access tokens
    (issue #31: auth must not change a single answer to hostile input), the test's clients then
    carrying a trainer's token."""
    if request.param == "open":
        proc = base.start_runtime(library, workers)
        yield proc
    else:
        tokens = tmp_path_factory.mktemp("hostile-tokens") / "tokens.json"
        write_tokens(tokens, {HOSTILE_TOKEN: Identity("hostile", TRAINER)})
        proc = base.start_runtime(library, workers, "--tokens", str(tokens))
        with pytest.MonkeyPatch.context() as env:
            env.setenv(TOKEN_ENV, HOSTILE_TOKEN)
            yield proc
    assert proc.stop() == 0
    # No hostile request reached the last line of defence (an unexpected exception in the servicer).
    assert "ERROR services.runtime." not in proc.text, proc.text[-3000:]


@pytest.fixture(scope="module")
def client(runtime: CodegymServer) -> Iterator[RuntimeClient]:
    with RuntimeClient(runtime.address, timeout_s=60) as c:
        yield c


def nested(depth: int, inner: str = "") -> str:
    return "[" * depth + inner + "]" * depth


def nested_object(depth: int) -> str:
    return '{"a": ' * depth + "1" + "}" * depth


def assert_clear(code: Any, details: str, expected: grpc.StatusCode) -> None:
    """A typed status with a short message a user can read (no Python internals)."""
    value = code.value[0] if isinstance(code, grpc.StatusCode) else code
    assert value == expected.value[0], (code, details[:300])
    assert value not in (grpc.StatusCode.UNKNOWN.value[0], grpc.StatusCode.INTERNAL.value[0])
    assert not any(t in details for t in PYTHON_TEXT), details[:300]
    assert len(details.encode()) <= 1200, len(details)


def refused(call: Any, *args: Any) -> CodeGymError:
    with pytest.raises(CodeGymError) as info:
        call(*args)
    return info.value


def counter_session(client: RuntimeClient, **options: Any) -> str:
    return client.create_session(env_id=COUNTER, config={"target": 3}, **options).session_id


def closed_port() -> socket.socket:
    """A loopback port held (bound, not listening): connecting to it is refused, deterministically."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


# ---- hostile actions ------------------------------------------------------------------------------

# Hostile `parameters` (the JSON text), sent both inside an action_json and as a structured ToolCall.
HOSTILE_PARAMETERS: list[tuple[str, str]] = [
    ("deep list", nested(DEEP)),
    ("deep object", nested_object(DEEP)),
    ("deep list in an object", '{"a": ' + nested(DEEP) + "}"),
    ("150 levels (parses, too deep)", '{"a": ' + nested(150) + "}"),
    ("5000-digit integer", '{"a": ' + "9" * 5000 + "}"),
    ("2 MB string", '{"a": "' + "x" * TWO_MB + '"}'),
    ("raw null byte", '{"a": "\x00"}'),
    ("lone surrogate escape", '{"a": "\\ud800"}'),
    ("escaped null byte, not an object", '"\\u0000"'),
    ("truncated", '{"a": '),
]
# Hostile whole actions (action_json only) and tool names (ToolCall only): (label, text, step error).
HOSTILE_ACTIONS: list[tuple[str, str, int]] = [
    ("deep list action", nested(DEEP), INVALID_ACTION),
    ("deep name", '{"name": ' + nested(DEEP) + "}", INVALID_ACTION),
    (
        "deep one-call list",
        nested(1, '{"name": "Observe", "parameters": ' + nested(DEEP) + "}"),
        INVALID_ACTION,
    ),
    ("empty", "", INVALID_ACTION),
    ("null byte", "\x00", INVALID_ACTION),
    ("binary junk", "\x00\x01\xff\ufffe" * 64, INVALID_ACTION),
    ("name not a string", '{"name": ["Observe"], "parameters": {}}', INVALID_ACTION),
    ("2 MB name", '{"name": "' + "N" * TWO_MB + '", "parameters": {}}', INVALID_ACTION),
    ("null byte in the name", '{"name": "Observe\\u0000", "parameters": {}}', UNKNOWN_TOOL),
    ("lone surrogate name", '{"name": "\\udc80", "parameters": {}}', UNKNOWN_TOOL),
]
HOSTILE_TOOL_NAMES: list[tuple[str, str, int]] = [
    ("empty name", "", UNKNOWN_TOOL),
    ("null byte name", "Observe\x00", UNKNOWN_TOOL),
    ("2 MB name", "N" * TWO_MB, INVALID_ACTION),
    ("name with JSON in it", OBSERVE, UNKNOWN_TOOL),
]


def hostile_steps() -> list[tuple[str, str | rt.ToolCall, int]]:
    steps: list[tuple[str, str | rt.ToolCall, int]] = []
    for label, parameters in HOSTILE_PARAMETERS:
        steps.append(
            (f"json: {label}", '{"name": "Observe", "parameters": ' + parameters + "}", INVALID_ACTION)
        )
        steps.append(
            (f"tool_call: {label}", rt.ToolCall(name="Observe", parameters_json=parameters), INVALID_ACTION)
        )
    steps += [(f"json: {label}", text, code) for label, text, code in HOSTILE_ACTIONS]
    steps += [
        (f"tool_call: {label}", rt.ToolCall(name=name, parameters_json="{}"), code)
        for label, name, code in HOSTILE_TOOL_NAMES
    ]
    return steps


HOSTILE_STEPS = hostile_steps()


def assert_step_error(response: rt.StepResponse, code: int, step_index: int) -> None:
    assert response.HasField("error") and response.error.code == code, response.error
    assert response.observation == response.error.message
    assert not any(t in response.error.message for t in PYTHON_TEXT), response.error.message[:300]
    assert len(response.error.message.encode()) <= 1200
    assert response.step_index == step_index and not response.done


@pytest.mark.jail
@pytest.mark.parametrize(("label", "action", "code"), HOSTILE_STEPS, ids=[s[0] for s in HOSTILE_STEPS])
def test_a_hostile_step_is_a_typed_step_error_and_changes_nothing(
    client: RuntimeClient, label: str, action: str | rt.ToolCall, code: int
) -> None:
    session = counter_session(client)
    assert client.step(session, '{"name": "Add", "parameters": {"amount": 2}}').observation == "2"
    assert_step_error(client.step(session, action), code, step_index=1)
    after = client.step(session, OBSERVE)
    assert (after.observation, after.step_index, after.HasField("error")) == ("2", 2, False)
    assert client.close_session(session)


def trajectory() -> dict[str, Any]:
    """A recorded oracle trajectory of moderate length (from codegym/samples/trajectories.jsonl)."""
    lines = [json.loads(x) for x in (SAMPLES / "trajectories.jsonl").read_text().splitlines() if x.strip()]
    return next(t for t in lines if 8 <= len(t["steps"]) <= 14)


@pytest.mark.jail
async def test_hostile_steps_through_step_batch_and_stream_leave_a_trajectory_intact(
    runtime: CodegymServer,
) -> None:
    """Between every two steps of a recorded trajectory, hostile steps by Step, BatchStep and
    StepStream: each is a typed error, and the episode plays exactly as a fresh replay does."""
    expected = trajectory()
    async with AsyncRuntimeClient(runtime.address, timeout_s=60) as client:
        fresh = await client.create_session(env_id=expected["env_id"], config=expected["config"])
        replayed = [fresh.observation]
        for action, _ in expected["steps"]:
            replayed.append((await client.step(fresh.session_id, action)).observation)
        await client.close_session(fresh.session_id)

        created = await client.create_session(env_id=expected["env_id"], config=expected["config"])
        sid = created.session_id
        seen = [created.observation]
        stream = client.step_stream()
        for i, (action, _) in enumerate(expected["steps"]):
            label, hostile, code = HOSTILE_STEPS[i % len(HOSTILE_STEPS)]
            assert_step_error(await client.step(sid, hostile), code, step_index=i)
            _, batch_hostile, batch_code = HOSTILE_STEPS[(i + 7) % len(HOSTILE_STEPS)]
            (entry,) = await client.batch_step([(sid, batch_hostile)])
            assert entry.code == 0, entry.message
            assert_step_error(entry.response, batch_code, step_index=i)
            _, stream_hostile, stream_code = HOSTILE_STEPS[(i + 13) % len(HOSTILE_STEPS)]
            await stream.send(sid, stream_hostile, tag=f"hostile {i}")
            answer = await stream.recv()
            assert answer is not None and answer.code == 0 and answer.tag == f"hostile {i}", label
            assert_step_error(answer.response, stream_code, step_index=i)
            response = await client.step(sid, action)
            assert not response.HasField("error"), response.error
            seen.append(response.observation)
        await stream.done_sending()
        assert await stream.recv() is None
        assert response.done and response.reward == 1.0 == expected["reward"]
        view = await client.get_session(sid)
        assert (view.step_index, view.status) == (len(expected["steps"]), rt.SESSION_STATUS_DONE)
        await client.close_session(sid)
    assert seen == replayed == [expected["first"], *(o for _, o in expected["steps"])]


# ---- hostile requests to the other RPCs -----------------------------------------------------------

NOT_FOUND = grpc.StatusCode.NOT_FOUND
INVALID = grpc.StatusCode.INVALID_ARGUMENT
# Configs the environment's own parser reads (NaN, Infinity: Python's json accepts them) reach it;
# CounterEnv's reset() then refuses them itself (int(nan)), which is the environment failing.
ENV_FAILED = grpc.StatusCode.FAILED_PRECONDITION
ABILITY = f"codegym_v1@{COUNTER}@"

HOSTILE_CREATES: list[tuple[str, dict[str, Any], grpc.StatusCode]] = [
    ("ability: deep config", {"ability": ABILITY + '{"target": ' + nested(DEEP) + "}"}, INVALID),
    ("ability: deep Python literal", {"ability": ABILITY + "{'target': " + nested(DEEP) + "}"}, INVALID),
    ("ability: 150-deep config", {"ability": ABILITY + '{"target": ' + nested(150) + "}"}, INVALID),
    ("ability: NaN", {"ability": ABILITY + '{"target": NaN}'}, ENV_FAILED),
    ("ability: Infinity", {"ability": ABILITY + '{"target": Infinity}'}, ENV_FAILED),
    ("ability: 1e999 literal", {"ability": ABILITY + "{'target': 1e999}"}, ENV_FAILED),
    ("ability: 5000-digit integer", {"ability": ABILITY + '{"target": ' + "9" * 5000 + "}"}, INVALID),
    ("ability: set literal", {"ability": ABILITY + "{'target': {1, 2}}"}, INVALID),
    ("ability: bytes literal", {"ability": ABILITY + "{'target': b'\\xff'}"}, INVALID),
    ("ability: lone surrogate", {"ability": ABILITY + '{"target": "\\ud800"}'}, INVALID),
    ("ability: null bytes", {"ability": "codegym_v1@\x00__\x00Env@{}"}, INVALID),
    ("ability: 2 MB prefix", {"ability": "x" * TWO_MB + "@"}, INVALID),
    ("ability: 2 MB env id", {"ability": f"codegym_v1@Nope_1_I__{'N' * TWO_MB}Env@{{}}"}, NOT_FOUND),
    ("ability: 2 MB bad config", {"ability": ABILITY + "{" * TWO_MB}, INVALID),
    ("ability: binary", {"ability": "\x00\x01\x02\xff\ufffe" * 1000}, INVALID),
    ("env_str: deep config", {"env_str": 'CounterEnv@{"target": ' + nested(DEEP) + "}"}, INVALID),
    ("env_str: NaN", {"env_str": 'CounterEnv@{"target": NaN}'}, ENV_FAILED),
    ("env_str: -Infinity", {"env_str": 'CounterEnv@{"target": -Infinity}'}, ENV_FAILED),
    ("env_str: 2 MB class", {"env_str": "E" * TWO_MB + "@{}"}, NOT_FOUND),
    ("env_str: null byte class", {"env_str": "Counter\x00Env@{}"}, INVALID),
    ("env_str: unknown class", {"env_str": "NoSuchEnv@{}"}, NOT_FOUND),
    ("env_id + deep config", {"env_id": COUNTER, "config": '{"target": ' + nested(DEEP) + "}"}, INVALID),
    ("env_id + deep object", {"env_id": COUNTER, "config": nested_object(DEEP)}, INVALID),
    ("env_id + NaN", {"env_id": COUNTER, "config": '{"target": NaN}'}, ENV_FAILED),
    ("env_id + Infinity", {"env_id": COUNTER, "config": '{"target": Infinity}'}, ENV_FAILED),
    ("env_id + 5000-digit integer", {"env_id": COUNTER, "config": '{"target": ' + "9" * 5000 + "}"}, INVALID),
    ("env_id + null bytes", {"env_id": COUNTER, "config": '{"target": "\x00"}'}, INVALID),
    ("env_id + 2 MB junk config", {"env_id": COUNTER, "config": "\x00" * TWO_MB}, INVALID),
    ("env_id + config not an object", {"env_id": COUNTER, "config": nested(3)}, INVALID),
    ("2 MB env_id", {"env_id": "x" * TWO_MB, "config": "{}"}, NOT_FOUND),
    ("null byte env_id", {"env_id": COUNTER + "\x00", "config": "{}"}, NOT_FOUND),
    ("unknown env_id", {"env_id": "Nope_1_I__NoSuchEnv", "config": "{}"}, NOT_FOUND),
    ("env_id + foreign env_str", {"env_id": "x" * TWO_MB, "env_str": "CounterEnv@{}"}, INVALID),
    ("no task", {}, INVALID),
    ("max_steps past the cap", {"env_id": COUNTER, "config": {"target": 1}, "max_steps": 2**32 - 1}, INVALID),
    (
        "step timeout past the cap",
        {"env_id": COUNTER, "config": {"target": 1}, "step_timeout_ms": 2**32 - 1},
        INVALID,
    ),
]


def create_message(fields: dict[str, Any]) -> rt.CreateSessionRequest:
    if not fields:
        return rt.CreateSessionRequest()
    options = {k: fields[k] for k in ("max_steps", "step_timeout_ms") if k in fields}
    if "ability" in fields:
        return rt.CreateSessionRequest(ability=fields["ability"], options=rt.SessionOptions(**options))
    config = fields.get("config", "")
    task = rt.EnvTask(
        env_id=fields.get("env_id", ""),
        config_json=config if isinstance(config, str) else json.dumps(config),
        env_str=fields.get("env_str", ""),
    )
    return rt.CreateSessionRequest(env_task=task, options=rt.SessionOptions(**options))


@pytest.mark.jail
@pytest.mark.parametrize(("label", "fields", "code"), HOSTILE_CREATES, ids=[c[0] for c in HOSTILE_CREATES])
def test_hostile_create_session_is_a_clear_refusal(
    client: RuntimeClient, label: str, fields: dict[str, Any], code: grpc.StatusCode
) -> None:
    # Straight through the stub: the request exactly as built (the client's helper normalizes configs).
    with pytest.raises(grpc.RpcError) as info:
        client.stub.CreateSession(create_message(fields), timeout=60)
    assert_clear(info.value.code(), info.value.details() or "", code)


@pytest.mark.jail
def test_hostile_ids_for_the_session_and_env_rpcs(client: RuntimeClient) -> None:
    hostile_ids = ["", "no-such-session", "\x00" * 64, "x" * TWO_MB, "\ufffe\U0001f600" * 1000, nested(DEEP)]
    for hostile in hostile_ids:
        for call, args in (
            (client.step, (hostile, OBSERVE)),
            (client.reset, (hostile,)),
            (client.get_session, (hostile,)),
        ):
            err = refused(call, *args)
            assert isinstance(err, SessionNotFound)
            assert_clear(err.code(), err.details(), NOT_FOUND)
        assert client.close_session(hostile) is False
        err = refused(client.get_env, hostile)
        assert isinstance(err, EnvNotFound)
        assert_clear(err.code(), err.details(), NOT_FOUND)
        page = client.stub.ListEnvs(rt.ListEnvsRequest(prefix=hostile, page_token=hostile), timeout=60)
        assert list(page.envs) == [] or hostile == ""
    # A huge page size is capped, not an error; a page token past the end is an empty page.
    page = client.stub.ListEnvs(rt.ListEnvsRequest(page_size=2**32 - 1), timeout=60)
    assert len(page.envs) == 16 and page.next_page_token == ""
    page = client.stub.ListEnvs(rt.ListEnvsRequest(page_token="\U0010ffff" * 100), timeout=60)
    assert list(page.envs) == []


@pytest.mark.jail
def test_hostile_batch_step_entries(client: RuntimeClient) -> None:
    session, other = counter_session(client), counter_session(client)
    results = client.batch_step(
        [
            (session, '{"name": "Observe", "parameters": ' + nested(DEEP) + "}"),
            (other, rt.ToolCall(name="Add", parameters_json='{"amount": ')),
            ("x" * TWO_MB, OBSERVE),
            ("\x00", OBSERVE),
        ]
    )
    assert [r.code for r in results[:2]] == [0, 0]
    assert [r.response.error.code for r in results[:2]] == [INVALID_ACTION, INVALID_ACTION]
    for result in results[2:]:
        assert_clear(result.code, result.message, NOT_FOUND)
    err = refused(lambda: client.batch_step([(session, OBSERVE), (session, nested(DEEP))]))
    assert isinstance(err, InvalidRequest) and "distinct" in err.details()
    err = refused(lambda: client.batch_step([(f"s{i}", OBSERVE) for i in range(1025)]))
    assert isinstance(err, InvalidRequest) and "max 1024" in err.details()
    assert client.batch_step([]) == []
    for sid in (session, other):
        view = client.get_session(sid)
        assert (view.step_index, view.status) == (0, rt.SESSION_STATUS_ACTIVE)
        assert client.step(sid, OBSERVE).observation == "0"


@pytest.mark.jail
async def test_hostile_step_stream_entries(runtime: CodegymServer, client: RuntimeClient) -> None:
    session = counter_session(client)
    async with AsyncRuntimeClient(runtime.address, timeout_s=60) as aclient:
        stream = aclient.step_stream()
        await stream.send(session, nested(DEEP), tag="deep")
        await stream.send(session, rt.ToolCall(name="Add", parameters_json='{"amount": ['), tag="inf")
        await stream.send("x" * TWO_MB, OBSERVE, tag="long id")
        await stream.send("\x00", OBSERVE, tag="t" * TWO_MB)
        await stream.send(session, '{"name": "Add", "parameters": {"amount": 2}}', tag="real")
        await stream.done_sending()
        answers = {}
        while (answer := await stream.recv()) is not None:
            answers[answer.tag[:10]] = answer
    assert answers["deep"].response.error.code == INVALID_ACTION
    assert answers["inf"].response.error.code == INVALID_ACTION
    assert_clear(answers["long id"].code, answers["long id"].message, NOT_FOUND)
    assert_clear(answers["t" * 10].code, answers["t" * 10].message, NOT_FOUND)
    assert (answers["real"].code, answers["real"].response.observation) == (0, "2")
    assert answers["real"].response.step_index == 1


# ---- requests that do not decode ------------------------------------------------------------------

BAD_UTF8 = b"\x0a\x04\xff\xfe\xc0\x80"  # field 1 (a string in every request) holding invalid UTF-8
UNDECODABLE: list[tuple[str, bytes]] = [
    *[
        (method, BAD_UTF8)
        for method in ("CreateSession", "Step", "Reset", "CloseSession", "GetSession", "ListEnvs", "GetEnv")
    ],
    ("BatchStep", b"\x0a\x08" + BAD_UTF8 + b"\x12\x00"),  # a StepRequest whose session id is not UTF-8
    ("Step", b"\xff\xff\xff\xff\xff"),  # not a protobuf message at all
    ("CreateSession", b"\x12\x06" + BAD_UTF8),  # an EnvTask whose env_id is not UTF-8
]


def token_metadata() -> tuple[tuple[str, str], ...]:
    """The access token the clients send here (none when the runtime under test is open)."""
    token = os.environ.get(TOKEN_ENV, "")
    return (("authorization", f"Bearer {token}"),) if token else ()


def raw_unary(address: str, method: str, payload: bytes, with_token: bool = True) -> grpc.RpcError:
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(f"/{SERVICE_NAME}/{method}")  # bytes in, bytes out
        with pytest.raises(grpc.RpcError) as info:
            call(payload, timeout=30, metadata=token_metadata() if with_token else ())
    return info.value


@pytest.mark.jail
def test_undecodable_unary_requests_to_the_runtime_process_are_invalid_argument(
    runtime: CodegymServer,
) -> None:
    for method, payload in UNDECODABLE:
        err = raw_unary(runtime.address, method, payload)
        assert_clear(err.code(), err.details() or "", INVALID)
        if token_metadata():  # a runtime taking tokens reads nothing of a caller it does not know
            err = raw_unary(runtime.address, method, payload, with_token=False)
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err
            assert "carries no access token" in (err.details() or "")


async def raw_stream(address: str, session: str) -> tuple[list[rt.StepStreamResponse], grpc.StatusCode, str]:
    """A valid step, a message whose tag is not UTF-8, another valid step: the answers and the status."""
    good = rt.StepStreamRequest(step=rt.StepRequest(session_id=session, action_json=OBSERVE), tag="ok")
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.stream_stream(
            f"/{SERVICE_NAME}/StepStream", response_deserializer=rt.StepStreamResponse.FromString
        )(metadata=token_metadata())
        await call.write(good.SerializeToString())
        await call.write(b"\x12\x04\xff\xfe\xc0\x80")
        await call.write(good.SerializeToString())
        await call.done_writing()
        answers: list[rt.StepStreamResponse] = []
        try:
            while (answer := await call.read()) is not grpc.aio.EOF:
                answers.append(answer)
        except grpc.aio.AioRpcError:
            pass
        return answers, await call.code(), await call.details()


@pytest.mark.jail
async def test_an_undecodable_step_stream_message_is_invalid_argument(
    runtime: CodegymServer, client: RuntimeClient
) -> None:
    session = counter_session(client)
    answers, code, _ = await raw_stream(runtime.address, session)
    # The servicer decodes stream messages itself (add_to_server): the undecodable one is answered
    # INVALID_ARGUMENT as an entry, the steps around it are applied, and the call ends OK.
    bad = [a for a in answers if a.code]
    good = [a for a in answers if not a.code]
    assert len(bad) == 1 and bad[0].code == INVALID.value[0]
    assert "not a valid StepStreamRequest" in bad[0].message and "Traceback" not in bad[0].message
    assert [a.tag for a in good] == ["ok", "ok"] and code == grpc.StatusCode.OK
    assert client.get_session(session).step_index == len(good)


class ExplodingStore(InMemorySessionStore):
    """A store with a bug: reading the session "explode" raises."""

    async def get(self, session_id: str) -> Session | None:
        if session_id == "explode":
            raise RuntimeError("store exploded at 0xdeadbeef")
        return await super().get(session_id)


@pytest.mark.jail
async def test_lenient_registration_and_the_last_line_of_defence(
    library: Path, workers: list[CodegymServer], caplog: pytest.LogCaptureFixture
) -> None:
    """In process, registered with `add_to_server`: undecodable requests are INVALID_ARGUMENT (in a
    StepStream, one answer, and the stream goes on); a bug in the runtime is INTERNAL with a short
    message and a reference, its traceback in the log."""
    caplog.set_level(logging.ERROR, logger="services.runtime.service")
    dispatcher = SandboxDispatcher([w.address for w in workers])
    servicer = RuntimeServicer(Catalog(library), ExplodingStore(), dispatcher, RuntimeConfig())
    server = ManagedServer([SERVICE_NAME])
    add_to_server(servicer, server.server)
    await server.start()
    try:
        for method, payload in UNDECODABLE:
            err = await asyncio.to_thread(raw_unary, server.address, method, payload)
            assert_clear(err.code(), err.details() or "", INVALID)
            assert "is not a valid" in (err.details() or "")
        async with AsyncRuntimeClient(server.address, timeout_s=60) as client:
            session = (await client.create_session(env_id=COUNTER, config={"target": 3})).session_id
            answers, code, _ = await raw_stream(server.address, session)
            assert code == grpc.StatusCode.OK
            assert sorted(a.tag for a in answers) == ["", "ok", "ok"]
            bad = next(a for a in answers if not a.tag)
            assert_clear(bad.code, bad.message, INVALID)
            assert (await client.get_session(session)).step_index == 2

            for call in (lambda: client.get_session("explode"), lambda: client.step("explode", OBSERVE)):
                with pytest.raises(CodeGymError) as info:
                    await call()
                assert info.value.code() == grpc.StatusCode.INTERNAL
                assert "internal error in" in info.value.details() and "(ref " in info.value.details()
                assert "exploded" not in info.value.details() and "Traceback" not in info.value.details()
            results = await client.batch_step([(session, OBSERVE), ("explode", OBSERVE)])
            assert (results[0].code, results[0].response.observation) == (0, "0")
            assert (
                results[1].code == grpc.StatusCode.INTERNAL.value[0] and "exploded" not in results[1].message
            )
            stream = client.step_stream()
            await stream.send("explode", OBSERVE, tag="bug")
            await stream.send(session, OBSERVE, tag="fine")
            await stream.done_sending()
            tags = {}
            while (answer := await stream.recv()) is not None:
                tags[answer.tag] = answer
            assert tags["bug"].code == grpc.StatusCode.INTERNAL.value[0] and tags["fine"].code == 0
    finally:
        await server.drain(1.0)
        await dispatcher.close()
    assert "store exploded at 0xdeadbeef" in caplog.text and "Traceback" in caplog.text


# ---- typed client errors --------------------------------------------------------------------------


@pytest.mark.jail
def test_sync_client_raises_typed_errors(client: RuntimeClient) -> None:
    err = refused(lambda: client.create_session(env_id="Nope_1_I__NoSuchEnv", config={}))
    assert type(err) is EnvNotFound and isinstance(err, grpc.RpcError)
    assert (err.code(), err.method) == (grpc.StatusCode.NOT_FOUND, "CreateSession")
    assert "Nope_1_I__NoSuchEnv" in err.details() and str(err).startswith("NOT_FOUND: ")
    assert err.retry_after_s is None and isinstance(err.__cause__, grpc.RpcError)
    assert type(refused(lambda: client.create_session(env_str="NoSuchEnv@{}"))) is EnvNotFound
    assert type(refused(lambda: client.get_env("Nope_1_I__NoSuchEnv"))) is EnvNotFound
    assert type(refused(lambda: client.create_session(env_id=COUNTER, config="{oops"))) is InvalidRequest
    # The runtime reads this config fine; the environment's reset() refuses it: its own failure.
    err = refused(lambda: client.create_session(env_id=COUNTER, config={"wrong": 1}))
    assert type(err) is EnvFailed and err.code() == grpc.StatusCode.FAILED_PRECONDITION and not err.retryable
    for call in (
        lambda: client.step("no-such-session", OBSERVE),
        lambda: client.reset("no-such-session"),
        lambda: client.get_session("no-such-session"),
    ):
        err = refused(call)
        assert type(err) is SessionNotFound and err.code() == grpc.StatusCode.NOT_FOUND
    session = counter_session(client)
    client.step(session, {"name": "Add", "parameters": {"amount": 3}})
    assert client.step(session, {"name": "Done", "parameters": {"answer": 3}}).done
    err = refused(lambda: client.step(session, OBSERVE))
    assert type(err) is SessionDone and err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "Reset" in err.details() and err.method == "Step"
    copy = pickle.loads(pickle.dumps(err))
    assert (type(copy), copy.code(), copy.details(), copy.method) == (
        SessionDone,
        err.code(),
        err.details(),
        "Step",
    )
    err = refused(lambda: client.batch_step([(session, OBSERVE), (session, OBSERVE)]))
    assert type(err) is InvalidRequest and err.method == "BatchStep"
    assert client.close_session(session)


@pytest.mark.jail
async def test_async_client_raises_typed_errors(runtime: CodegymServer) -> None:
    async with AsyncRuntimeClient(runtime.address) as client:
        with pytest.raises(EnvNotFound):
            await client.get_env("Nope_1_I__NoSuchEnv")
        with pytest.raises(EnvNotFound):
            await client.create_session(env_id="Nope_1_I__NoSuchEnv", config={})
        with pytest.raises(InvalidRequest):
            await client.create_session(ability="codegym_v2@X__YEnv@{}")
        for call in (client.get_session, client.reset, lambda s: client.step(s, OBSERVE)):
            with pytest.raises(SessionNotFound):
                await call("no-such-session")
        session = (await client.create_session(env_id=COUNTER, config={"target": 1}, max_steps=1)).session_id
        assert (await client.step(session, OBSERVE)).truncated
        with pytest.raises(SessionDone) as info:
            await client.step(session, OBSERVE)
        assert "truncated" in info.value.details()
        assert await client.close_session(session)


@pytest.mark.jail
def test_capacity_exceeded_carries_the_retry_hint(library: Path, workers: list[CodegymServer]) -> None:
    proc = base.start_runtime(library, workers, "--max-sessions", "1")
    try:
        with RuntimeClient(proc.address) as client:
            first = counter_session(client)
            err = refused(lambda: counter_session(client))
            assert type(err) is CapacityExceeded and err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert err.retry_after_s == 1.0 and "session limit" in err.details()
            assert ("retry-after-ms", "1000") in err.trailing_metadata()

            async def async_refusal() -> CodeGymError:
                async with AsyncRuntimeClient(proc.address) as aclient:
                    with pytest.raises(CapacityExceeded) as info:
                        await aclient.create_session(env_id=COUNTER, config={"target": 1})
                    return info.value

            assert asyncio.run(async_refusal()).retry_after_s == 1.0
            assert client.close_session(first)
            assert client.step(counter_session(client), OBSERVE).observation == "0"
    finally:
        assert proc.stop() == 0


def test_an_unreachable_runtime_is_runtime_unavailable_with_the_cause() -> None:
    with closed_port() as held:
        target = f"127.0.0.1:{held.getsockname()[1]}"
        with RuntimeClient(target, timeout_s=5) as client:
            with pytest.raises(RuntimeUnavailable) as info:
                client.wait_ready(0.5)
            assert "connection refused" in info.value.details() and target in info.value.details()
            assert info.value.method == "wait_ready" and info.value.code() == grpc.StatusCode.UNAVAILABLE
            err = refused(lambda: client.get_env(COUNTER))
            assert type(err) is RuntimeUnavailable and err.method == "GetEnv"
            assert type(refused(client.list_envs)) is RuntimeUnavailable

        async def async_errors() -> None:
            async with AsyncRuntimeClient(target, timeout_s=5) as aclient:
                with pytest.raises(RuntimeUnavailable) as info:
                    await aclient.wait_ready(0.5)
                assert "connection refused" in info.value.details()
                with pytest.raises(RuntimeUnavailable):
                    await aclient.step("some-session", OBSERVE)

        asyncio.run(async_errors())


def test_demo_without_a_runtime_fails_fast_naming_the_cause() -> None:
    with closed_port() as held:
        target = f"127.0.0.1:{held.getsockname()[1]}"
        start = time.monotonic()
        demo = subprocess.run(
            [sys.executable, "-m", "codegym_cli.cli", "demo", "--target", target],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
        elapsed = time.monotonic() - start
    # It used to wait ~11 s and print an empty reason; now a 2 s connect deadline and the cause.
    assert demo.returncode != 0
    assert elapsed < 8, elapsed
    assert "connection refused" in demo.stderr and target in demo.stderr, demo.stderr
    assert len(demo.stderr.strip().splitlines()) == 1, demo.stderr
    assert "Traceback" not in demo.stdout + demo.stderr

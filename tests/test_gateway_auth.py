"""Access tokens at the OpenEnv gateway and in the runtime clients (issue #31, part 1), against real
servers on port 0: a sandbox worker, a runtime and the gateway each taking the tokens file, the
gateway and the runtime calling on with the service token, as `codegym up --auth` wires them.

The gateway refuses a request without a known token (HTTP 401, the WebSocket handshake 401, and
OpenEnv's own client without `headers=`), a role that may not play (403), and serves a trainer's
token to reward 1 with OpenEnv's client given `headers=`; the probes stay open; an MCP session token
serves only its own tenant; a non-loopback bind without tokens refuses to start. The clients'
`token=` reaches a runtime that takes tokens.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openenv.core.generic_client import GenericEnvClient
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

import codegym_client
from codegym.library.store import Library
from codegym.procs import codegym_command
from codegym.samples import ENVS, TASKS
from codegym.server.auth import OPERATOR, SERVICE, TRAINER, Identity, write_tokens
from codegym_client import AsyncRuntimeClient, RuntimeClient, Unauthenticated, errors
from codegym_client.channels import TLS_CA_ENV, TOKEN_ENV
from codegym_testkit.access import self_signed
from services.openenv.access import GATEWAY_ROLES
from tests.helpers.servers import CodegymServer

pytestmark = pytest.mark.jail  # the stack has a sandbox worker

TOKENS = {
    "trainer-token": Identity("team-a", TRAINER),
    "other-trainer-token": Identity("team-b", TRAINER),
    "tight-token": Identity("team-tight", TRAINER),
    "operator-token": Identity("ops", OPERATOR),
    "service-token": Identity("codegym", SERVICE),
}
ARRAY_GCD = 'codegym_v1@Sample_0006_I__ArrayGcdEnv@{"nums": [12, 18]}'
SOLVE = {"name": "Done", "parameters": {"answer": 6}}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def environ(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (TOKEN_ENV, TLS_CA_ENV, "CODEGYM_TOKENS_FILE")}
    return {**env, **extra}


@pytest.fixture(autouse=True)
def no_ambient_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.delenv(TLS_CA_ENV, raising=False)


@pytest.fixture(scope="module")
def tokens_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gateway-auth") / "tokens.json"
    write_tokens(path, TOKENS)
    body = json.loads(path.read_text())
    body["tenants"] = {"team-tight": {"sessions": 1}}  # the runtime's quota, seen through the gateway
    path.write_text(json.dumps(body))
    return path


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tokens_file: Path) -> Iterator[tuple[str, str]]:
    """(runtime address, gateway base URL): every server takes the tokens file from its environment
    and calls the next one with the service token, as `codegym up --auth` starts them."""
    library = tmp_path_factory.mktemp("library") / "library.db"
    with Library(library) as lib:
        lib.import_paths([ENVS, TASKS])
    env = environ(CODEGYM_TOKENS_FILE=str(tokens_file), CODEGYM_TOKEN="service-token")
    worker = CodegymServer(["serve", "sandbox", "--port", "0", "--jails", "1"], env=env)
    runtime = gateway = None
    try:
        args = ["serve", "runtime", "--port", "0", "--library", str(library), "--sandbox", worker.address]
        runtime = CodegymServer([*args, "--no-record"], env=env)
        gateway = CodegymServer(["serve", "openenv", "--runtime", runtime.address, "--port", "0"], env=env)
        yield runtime.address, f"http://{gateway.address}"
    finally:
        for proc in (gateway, runtime, worker):
            if proc is not None:
                assert proc.stop() == 0, proc.text[-3000:]


def http(
    url: str, token: str = "", body: Any = None, tls: ssl.SSLContext | None = None
) -> tuple[int, dict[str, str], Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="GET" if body is None else "POST")
    request.add_header("Content-Type", "application/json")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10, context=tls) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read())


def test_http_needs_a_known_token_of_a_playing_role(stack: tuple[str, str]) -> None:
    _, base = stack
    status, headers, body = http(f"{base}/metadata")
    assert status == 401 and body["code"] == "UNAUTHENTICATED", body
    assert headers.get("www-authenticate") == "Bearer"
    assert "carries no access token" in body["error"] and "Authorization: Bearer" in body["error"]
    assert "\n" not in body["error"]
    status, _, body = http(f"{base}/schema", "not-a-token")
    assert status == 401 and "does not know" in body["error"], body
    status, _, body = http(f"{base}/metadata", "service-token")  # a server's identity, not a trainer's
    assert status == 403 and body["code"] == "PERMISSION_DENIED", body
    assert "service's access token" in body["error"] and "trainer" in body["error"]
    for token in ("trainer-token", "operator-token"):
        status, _, body = http(f"{base}/metadata", token)
        assert status == 200 and body["name"] == "codegym", body
    status, _, body = http(f"{base}/mcp", body={"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
    assert status == 401, body
    assert {TRAINER, OPERATOR} == GATEWAY_ROLES


def test_the_probes_stay_open(stack: tuple[str, str]) -> None:
    _, base = stack
    for path in ("/health", "/live"):
        status, _, body = http(f"{base}{path}")
        assert status == 200 and body["status"] == "healthy", body


async def test_the_websocket_handshake_needs_a_token(stack: tuple[str, str]) -> None:
    _, base = stack
    url = base.replace("http://", "ws://") + "/ws"
    for headers, status in (({}, 401), (bearer("nope"), 401), (bearer("service-token"), 403)):
        with pytest.raises(InvalidStatus) as refused:
            async with connect(url, additional_headers=headers):
                pass
        assert refused.value.response.status_code == status
        body = json.loads(refused.value.response.body or b"{}")
        assert body["code"] == ("UNAUTHENTICATED" if status == 401 else "PERMISSION_DENIED"), body
    async with connect(url, additional_headers=bearer("trainer-token")) as ws:
        await ws.send(json.dumps({"type": "reset", "data": {"ability": ARRAY_GCD}}))
        assert json.loads(await ws.recv())["type"] == "observation"


async def test_openenvs_client_is_refused_without_headers_and_plays_with_them(stack: tuple[str, str]) -> None:
    _, base = stack
    with pytest.raises(ConnectionError, match="401"):
        async with GenericEnvClient(base_url=base) as env:
            await env.reset(ability=ARRAY_GCD)
    # The gateway calls the runtime with its service token; the runtime calls the worker with its own.
    async with GenericEnvClient(base_url=base, headers=bearer("trainer-token")) as env:
        result = await env.reset(ability=ARRAY_GCD)
        assert result.done is False
        result = await env.step(SOLVE)
        assert result.done is True and result.reward == 1.0


async def reset_over(ws: Any) -> dict[str, Any]:
    await ws.send(json.dumps({"type": "reset", "data": {"ability": ARRAY_GCD}}))
    answer: dict[str, Any] = json.loads(await ws.recv())
    return answer


async def test_the_runtime_sees_the_gateways_callers_tenants(stack: tuple[str, str]) -> None:
    """The gateway names each caller's tenant to the runtime: team-tight's quota of one session
    counts what it opened directly and through the gateway alike, other tenants are not touched, and
    a socket's close gives the session back (the close, too, is made as team-tight's)."""
    runtime, base = stack
    url = base.replace("http://", "ws://") + "/ws"
    tight = bearer("tight-token")
    with RuntimeClient(runtime, token="tight-token") as direct:
        held = direct.create_session(ability=ARRAY_GCD).session_id
        async with connect(url, additional_headers=tight) as ws:
            refused = await reset_over(ws)
            assert refused["type"] == "error", refused
            assert refused["data"]["code"] == "CAPACITY_REACHED", refused
            assert "team-tight" in refused["data"]["message"], refused
        async with connect(url, additional_headers=bearer("trainer-token")) as other:
            assert (await reset_over(other))["type"] == "observation"  # team-a is not touched
        assert direct.close_session(held) is True
    for _ in range(3):  # each socket's session is closed as team-tight's, so the quota comes back
        async with connect(url, additional_headers=tight) as ws:
            deadline = time.monotonic() + 10
            while (answer := await reset_over(ws))["type"] != "observation":
                assert time.monotonic() < deadline, answer
                await asyncio.sleep(0.05)


async def test_the_gateway_serves_https_and_wss_with_tls(
    stack: tuple[str, str], tokens_file: Path, tmp_path: Path
) -> None:
    """With --tls-cert/--tls-key the gateway speaks HTTPS and WSS only: OpenEnv's client plays over
    them with its token, and a plain-text request never reaches a route."""
    cert, key = self_signed(tmp_path)
    trust = ssl.create_default_context(cafile=str(cert))  # the clients trust the test's certificate
    runtime, _ = stack
    env = environ(CODEGYM_TOKENS_FILE=str(tokens_file), CODEGYM_TOKEN="service-token")
    args = [
        "serve",
        "openenv",
        "--runtime",
        runtime,
        "--port",
        "0",
        "--tls-cert",
        str(cert),
        "--tls-key",
        str(key),
    ]
    gateway = CodegymServer(args, env=env)
    try:
        assert "(https;" in gateway.text
        port = gateway.address.rsplit(":", 1)[1]
        status, _, body = http(f"https://localhost:{port}/metadata", "trainer-token", tls=trust)
        assert status == 200 and body["name"] == "codegym", body
        assert http(f"https://localhost:{port}/metadata", tls=trust)[0] == 401
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            http(f"http://{gateway.address}/metadata", "trainer-token")
        async with connect(
            f"wss://localhost:{port}/ws", ssl=trust, additional_headers=bearer("trainer-token")
        ) as ws:
            await ws.send(json.dumps({"type": "reset", "data": {"ability": ARRAY_GCD}}))
            assert json.loads(await ws.recv())["type"] == "observation"
            await ws.send(json.dumps({"type": "step", "data": SOLVE}))
            answer = json.loads(await ws.recv())
            assert answer["type"] == "observation" and answer["data"]["done"] is True, answer
    finally:
        assert gateway.stop() == 0, gateway.text[-3000:]


async def test_an_mcp_session_token_serves_its_own_tenant_only(stack: tuple[str, str]) -> None:
    _, base = stack

    def mcp(token: str, method: str, **params: Any) -> dict[str, Any]:
        status, _, answer = http(
            f"{base}/mcp", token, {"jsonrpc": "2.0", "id": 1, "method": method, "params": params}
        )
        assert status == 200, answer
        return answer

    session = mcp("trainer-token", "openenv/session/create")["result"]["session_id"]
    assert "tools" in mcp("trainer-token", "tools/list", session_id=session)["result"]
    for method in ("tools/list", "openenv/session/close"):
        answer = mcp("other-trainer-token", method, session_id=session)
        assert "Unknown session_id" in answer["error"]["message"], answer
    url = base.replace("http://", "ws://") + f"/ws?session_id={session}"
    async with connect(url, additional_headers=bearer("other-trainer-token")) as ws:
        assert "is unknown" in json.loads(await ws.recv())["data"]["message"]
    assert mcp("trainer-token", "openenv/session/close", session_id=session)["result"]["closed"] is True


def test_a_non_loopback_bind_without_tokens_refuses_to_start() -> None:
    argv = codegym_command(
        ["serve", "openenv", "--host", "0.0.0.0", "--port", "0", "--runtime", "127.0.0.1:9"]
    )
    done = subprocess.run(argv, env=environ(), capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "refusing to serve on 0.0.0.0 without access tokens" in done.stderr, done.stderr
    assert "--insecure" in done.stderr
    proc = CodegymServer(
        ["serve", "openenv", "--host", "0.0.0.0", "--port", "0", "--runtime", "127.0.0.1:9", "--insecure"],
        env=environ(),
    )
    assert proc.stop() == 0, proc.text[-3000:]


# ---- the runtime clients' token= --------------------------------------------------------------------


def test_the_runtime_client_sends_its_token_argument(stack: tuple[str, str]) -> None:
    runtime, _ = stack
    with RuntimeClient(runtime, timeout_s=60) as client, pytest.raises(Unauthenticated):
        client.get_env("Sample_0006_I__ArrayGcdEnv")
    with RuntimeClient(runtime, timeout_s=60, token="trainer-token") as client:
        session = client.create_session(ability=ARRAY_GCD)
        assert client.step(session.session_id, json.dumps(SOLVE)).reward == 1.0


def test_the_token_argument_wins_over_the_environment(
    stack: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime, _ = stack
    monkeypatch.setenv(TOKEN_ENV, "not-a-token")
    with RuntimeClient(runtime, token="trainer-token") as client:
        assert client.get_env("Sample_0006_I__ArrayGcdEnv").env_id
    with RuntimeClient(runtime) as client, pytest.raises(Unauthenticated):  # the environment's
        client.get_env("Sample_0006_I__ArrayGcdEnv")
    with pytest.raises(ValueError, match="cannot read the TLS CA"):
        RuntimeClient(runtime, token="trainer-token", tls_ca="/nonexistent/ca.pem")


async def test_the_async_client_sends_its_token_argument(stack: tuple[str, str]) -> None:
    runtime, _ = stack
    async with AsyncRuntimeClient(runtime, token="operator-token") as client:
        assert (await client.get_env("Sample_0006_I__ArrayGcdEnv")).env_id
    async with AsyncRuntimeClient(runtime, token="nope") as client:
        with pytest.raises(Unauthenticated, match="does not know"):
            await client.get_env("Sample_0006_I__ArrayGcdEnv")


def test_the_refusals_are_exported_typed() -> None:
    assert codegym_client.Unauthenticated is errors.Unauthenticated
    assert codegym_client.PermissionDenied is errors.PermissionDenied
    assert {"Unauthenticated", "PermissionDenied"} <= set(codegym_client.__all__)


# ---- codegym up --auth --------------------------------------------------------------------------------


async def test_codegym_up_auth_gives_its_gateway_the_tokens(tmp_path: Path) -> None:
    """The gateway `up --auth --openenv-port 0` starts refuses a client without the printed trainer
    token, plays an episode with it (calling the runtime with the service token), and says how."""
    library = tmp_path / "lib.db"
    args = ["up", "--auth", "--library", str(library), "--port", "0", "--workers", "1", "--jails", "1"]
    up = CodegymServer([*args, "--no-record", "--openenv-port", "0"], env=environ(), timeout=120)
    try:
        deadline = time.monotonic() + 60
        while "Ctrl-C stops everything" not in up.text:
            assert time.monotonic() < deadline, up.text
            await asyncio.sleep(0.05)
        trainer = re.search(rf"export {TOKEN_ENV}=(\S+)", up.text)
        base = re.search(r"openenv gateway: OpenEnv base_url (http://\S+)", up.text)
        assert trainer is not None and base is not None, up.text
        assert 'headers={"Authorization": "Bearer "' in up.text
        status, _, body = await asyncio.to_thread(http, f"{base.group(1)}/metadata")
        assert status == 401, body
        async with GenericEnvClient(base_url=base.group(1), headers=bearer(trainer.group(1))) as env:
            await env.reset(ability=ARRAY_GCD)
            assert (await env.step(SOLVE)).reward == 1.0
    finally:
        assert up.stop() == 0, up.text[-3000:]


async def test_codegym_up_with_tls_serves_every_server_over_it(tmp_path: Path) -> None:
    """`up --auth --tls-cert --tls-key`: the workers, the runtime and the gateway serve TLS and call
    each other over it; a trainer with the token and the printed CA plays, without the CA it cannot
    reach the runtime, and the gateway answers HTTPS only."""
    cert, key = self_signed(tmp_path)
    library = tmp_path / "lib.db"
    args = ["up", "--auth", "--library", str(library), "--port", "0", "--workers", "1", "--jails", "1"]
    args += ["--tls-cert", str(cert), "--tls-key", str(key), "--no-record", "--openenv-port", "0"]
    up = CodegymServer(args, env=environ(), timeout=120)
    try:
        deadline = time.monotonic() + 60
        while "Ctrl-C stops everything" not in up.text:
            assert time.monotonic() < deadline, up.text
            await asyncio.sleep(0.05)
        trainer = re.search(rf"export {TOKEN_ENV}=(\S+)", up.text)
        ca = re.search(rf"export {TLS_CA_ENV}=(\S+)", up.text)
        base = re.search(r"openenv gateway: OpenEnv base_url (https://\S+)", up.text)
        assert trainer is not None and ca is not None and base is not None, up.text
        assert Path(ca.group(1)) == cert.resolve()
        with RuntimeClient(up.address, token=trainer.group(1), tls_ca=ca.group(1)) as client:
            session = client.create_session(ability=ARRAY_GCD)
            assert client.step(session.session_id, json.dumps(SOLVE)).reward == 1.0
        plain = RuntimeClient(up.address, token=trainer.group(1), attempts=1, timeout_s=5)
        with plain, pytest.raises(errors.RuntimeUnavailable):
            plain.create_session(ability=ARRAY_GCD)
        trust = ssl.create_default_context(cafile=ca.group(1))
        port = base.group(1).rsplit(":", 1)[1]
        status, _, body = await asyncio.to_thread(
            http, f"https://localhost:{port}/metadata", trainer.group(1), None, trust
        )
        assert status == 200 and body["name"] == "codegym", body
    finally:
        assert up.stop() == 0, up.text[-3000:]

"""Access tokens and TLS on every gRPC server (issue #31, part 1), against real servers on port 0.

Each server refuses a call without a token (UNAUTHENTICATED), a sandbox worker refuses a trainer's
token (PERMISSION_DENIED), the right token is served; the clients raise the typed error at once
(one call reaches the server, none is resent) and never take it for an infrastructure failure; a
runtime with tokens steps through workers with tokens on its service token; TLS round trip with a
certificate made here; a non-loopback bind without tokens refuses to start; health stays open.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from codegym.errors import REASON_TRAILER
from codegym.samples import ENVS
from codegym.sandbox.v1 import sandbox_service_pb2 as sb
from codegym.sandbox.v1 import sandbox_service_pb2_grpc as sb_grpc
from codegym.server.auth import (
    CALLER,
    OPERATOR,
    SERVICE,
    TRAINER,
    Identity,
    InsecureBind,
    ServerAuth,
    local_tokens,
    read_tokens,
    write_tokens,
)
from codegym.server.grpcutil import ManagedServer
from codegym.server.settings import ServerAccess
from codegym.synthesis.v1 import synthesis_service_pb2 as sy
from codegym.synthesis.v1 import synthesis_service_pb2_grpc as sy_grpc
from codegym.verification.v1 import verification_service_pb2 as vf
from codegym.verification.v1 import verification_service_pb2_grpc as vf_grpc
from codegym_client import AsyncRuntimeClient, RuntimeClient, is_infrastructure
from codegym_client.channels import TLS_CA_ENV, TOKEN_ENV, Access, aio_channel
from codegym_client.errors import Unauthenticated
from codegym_testkit.access import self_signed
from services.synthesis.service import SynthesisServer
from services.synthesis.settings import LLMSettings, SynthesisSettings
from services.verification.service import VerificationServer
from services.verification.settings import VerificationSettings
from services.worker_stream import WorkerStream
from tests.helpers.libraries import SAMPLE_LIBRARY, library_fixture
from tests.helpers.servers import CodegymServer, sandbox_workers

ROOT = Path(__file__).resolve().parent.parent
TOKENS = {
    "trainer-token": Identity("team-a", TRAINER),
    "operator-token": Identity("ops", OPERATOR),
    "service-token": Identity("codegym", SERVICE),
}
SANDBOX = "codegym.sandbox.v1.SandboxService"
ARRAY_GCD = 'codegym_v1@Sample_0006_I__ArrayGcdEnv@{"nums": [12, 18]}'


@pytest.fixture(scope="module")
def tokens_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("auth") / "tokens.json"
    write_tokens(path, TOKENS)
    return path


library = library_fixture(SAMPLE_LIBRARY)


@pytest.fixture(autouse=True)
def no_ambient_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.delenv(TLS_CA_ENV, raising=False)


def environ(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (TOKEN_ENV, TLS_CA_ENV)}
    return {**env, **extra}


def reason_of(error: grpc.RpcError) -> str:
    return str(dict(error.trailing_metadata() or ()).get(REASON_TRAILER, ""))


def rpc_count(metrics_address: str, method: str, code: str) -> float:
    text = urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=5).read().decode()
    pattern = rf'^codegym_rpc_total\{{code="{code}",method="{method}"\}} (\S+)$'
    found = re.search(pattern, text, re.M) or re.search(
        rf'^codegym_rpc_total\{{method="{method}",code="{code}"\}} (\S+)$', text, re.M
    )
    return float(found.group(1)) if found else 0.0


def calls_seen(metrics: str, method: str, code: str, at_least: float) -> float:
    """The server's count once it reached `at_least` (it is written as the call ends), and a moment
    later, so a resend would show."""
    deadline = time.monotonic() + 5
    while rpc_count(metrics, method, code) < at_least and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    return rpc_count(metrics, method, code)


def metrics_address(server: CodegymServer) -> str:
    for line in server.output:
        match = re.search(r"metrics on (\S+)", line)
        if match:
            return match.group(1)
    raise AssertionError(f"no metrics line in {server.output}")


# ---- the runtime -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runtime(library: Path, tokens_file: Path) -> Iterator[CodegymServer]:
    """A runtime taking the tokens file, with no worker behind it (port 9: refusals never get there)."""
    args = ["serve", "runtime", "--port", "0", "--library", str(library), "--sandbox", "127.0.0.1:9"]
    proc = CodegymServer(
        [*args, "--tokens", str(tokens_file), "--metrics-port", "0", "--no-record"], env=environ()
    )
    yield proc
    assert proc.stop() == 0


def test_the_runtime_refuses_a_call_without_a_token_at_once_and_once(runtime: CodegymServer) -> None:
    metrics = metrics_address(runtime)
    before = rpc_count(metrics, "CreateSession", "UNAUTHENTICATED")
    started = time.monotonic()
    with RuntimeClient(runtime.address, timeout_s=30) as client, pytest.raises(Unauthenticated) as info:
        client.create_session(ability=ARRAY_GCD)
    assert time.monotonic() - started < 2.0  # no resend, no back-off
    error = info.value
    assert error.reason == "UNAUTHENTICATED" and not error.retryable and not error.infrastructure
    assert not is_infrastructure(error)
    assert TOKEN_ENV in error.details() and "--token" in error.details()
    assert calls_seen(metrics, "CreateSession", "UNAUTHENTICATED", before + 1) == before + 1


def test_the_runtime_refuses_an_unknown_token(
    runtime: CodegymServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(TOKEN_ENV, "not-a-token")
    with RuntimeClient(runtime.address) as client, pytest.raises(Unauthenticated) as info:
        client.get_env("Sample_0006_I__ArrayGcdEnv")
    assert "does not know" in info.value.details()


def test_the_runtime_serves_a_trainers_token(runtime: CodegymServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TOKEN_ENV, "trainer-token")
    with RuntimeClient(runtime.address) as client:
        assert client.get_env("Sample_0006_I__ArrayGcdEnv").env_id == "Sample_0006_I__ArrayGcdEnv"


async def test_the_async_client_raises_the_typed_error_once(runtime: CodegymServer) -> None:
    metrics = metrics_address(runtime)
    before = rpc_count(metrics, "CreateSession", "UNAUTHENTICATED")
    started = time.monotonic()
    async with AsyncRuntimeClient(runtime.address) as client:
        with pytest.raises(Unauthenticated) as info:
            await client.create_session(ability=ARRAY_GCD)
    assert time.monotonic() - started < 2.0 and not is_infrastructure(info.value)
    assert calls_seen(metrics, "CreateSession", "UNAUTHENTICATED", before + 1) == before + 1


def test_health_is_open_without_a_token(runtime: CodegymServer) -> None:
    with grpc.insecure_channel(runtime.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_the_command_line_stops_with_the_servers_line(runtime: CodegymServer) -> None:
    argv = [sys.executable, "-m", "codegym_cli.cli", "library", "stats", "--target", runtime.address]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=environ())
    assert run.returncode == 1 and "UNAUTHENTICATED" in run.stderr and TOKEN_ENV in run.stderr, run.stderr
    assert "Traceback" not in run.stderr
    # With --token the call is served (this runtime keeps no record: the handler's own answer).
    run = subprocess.run(
        [*argv, "--token", "trainer-token"], capture_output=True, text=True, timeout=60, env=environ()
    )
    assert "UNAUTHENTICATED" not in run.stderr and "no episode record" in run.stderr, run.stderr


# ---- synthesis and verification (in process) -------------------------------------------------------


async def test_synthesis_takes_operators_and_refuses_trainers(tmp_path: Path) -> None:
    settings = SynthesisSettings(port=0, out=str(tmp_path), llm=LLMSettings(base_url="http://127.0.0.1:9/v1"))
    server = SynthesisServer(settings, auth=ServerAuth(TOKENS))
    await server.start()
    try:
        request = sy.GenerateUnitTestsRequest()
        for token, code in (
            ("", grpc.StatusCode.UNAUTHENTICATED),
            ("trainer-token", grpc.StatusCode.PERMISSION_DENIED),
            ("operator-token", grpc.StatusCode.INVALID_ARGUMENT),  # served: the request is empty
        ):
            async with aio_channel(server.address, [], access=Access(token=token)) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await sy_grpc.SynthesisServiceStub(channel).GenerateUnitTests(request, timeout=10)
            assert info.value.code() == code, (token, info.value)
            if code != grpc.StatusCode.INVALID_ARGUMENT:
                assert reason_of(info.value) == code.name
    finally:
        await server.stop(grace_s=0)


async def test_verification_takes_services_and_refuses_trainers() -> None:
    server = VerificationServer(VerificationSettings(sandbox="127.0.0.1:9", port=0), auth=ServerAuth(TOKENS))
    await server.start()
    try:
        for token, code in (
            ("", grpc.StatusCode.UNAUTHENTICATED),
            ("trainer-token", grpc.StatusCode.PERMISSION_DENIED),
            ("service-token", grpc.StatusCode.INVALID_ARGUMENT),  # served: env_source is empty
        ):
            async with aio_channel(server.address, [], access=Access(token=token)) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await vf_grpc.VerificationServiceStub(channel).CheckEnvironment(
                        vf.CheckEnvironmentRequest(), timeout=10
                    )
            assert info.value.code() == code, (token, info.value)
    finally:
        await server.stop(grace_s=0)


async def test_the_handler_knows_its_callers_tenant() -> None:
    seen: list[Identity | None] = []

    class Servicer(health_pb2_grpc.HealthServicer):
        async def Check(self, request: object, context: object) -> health_pb2.HealthCheckResponse:
            seen.append(CALLER.get())
            return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

    # A service the table does not name takes operators only; the servicer reads the caller.
    server = ManagedServer(["test.Probe"], auth=ServerAuth(TOKENS))
    handler = grpc.method_handlers_generic_handler(
        "test.Probe",
        {
            "Check": grpc.unary_unary_rpc_method_handler(
                Servicer().Check,
                request_deserializer=health_pb2.HealthCheckRequest.FromString,
                response_serializer=health_pb2.HealthCheckResponse.SerializeToString,
            )
        },
    )
    server.server.add_generic_rpc_handlers((handler,))
    await server.start()
    try:
        async with aio_channel(server.address, [], access=Access(token="operator-token")) as channel:
            probe = channel.unary_unary(
                "/test.Probe/Check",
                request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                response_deserializer=health_pb2.HealthCheckResponse.FromString,
            )
            await probe(health_pb2.HealthCheckRequest(), timeout=5)
        assert seen == [Identity("ops", OPERATOR)]
    finally:
        await server.drain(0)


# ---- binding and TLS -----------------------------------------------------------------------------------


def test_a_non_loopback_bind_without_tokens_refuses_to_start(library: Path) -> None:
    with pytest.raises(InsecureBind, match="--insecure"):
        ManagedServer(["x"], host="0.0.0.0", auth=ServerAuth())
    run = subprocess.run(
        [sys.executable, "-m", "codegym_cli.cli", "serve", "sandbox", "--host", "0.0.0.0", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        env=environ(),
    )
    assert run.returncode == 1
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "refusing to serve on 0.0.0.0 without access tokens" in lines[0], run.stderr


def test_a_token_is_never_sent_in_plain_text_beyond_loopback() -> None:
    with pytest.raises(ValueError, match="only over TLS or to a loopback"):
        aio_channel("10.1.2.3:50051", [], access=Access(token="t"))


async def test_tls_round_trip_with_a_token(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    auth = ServerAuth(TOKENS, tls_cert=cert.read_bytes(), tls_key=key.read_bytes(), health_port=0)
    settings = SynthesisSettings(port=0, out=str(tmp_path), llm=LLMSettings(base_url="http://127.0.0.1:9/v1"))
    server = SynthesisServer(settings, auth=auth)
    await server.start()
    try:
        request = sy.GenerateUnitTestsRequest()
        access = Access.from_env(token="operator-token", tls_ca=cert)
        async with aio_channel(server.address, [], access=access) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await sy_grpc.SynthesisServiceStub(channel).GenerateUnitTests(request, timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # through TLS and the token check
        # A plain-text client cannot talk to the TLS port.
        async with grpc.aio.insecure_channel(server.address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        # The probes' port: health alone, in plain text.
        probes = f"127.0.0.1:{server.managed.health_port}"
        async with grpc.aio.insecure_channel(probes) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await sy_grpc.SynthesisServiceStub(channel).GenerateUnitTests(request, timeout=5)
            assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        await server.stop(grace_s=0)


# ---- tokens files --------------------------------------------------------------------------------------


def test_tokens_file_round_trip_and_errors(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    write_tokens(path, TOKENS)
    assert path.stat().st_mode & 0o777 == 0o600
    assert read_tokens(path) == TOKENS
    path.write_text(json.dumps({"tokens": {"x": {"tenant": "a", "role": "root"}}}))
    with pytest.raises(ValueError, match="role 'root'"):
        read_tokens(path)
    with pytest.raises(ValueError, match="cannot read the tokens file"):
        ServerAuth.load(ServerAccess(tokens=str(tmp_path / "missing.json")))
    assert ServerAuth.load(ServerAccess(server_token="solo")).tokens == {
        "solo": Identity("default", OPERATOR)
    }


def test_local_tokens_are_kept_across_restarts(tmp_path: Path) -> None:
    path = tmp_path / "lib" / "access-tokens.json"
    first = local_tokens(path)
    assert set(first) == {TRAINER, OPERATOR, SERVICE} and path.stat().st_mode & 0o777 == 0o600
    assert local_tokens(path) == first


# ---- workers (jails) ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def secured_workers(tokens_file: Path) -> Iterator[list[CodegymServer]]:
    with sandbox_workers(2, "--tokens", str(tokens_file), env=environ()) as procs:
        yield procs


def solve_request() -> sb.ExecuteRequest:
    source = (ENVS / "Sample_0006_I__ArrayGcdEnv.py").read_text()
    op = sb.Operation(
        source=sb.SourceRef(code=source), ref_answer=sb.RefAnswerOp(config_json='{"nums": [12, 18]}')
    )
    return sb.ExecuteRequest(operation=op)


@pytest.mark.jail
async def test_a_worker_takes_services_and_operators_only(secured_workers: list[CodegymServer]) -> None:
    address = secured_workers[0].address
    for token, code in (
        ("", grpc.StatusCode.UNAUTHENTICATED),
        ("trainer-token", grpc.StatusCode.PERMISSION_DENIED),
    ):
        async with aio_channel(address, [SANDBOX], access=Access(token=token)) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await sb_grpc.SandboxServiceStub(channel).Execute(solve_request(), timeout=30)
        assert info.value.code() == code and reason_of(info.value) == code.name
    for token in ("service-token", "operator-token"):
        async with aio_channel(address, [SANDBOX], access=Access(token=token)) as channel:
            reply = await sb_grpc.SandboxServiceStub(channel).Execute(solve_request(), timeout=30)
        assert reply.result.status == sb.STATUS_OK, reply.result


@pytest.mark.jail
async def test_a_workers_stream_takes_the_same_tokens(secured_workers: list[CodegymServer]) -> None:
    """ExecuteStream (the runtime's path to its sessions' workers) is checked as the unary calls
    are: its operations fail with the stream's refusal, never taken for a worker lost."""
    address = secured_workers[0].address
    op = solve_request().operation
    for token, code in (
        ("", grpc.StatusCode.UNAUTHENTICATED),
        ("trainer-token", grpc.StatusCode.PERMISSION_DENIED),
    ):
        async with aio_channel(address, [SANDBOX], access=Access(token=token)) as channel:
            stream = WorkerStream(sb_grpc.SandboxServiceStub(channel), address)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stream.submit(op)
            await stream.close()
        assert info.value.code() == code and reason_of(info.value) == code.name
    async with aio_channel(address, [SANDBOX], access=Access(token="service-token")) as channel:
        stream = WorkerStream(sb_grpc.SandboxServiceStub(channel), address)
        result = await stream.submit(op)
        await stream.close()
    assert result.status == sb.STATUS_OK and result.answer_json == "6", result


@pytest.mark.jail
def test_sandbox_run_target_takes_the_operators_token(secured_workers: list[CodegymServer]) -> None:
    argv = [
        sys.executable,
        "-m",
        "codegym_cli.cli",
        "sandbox",
        "run",
        str(ENVS / "Sample_0006_I__ArrayGcdEnv.py"),
    ]
    argv += ["--op", "ref_answer", "--config", '{"nums": [12, 18]}', "--target", secured_workers[0].address]
    refused = subprocess.run(
        [*argv, "--token", "trainer-token"], capture_output=True, text=True, timeout=60, env=environ()
    )
    assert refused.returncode == 1 and "PERMISSION_DENIED" in refused.stderr, refused.stderr
    served = subprocess.run(
        [*argv, "--token", "operator-token"], capture_output=True, text=True, timeout=60, env=environ()
    )
    assert served.returncode == 0 and '"STATUS_OK"' in served.stdout, served.stderr


@pytest.mark.jail
def test_a_runtime_with_tokens_steps_through_workers_with_tokens(
    library: Path, tokens_file: Path, secured_workers: list[CodegymServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    sandbox = ",".join(w.address for w in secured_workers)
    args = ["serve", "runtime", "--port", "0", "--library", str(library), "--sandbox", sandbox, "--no-record"]
    runtime = CodegymServer([*args, "--tokens", str(tokens_file)], env=environ(CODEGYM_TOKEN="service-token"))
    try:
        monkeypatch.setenv(TOKEN_ENV, "trainer-token")
        with RuntimeClient(runtime.address, timeout_s=60) as client:
            session = client.create_session(ability=ARRAY_GCD)
            reply = client.step(session.session_id, '{"name": "Done", "parameters": {"answer": 6}}')
            assert reply.done and reply.reward == 1.0
    finally:
        assert runtime.stop() == 0


@pytest.mark.jail
def test_codegym_up_auth_prints_a_trainers_token_and_wires_every_server(
    library: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    up = CodegymServer(
        [
            "up",
            "--auth",
            "--workers",
            "1",
            "--jails",
            "1",
            "--port",
            "0",
            "--library",
            str(library),
            "--no-record",
        ],
        env=environ(CODEGYM_TOKEN="a-token-from-the-shell"),
    )
    try:
        exported = [line for line in up.output if f"export {TOKEN_ENV}=" in line]
        assert len(exported) == 1, up.output
        trainer = exported[0].split("=", 1)[1].strip()
        tokens_file = library.with_name(f"{library.stem}.tokens.json")
        assert tokens_file.stat().st_mode & 0o777 == 0o600
        assert read_tokens(tokens_file)[trainer].role == TRAINER
        with RuntimeClient(up.address) as client, pytest.raises(Unauthenticated):
            client.get_env("Sample_0006_I__ArrayGcdEnv")
        monkeypatch.setenv(TOKEN_ENV, trainer)
        with RuntimeClient(up.address, timeout_s=60) as client:  # the runtime reaches its workers
            session = client.create_session(ability=ARRAY_GCD)
            assert (
                client.step(session.session_id, '{"name": "Done", "parameters": {"answer": 6}}').reward == 1.0
            )
    finally:
        assert up.stop() == 0

"""Every server answers through the one outcome table: a request whose bytes are not its message is
INVALID_ARGUMENT with the INVALID_REQUEST reason (never UNKNOWN with Python's text), a request the
server refuses names its reason in the `codegym-reason` trailer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from codegym.errors import REASON_TRAILER, Reason
from codegym.llm import LLMSettings
from codegym.sandbox.v1 import sandbox_service_pb2 as sb
from codegym.synthesis.v1 import synthesis_service_pb2 as sy
from codegym.verification.v1 import verification_service_pb2 as vf
from services.synthesis.service import SynthesisServer
from services.verification.service import VerificationServer
from tests.helpers.servers import ServerProcess

BAD_UTF8 = b"\x0a\x04\xff\xfe\xc0\x80"  # field 1 holding invalid UTF-8 (a string or a message)


@pytest.fixture(scope="module")
def worker() -> Iterator[ServerProcess]:
    server = ServerProcess(["serve", "sandbox", "--port", "0", "--jails", "1"])
    try:
        yield server
    finally:
        assert server.stop() == 0


async def call_raw(address: str, path: str, payload: bytes) -> grpc.aio.AioRpcError:
    async with grpc.aio.insecure_channel(address) as channel:
        method = channel.unary_unary(path)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await method(payload, timeout=30)
    return info.value


def reason_of(error: grpc.aio.AioRpcError) -> str:
    return str(dict(error.trailing_metadata() or ()).get(REASON_TRAILER, ""))


@pytest.mark.jail
async def test_the_sandbox_worker_answers_through_the_table(worker: ServerProcess) -> None:
    path = f"/{sb.DESCRIPTOR.services_by_name['SandboxService'].full_name}/Execute"
    error = await call_raw(worker.address, path, BAD_UTF8)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and reason_of(error) == "INVALID_REQUEST"
    # An operation with no source is refused by the servicer itself, through the same table.
    empty = sb.ExecuteRequest(operation=sb.Operation(create=sb.CreateOp(config_json="{}")))
    error = await call_raw(worker.address, path, empty.SerializeToString())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and reason_of(error) == "INVALID_REQUEST"
    assert "source" in (error.details() or "")


@pytest.mark.jail
async def test_the_verification_service_answers_through_the_table(worker: ServerProcess) -> None:
    server = VerificationServer(worker.address)
    await server.start()
    try:
        path = f"/{vf.DESCRIPTOR.services_by_name['VerificationService'].full_name}/CheckEnvironment"
        error = await call_raw(server.address, path, BAD_UTF8)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and reason_of(error) == "INVALID_REQUEST"
        error = await call_raw(server.address, path, vf.CheckEnvironmentRequest().SerializeToString())
        assert reason_of(error) == "INVALID_REQUEST" and "env_source is empty" in (error.details() or "")
    finally:
        await server.stop(grace_s=0)


async def test_the_synthesis_service_answers_through_the_table(tmp_path: Path) -> None:
    # Port 9 on loopback: nothing listens; the requests below never reach the LLM anyway.
    server = SynthesisServer(LLMSettings(base_url="http://127.0.0.1:9/v1"), tmp_path)
    await server.start()
    try:
        name = sy.DESCRIPTOR.services_by_name["SynthesisService"].full_name
        error = await call_raw(server.address, f"/{name}/GenerateEnvironment", BAD_UTF8)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and reason_of(error) == "INVALID_REQUEST"
        empty = sy.GenerateUnitTestsRequest().SerializeToString()
        error = await call_raw(server.address, f"/{name}/GenerateUnitTests", empty)
        assert error.code() == Reason.INVALID_REQUEST.code and reason_of(error) == "INVALID_REQUEST"
    finally:
        await server.stop(grace_s=0)


def test_every_reason_has_one_status_and_a_client_exception() -> None:
    import codegym_client.errors as client

    for reason in Reason:
        assert hasattr(client, reason.value.client_error), reason
        assert isinstance(reason.code, grpc.StatusCode)


def test_a_step_whose_commit_failed_is_resent_only_with_its_index() -> None:
    """OUTCOME_UNKNOWN (the store failed during the commit) is an UNAVAILABLE that may have been
    applied: resending a step without its index could apply it twice; with it, the runtime answers
    from its record."""
    from codegym_client.errors import CodeGymError
    from codegym_client.resend import resend_kind

    def answered(reason: str) -> CodeGymError:
        return CodeGymError(grpc.StatusCode.UNAVAILABLE, "store down", "Step", [(REASON_TRAILER, reason)])

    assert resend_kind(answered("OUTCOME_UNKNOWN"), repeatable=False) == ""
    assert resend_kind(answered("OUTCOME_UNKNOWN"), repeatable=True) == "now"
    assert resend_kind(answered("UNAVAILABLE"), repeatable=False) == "now"  # nothing was applied
    assert Reason.OUTCOME_UNKNOWN.code == grpc.StatusCode.UNAVAILABLE

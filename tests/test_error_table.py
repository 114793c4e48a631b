"""Every server answers through the one outcome table: a request whose bytes are not its message is
INVALID_ARGUMENT with the INVALID_REQUEST reason (never UNKNOWN with Python's text), a request the
server refuses names its reason in the `codegym-reason` trailer."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from codegym.errors import REASON_TRAILER, Reason
from codegym.sandbox.v1 import sandbox_service_pb2 as sb
from codegym.server.auth import ServerAuth
from codegym.synthesis.v1 import synthesis_service_pb2 as sy
from codegym.verification.v1 import verification_service_pb2 as vf
from services.synthesis.service import SynthesisServer
from services.synthesis.settings import LLMSettings, SynthesisSettings
from services.verification.service import VerificationServer
from services.verification.settings import VerificationSettings
from tests.helpers.raw_errors import RawError
from tests.helpers.servers import CodegymServer, worker_fixture

BAD_UTF8 = b"\x0a\x04\xff\xfe\xc0\x80"  # field 1 holding invalid UTF-8 (a string or a message)


worker = worker_fixture()


async def call_raw(address: str, path: str, payload: bytes) -> grpc.aio.AioRpcError:
    async with grpc.aio.insecure_channel(address) as channel:
        method = channel.unary_unary(path)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await method(payload, timeout=30)
    return info.value


def reason_of(error: grpc.aio.AioRpcError) -> str:
    return str(dict(error.trailing_metadata() or ()).get(REASON_TRAILER, ""))


@pytest.mark.jail
async def test_the_sandbox_worker_answers_through_the_table(worker: CodegymServer) -> None:
    path = f"/{sb.DESCRIPTOR.services_by_name['SandboxService'].full_name}/Execute"
    error = await call_raw(worker.address, path, BAD_UTF8)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and reason_of(error) == "INVALID_REQUEST"
    # An operation with no source is refused by the servicer itself, through the same table.
    empty = sb.ExecuteRequest(operation=sb.Operation(create=sb.CreateOp(config_json="{}")))
    error = await call_raw(worker.address, path, empty.SerializeToString())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and reason_of(error) == "INVALID_REQUEST"
    assert "source" in (error.details() or "")


@pytest.mark.jail
async def test_the_verification_service_answers_through_the_table(worker: CodegymServer) -> None:
    server = VerificationServer(VerificationSettings(sandbox=worker.address, port=0), auth=ServerAuth())
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
    server = SynthesisServer(
        SynthesisSettings(port=0, out=str(tmp_path), llm=LLMSettings(base_url="http://127.0.0.1:9/v1")),
        auth=ServerAuth(),
    )
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


async def test_a_stream_entry_is_typed_and_resent_as_the_unary_refusal_it_stands_for() -> None:
    """Every reason, refused in a StepStream entry (`entry_status` → the stream's answer → the
    client's `refused`), raises the exception a unary Step refused with the same reason and
    retry-after raises (`trailers` of the refusal), and is resent the same way."""
    from codegym.errors import EntryStatus, Refusal, entry_status, trailers
    from codegym_client.api.runtime.v1 import runtime_service_pb2 as rt
    from codegym_client.errors import typed_error
    from codegym_client.resend import resend_kind
    from codegym_client.step_streams import refused
    from services.runtime.streaming import StreamedSteps

    reasons = {f"s{k}": reason for k, reason in enumerate(Reason)}

    async def entry(step: rt.StepRequest) -> rt.StepResponse | EntryStatus:
        return entry_status(Refusal(reasons[step.session_id], "refused", 250), "a step")

    stream = StreamedSteps(entry, len(reasons))
    for sid in reasons:
        stream.start(rt.StepStreamRequest(step=rt.StepRequest(session_id=sid), tag=sid))
    answers = {}
    while len(answers) < len(reasons):
        answer = await stream.answers.get()
        assert answer is not None
        answers[answer.tag] = answer
    for sid, reason in reasons.items():
        unary = typed_error(RawError(reason.code, trailers(Refusal(reason, "refused", 250))), "Step")
        streamed = typed_error(refused(answers[sid]), "Step")
        assert (type(streamed), streamed.reason, streamed.code(), streamed.details()) == (
            type(unary),
            unary.reason,
            unary.code(),
            "refused",
        ), reason
        assert (streamed.retryable, streamed.infrastructure, streamed.retry_after_s) == (
            unary.retryable,
            unary.infrastructure,
            0.25,
        )
        for repeatable in (False, True):
            assert resend_kind(streamed, repeatable) == resend_kind(unary, repeatable), reason


# -- the failure table: every column, and no second table ------------------------------------------


def resend_word(error: grpc.RpcError) -> str:
    """What the client does after `error` if the call's reply may be lost, in the docstring's words."""
    from codegym_client.errors import typed_error
    from codegym_client.resend import resend_kind

    typed = typed_error(error, "Step")
    kinds = (resend_kind(typed, repeatable=False), resend_kind(typed, repeatable=True))
    return {
        ("now", "now"): "any call",
        ("", "now"): "repeatable",
        ("", "late"): "repeatable late",
        ("", ""): "never",
    }[kinds]


def written_rows(header: str) -> dict[str, list[str]]:
    import codegym_client.errors as client

    text = client.__doc__ or ""
    lines = text[text.index(header) :].splitlines()
    rows: dict[str, list[str]] = {}
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0].strip("`")] = cells
    return rows


def test_every_reason_row_decides_retry_infrastructure_resend_and_ride_out() -> None:
    """Each reason's row, read through what acts on it: the error's `retryable` and
    `infrastructure`, the client's resend (`resend_kind`) and the adapters' ride-out
    (`clears_by_itself`); and the module docstring's two tables say the same."""
    from codegym_client.errors import FAILURES, is_infrastructure
    from codegym_client.outages import clears_by_itself

    first = written_rows("| reason              |")
    second = written_rows("| failure                              |")
    assert set(first) == set(FAILURES)
    for name, row in FAILURES.items():
        raw = RawError(row.code, ((REASON_TRAILER, name),))
        error = row.error(row.code, "x", "Step", raw.trailing_metadata())
        assert (error.reason, error.retryable, error.infrastructure) == (
            name,
            row.retryable,
            row.infrastructure,
        )
        assert is_infrastructure(error) == row.infrastructure
        word = resend_word(raw)
        assert word == row.resend, name
        assert clears_by_itself(error) == clears_by_itself(raw) == row.rides_out, name
        cells = first[name]
        assert cells[2].strip("`") == row.error.__name__ and cells[1] == row.code.name
        assert (cells[3].startswith("yes") or "retry_after_s" in cells[3]) == row.retryable, name
        assert cells[4] == ("yes" if row.infrastructure else "no"), name
        written = second.get(name, second["any other reason"])
        assert written[1:] == [word, "yes" if row.rides_out else "no"], name


def test_a_failure_that_carries_only_its_status_is_decided_by_its_row() -> None:
    from codegym_client.errors import BY_STATUS, OUTSIDE, typed_error
    from codegym_client.outages import clears_by_itself

    second = written_rows("| failure                              |")
    for code in grpc.StatusCode:
        if code == grpc.StatusCode.OK:
            continue
        row = BY_STATUS.get(code, OUTSIDE)
        raw = RawError(code)
        typed = typed_error(raw, "Step")
        if code in BY_STATUS:
            assert type(typed) is row.error, code
        assert (typed.retryable, typed.infrastructure) == (row.retryable, row.infrastructure), code
        assert resend_word(raw) == row.resend, code
        assert clears_by_itself(raw) == clears_by_itself(typed) == row.rides_out, code
        written = second.get(f"{code.name}, no reason", second["any other status, no reason"])
        assert written[1:] == [row.resend, "yes" if row.rides_out else "no"], code
    # A reason under a status that is not its own did not cause it: the status decides.
    assert resend_word(RawError(grpc.StatusCode.DEADLINE_EXCEEDED, ((REASON_TRAILER, "UNAVAILABLE"),))) == (
        "repeatable late"
    )
    # Anything that is not a gRPC failure is not the table's: never waited out.
    assert not clears_by_itself(ValueError("x"))


def test_the_dispatcher_resends_what_the_table_calls_retryable() -> None:
    """A server calling a sandbox worker sends again an answer whose status is a retryable reason's
    (UNAVAILABLE, RESOURCE_EXHAUSTED); never its own deadline passing."""
    from codegym_client.errors import FAILURES, retryable_answer

    statuses = {row.code for row in FAILURES.values() if row.retryable}
    assert statuses == {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert [c for c in grpc.StatusCode if retryable_answer(c)] == [
        c for c in grpc.StatusCode if c in statuses
    ]


def test_the_step_rule_covers_every_error_a_step_raises() -> None:
    """Every typed error (and a raw gRPC failure) a step raises is the infrastructure's, never the
    model's: the three adapters catch `STEP_FAULTS` and nothing narrower."""
    import codegym_client.errors as client
    from codegym_client.errors import FAILURES, STEP_FAULTS

    for row in FAILURES.values():
        assert issubclass(row.error, STEP_FAULTS)
    assert isinstance(RawError(grpc.StatusCode.UNKNOWN), STEP_FAULTS)
    adapters = ["trl/environment.py", "verl/episode.py", "verl/tool.py"]
    for adapter in adapters:
        assert "except STEP_FAULTS as exc" in (Path(client.__file__).parent / adapter).read_text(), adapter


# Where a set of statuses deciding a failure must not be written: everything but the table.
SCANNED = ["clients/codegym_client", "services", "sandbox_worker", "codegym", "codegym_jobs", "codegym_cli"]
TABLE = "clients/codegym_client/errors.py"


def status_sets(path: Path) -> list[int]:
    """Lines of `path` holding a literal collection of two or more `grpc.StatusCode` members (a
    tuple, set or list, as `in (...)` or `frozenset({...})` write them) or a dict keyed by them."""
    import ast

    tree = ast.parse(path.read_text(), str(path))
    aliases = {"StatusCode"}
    for node in ast.walk(tree):  # S = grpc.StatusCode; from grpc import StatusCode as S
        value = node.value if isinstance(node, ast.Assign) else None
        if isinstance(node, ast.Assign) and isinstance(value, ast.Attribute) and value.attr == "StatusCode":
            aliases |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        if isinstance(node, ast.ImportFrom) and node.module == "grpc":
            aliases |= {a.asname or a.name for a in node.names if a.name == "StatusCode"}

    def is_status(node: ast.AST | None) -> bool:
        if not isinstance(node, ast.Attribute) or node.attr not in grpc.StatusCode.__members__:
            return False
        owner = node.value
        return (isinstance(owner, ast.Attribute) and owner.attr == "StatusCode") or (
            isinstance(owner, ast.Name) and owner.id in aliases
        )

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Tuple | ast.Set | ast.List):
            if sum(map(is_status, node.elts)) >= 2:
                found.append(node.lineno)
        elif isinstance(node, ast.Dict) and any(is_status(k) for k in node.keys):
            found.append(node.lineno)
    return found


def test_no_set_of_statuses_decides_a_failure_outside_the_table(tmp_path: Path) -> None:
    """The failure table is the only place a set of statuses decides what a failure is: a second
    one (`LOST_REPLY`, `TRANSIENT_CODES`, the dispatcher's `RETRYABLE` were three) drifts from it."""
    from tests.conftest import ROOT

    stray = {}
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            if relative == TABLE or "/api/" in relative or relative.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            lines = status_sets(path)
            if lines:
                stray[relative] = lines
    assert not stray, f"sets of gRPC statuses outside {TABLE}: {stray}"
    # The scan sees the ways such a set was written.
    sample = tmp_path / "sets.py"
    sample.write_text(
        "import grpc\n"
        "from grpc import StatusCode as C\n"
        "LOST = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})\n"
        "S = grpc.StatusCode\n"
        "RETRY = (S.UNAVAILABLE, S.RESOURCE_EXHAUSTED)\n"
        "BY = {C.ABORTED: 1}\n"
        "ONE = code == grpc.StatusCode.UNAVAILABLE\n"
    )
    assert sorted(status_sets(sample)) == [3, 5, 6]

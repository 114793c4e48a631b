"""Every server's `--metrics-port`: Prometheus text that moves with the work done."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from codegym.library.store import Library
from codegym.sandbox.v1 import sandbox_service_pb2 as pb
from codegym.sandbox.v1 import sandbox_service_pb2_grpc as pb_grpc
from codegym.synthesis.v1 import synthesis_service_pb2 as sy
from codegym.synthesis.v1 import synthesis_service_pb2_grpc as sy_grpc
from codegym_client.runtime_client import RuntimeClient
from codegym_testkit.fake_llm import ScriptedLLM
from tests.conftest import ENV_DIR
from tests.helpers.processes import sleeping_in_jails, wait_until
from tests.helpers.servers import CodegymServer, start_workers


def metrics_address(server: CodegymServer) -> str:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        found = re.search(r"metrics on (127\.0\.0\.1:\d+)", server.text)
        if found:
            return found.group(1)
        time.sleep(0.05)
    raise AssertionError("no metrics line: " + server.text)


def scrape(address: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


@pytest.mark.jail
def test_sandbox_worker_metrics_count_rpcs_and_operations() -> None:
    worker = CodegymServer(["serve", "sandbox", "--port", "0", "--jails", "1", "--metrics-port", "0"])
    try:
        address = metrics_address(worker)
        before = scrape(address)
        with grpc.insecure_channel(worker.address) as channel:
            stub = pb_grpc.SandboxServiceStub(channel)
            for code in ("print('ok')", "raise SystemExit(3)"):
                op = pb.Operation(source=pb.SourceRef(code=code), run_script=pb.RunScriptOp())
                stub.Execute(pb.ExecuteRequest(operation=op), timeout=30)
            try:
                stub.Execute(pb.ExecuteRequest(operation=pb.Operation()), timeout=30)
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
        # A refusal's status is sent by `abort` before the handler's metrics are recorded: the
        # client can hold its answer before the server has counted it, so wait for the count.
        scraped: list[dict[str, float]] = []

        def counted() -> bool:
            scraped[:] = [scrape(address)]
            seconds = 'codegym_rpc_seconds_count{method="Execute"}'
            return scraped[0].get(seconds, 0.0) - before.get(seconds, 0.0) >= 3

        wait_until(counted, 10, "the worker to count the three calls")
        (after,) = scraped
    finally:
        assert worker.stop() == 0

    def moved(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert moved('codegym_rpc_total{code="OK",method="Execute"}') == 2
    assert moved('codegym_rpc_total{code="INVALID_ARGUMENT",method="Execute"}') == 1
    assert moved('codegym_sandbox_operations_total{op="run_script",status="ok"}') == 1
    assert moved('codegym_sandbox_operations_total{op="run_script",status="env_error"}') == 1
    assert after["codegym_sandbox_jails_alive"] == 1
    assert moved('codegym_rpc_seconds_count{method="Execute"}') == 3


@pytest.mark.jail
def test_an_operation_whose_caller_gave_up_while_it_waited_is_not_run() -> None:
    worker = CodegymServer(["serve", "sandbox", "--port", "0", "--jails", "1", "--metrics-port", "0"])
    try:
        address = metrics_address(worker)
        with grpc.insecure_channel(worker.address) as channel:
            stub = pb_grpc.SandboxServiceStub(channel)
            slow = pb.Operation(
                source=pb.SourceRef(code="import time\ntime.sleep(1.5)"), run_script=pb.RunScriptOp()
            )
            busy = stub.Execute.future(pb.ExecuteRequest(operation=slow), timeout=30)
            wait_until(lambda: sleeping_in_jails(worker.pid), 10, "the slow script to hold the one jail")
            late = pb.Operation(source=pb.SourceRef(code="print('late')"), run_script=pb.RunScriptOp())
            try:
                stub.Execute(pb.ExecuteRequest(operation=late), timeout=0.3)
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert busy.result().result.status == pb.STATUS_OK
            # Once the jail is free the late one is dropped unrun, and the jail serves the next.
            after = pb.Operation(source=pb.SourceRef(code="print('next')"), run_script=pb.RunScriptOp())
            assert stub.Execute(pb.ExecuteRequest(operation=after), timeout=30).result.stdout == "next\n"
        values = scrape(address)
    finally:
        assert worker.stop() == 0
    # Cancelled with its call while it waited: the two others ran, it never did.
    ran = {
        k: v for k, v in values.items() if k.startswith('codegym_sandbox_operations_total{op="run_script"')
    }
    assert ran == {'codegym_sandbox_operations_total{op="run_script",status="ok"}': 2}


def test_synthesis_metrics_count_llm_requests_and_tokens(tmp_path: object) -> None:
    with ScriptedLLM() as llm:
        server = CodegymServer(
            [
                "serve",
                "synthesis",
                "--port",
                "0",
                "--llm-base-url",
                llm.base_url,
                "--out",
                str(tmp_path),
                "--metrics-port",
                "0",
            ]
        )
        try:
            address = metrics_address(server)
            with grpc.insecure_channel(server.address) as channel:
                stub = sy_grpc.SynthesisServiceStub(channel)
                problem = sy.Problem(
                    question_id="M_1", question="Find the gcd of an array.", solution="def f(a): pass"
                )
                for _ in range(2):  # the second answer comes from the response cache
                    stub.GenerateEnvironment(sy.GenerateEnvironmentRequest(problem=problem), timeout=60)
            values = scrape(address)
        finally:
            assert server.stop() == 0
    assert values['codegym_llm_requests_total{stage="environment"}'] == 1
    assert values['codegym_llm_cache_hits_total{stage="environment"}'] == 1
    assert values['codegym_llm_tokens_total{kind="prompt",stage="environment"}'] > 0
    assert values['codegym_rpc_total{code="OK",method="GenerateEnvironment"}'] == 2


@pytest.mark.jail
def test_json_logs_carry_request_and_session_ids(tmp_path: Path) -> None:
    workers = start_workers(1)
    library = tmp_path / "lib.db"
    with Library(library) as lib:
        lib.import_paths([ENV_DIR])
    runtime = CodegymServer(
        [
            "serve",
            "runtime",
            "--port",
            "0",
            "--library",
            str(library),
            "--sandbox",
            workers[0].address,
            "--log-format",
            "json",
            "--log-level",
            "DEBUG",
        ]
    )
    try:
        with RuntimeClient(runtime.address) as client:
            created = client.create_session(env_id="Sample_0006_I__ArrayGcdEnv", config={"nums": [4, 6]})
            client.step(created.session_id, '{"name": "Observe", "parameters": {}}')
    finally:
        runtime.stop()
        for worker in workers:
            worker.stop()
    entries = [json.loads(line) for line in runtime.text.splitlines() if line.startswith("{")]
    assert entries and all({"time", "level", "logger", "message"} <= set(e) for e in entries)
    assert any(e.get("session_id") == created.session_id and e.get("request_id") for e in entries), entries[
        -5:
    ]

"""What a caller is told, and what it is not: the outcome table from the wire.

An environment that cannot start with a config fails the same way on every try, so it must get a
status a trainer does not retry (ENV_FAILED), never a capacity or outage one; a process killed
from outside its session is not the environment's answer: the step runs again, cold, from the
committed state, and the agent sees exactly the observation it would have seen.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import Iterator

import grpc
import pytest

from codegym.errors import REASON_TRAILER, table_markdown
from codegym.library.store import Library
from codegym_client import AsyncRuntimeClient, EnvFailed, RuntimeClient, StepConflict
from tests.conftest import ROOT
from tests.helpers.processes import CLOCK_NANOSLEEP, children, stat_fields, syscall, wait_until
from tests.helpers.servers import CodegymServer

COUNTER = "Test_0001_I__CounterEnv"
COUNTER_PATH = ROOT / "tests" / "fixtures" / "runtime_envs" / f"{COUNTER}.py"


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[CodegymServer, CodegymServer]]:
    library = tmp_path_factory.mktemp("library") / "library.db"
    with Library(library) as lib:
        assert lib.import_paths([COUNTER_PATH]).skipped == []
    worker = CodegymServer(["serve", "sandbox", "--port", "0", "--jails", "1"])
    try:
        args = ["serve", "runtime", "--port", "0", "--library", str(library), "--sandbox", worker.address]
        runtime = CodegymServer(args)
        try:
            yield worker, runtime
        finally:
            assert runtime.stop() == 0
    finally:
        assert worker.stop() == 0


@pytest.fixture(scope="module")
def client(servers: tuple[CodegymServer, CodegymServer]) -> Iterator[RuntimeClient]:
    with RuntimeClient(servers[1].address, timeout_s=60) as c:
        yield c


def reason_of(exc: grpc.RpcError) -> str:
    return dict(exc.trailing_metadata() or ()).get(REASON_TRAILER, "")


@pytest.mark.jail
@pytest.mark.parametrize("fail", ["raise", "loop", "memory"])
def test_an_environment_that_cannot_start_is_env_failed_and_a_sane_config_still_works(
    client: RuntimeClient, fail: str
) -> None:
    with pytest.raises(EnvFailed) as caught:
        client.create_session(env_id=COUNTER, config={"target": 3, "fail": fail})
    error = caught.value
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert reason_of(error) == "ENV_FAILED" and not error.retryable
    assert "the environment failed" in error.details()
    created = client.create_session(env_id=COUNTER, config={"target": 3})
    assert created.observation == "Counter at 0; reach 3."
    assert client.step(created.session_id, '{"name": "Add", "parameters": {"amount": 3}}').observation == "3"
    client.close_session(created.session_id)


@pytest.mark.jail
def test_a_step_whose_process_is_killed_from_outside_runs_again_cold_with_the_same_answer(
    servers: tuple[CodegymServer, CodegymServer], client: RuntimeClient
) -> None:
    worker, _ = servers
    (nsjail,) = children(worker.pid)
    (zygote,) = children(nsjail)
    created = client.create_session(env_id=COUNTER, config={"target": 9})
    assert client.step(created.session_id, '{"name": "Add", "parameters": {"amount": 5}}').observation == "5"
    replies = []
    stepping = threading.Thread(
        target=lambda: replies.append(
            client.step(created.session_id, '{"name": "Slow", "parameters": {"ms": 1500}}')
        )
    )
    stepping.start()
    sleeping: list[int] = []

    def started() -> bool:
        sleeping[:] = [pid for pid in children(zygote) if syscall(pid) == CLOCK_NANOSLEEP]
        return bool(sleeping)

    wait_until(started, 20, "the step to start sleeping")
    # Everything the zygote runs dies, as an OOM kill or an operator would do it: nothing of it is
    # the environment's doing. The spare first, and dead before the session's process is killed: a
    # SIGKILL takes effect when the process next runs, so a spare still dying could be handed the
    # retry and die under it, which is a second fault.
    others = [p for p in children(zygote) if p not in sleeping]
    for pid in others:
        os.kill(pid, signal.SIGKILL)

    def dead(pid: int) -> bool:
        fields = stat_fields(pid)
        return fields is None or fields[0] in ("Z", "X")

    wait_until(lambda: all(dead(pid) for pid in others), 20, "the spare to die")
    for pid in sleeping:
        os.kill(pid, signal.SIGKILL)
    stepping.join(30)
    (reply,) = replies
    assert not reply.HasField("error"), reply.error
    assert reply.observation == "6" and reply.step_index == 2
    # Applied once: the count went from 5 to 6, not to 7.
    assert client.step(created.session_id, '{"name": "Observe", "parameters": {}}').observation == "6"
    assert client.close_session(created.session_id)


def test_the_docs_show_the_outcome_table() -> None:
    """docs/errors.md shows the table as codegym.errors writes it: paste `table_markdown()` there."""
    assert table_markdown() in (ROOT / "docs" / "errors.md").read_text()


@pytest.mark.jail
def test_an_action_reaches_the_environment_as_its_own_json_loads_reads_it(client: RuntimeClient) -> None:
    """CodeGym's own solve() sends float('inf') through json.dumps: `Infinity` is an action the
    environment accepts, so the runtime passes it on; `arguments` (OpenAI's word) is `parameters`."""
    session = client.create_session(env_id=COUNTER, config={"target": 3}).session_id
    assert client.step(session, '{"name": "Add", "arguments": "{\\"amount\\": 2}"}').observation == "2"
    assert client.step(session, '{"name": "Add", "parameters": {"amount": Infinity}}').observation == "inf"
    assert client.step(session, '[{"name": "Add", "arguments": {"amount": -Infinity}}]').observation == "nan"
    both = client.step(session, '{"name": "Add", "parameters": {"amount": 1}, "arguments": {"amount": 1}}')
    assert both.HasField("error") and "not both" in both.error.message and both.step_index == 3
    client.close_session(session)


@pytest.mark.jail
def test_a_resent_step_gets_its_recorded_reply_and_another_action_with_that_index_a_conflict(
    client: RuntimeClient,
) -> None:
    session = client.create_session(env_id=COUNTER, config={"target": 3}).session_id
    add_two = '{"name": "Add", "parameters": {"amount": 2}}'
    first = client.step(session, add_two, step_index=0)
    assert (first.observation, first.step_index) == ("2", 1)
    # The same step again (its reply lost): the recorded reply, not a second application.
    again = client.step(session, add_two, step_index=0)
    assert again == first
    # A different action with the same index: a caller that missed this step, told so.
    with pytest.raises(StepConflict) as caught:
        client.step(session, '{"name": "Add", "parameters": {"amount": 5}}', step_index=0)
    assert caught.value.code() == grpc.StatusCode.ABORTED and "another action" in caught.value.details()
    assert client.step(session, '{"name": "Observe", "parameters": {}}').observation == "2"
    client.close_session(session)


SLOW_MS = 2_500


@pytest.mark.jail
@pytest.mark.parametrize("how", ["step", "batch", "async step", "async batch"])
def test_a_step_longer_than_the_clients_timeout_but_within_the_sessions_own_is_answered_once(
    servers: tuple[CodegymServer, CodegymServer], how: str
) -> None:
    """A client's `timeout_s` (1 s here) is not a step's budget: a session created with
    `step_timeout_ms` above it gets its steps' deadline from that (CreateSession says it back), so a
    legitimately slow step is answered, applied once, instead of timing out and being resent into
    the step it is still running."""
    address = servers[1].address
    slow = f'{{"name": "Slow", "parameters": {{"ms": {SLOW_MS}}}}}'
    if how.startswith("async"):
        session = asyncio.run(async_slow_step(address, slow, batch=how == "async batch"))
    else:
        with RuntimeClient(address, timeout_s=1.0, attempts=2) as client:
            created = client.create_session(env_id=COUNTER, config={"target": 5}, step_timeout_ms=3 * SLOW_MS)
            assert created.step_timeout_ms == 3 * SLOW_MS
            session = created.session_id
            if how == "step":
                assert client.step(session, slow).observation == "1"
            else:
                (result,) = client.batch_step([(session, slow)])
                assert result.response.observation == "1", result
    with RuntimeClient(address, timeout_s=30) as client:
        assert client.get_session(session).step_index == 1
        client.close_session(session)


async def async_slow_step(address: str, slow: str, *, batch: bool) -> str:
    async with AsyncRuntimeClient(address, timeout_s=1.0, attempts=2) as client:
        created = await client.create_session(
            env_id=COUNTER, config={"target": 5}, step_timeout_ms=3 * SLOW_MS
        )
        if batch:
            (result,) = await client.batch_step([(created.session_id, slow)])
            assert result.response.observation == "1", result
        else:
            assert (await client.step(created.session_id, slow)).observation == "1"
        return str(created.session_id)

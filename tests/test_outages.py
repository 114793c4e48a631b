"""Riding out an outage (codegym_client/outages.py): a call made while the runtime is down is
sent again with back-off and succeeds once a runtime serves its address again; a failure that
does not clear by itself is raised at once; a wait that runs out raises the last error.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import pytest

from codegym.procs import free_port
from codegym_client import EnvNotFound, RuntimeClient, RuntimeUnavailable
from codegym_client.errors import REASON_TRAILER, SessionNotFound
from codegym_client.outages import Outage, clears_by_itself, ride_out
from tests.helpers.libraries import SAMPLE_LIBRARY, library_fixture
from tests.helpers.processes import port_free, wait_until
from tests.helpers.servers import CodegymServer, start_runtime, workers_fixture

ENV = "Sample_0001_I__MaxSubarraySumEnv"


library = library_fixture(SAMPLE_LIBRARY)
workers = workers_fixture(1)


@pytest.mark.jail
def test_a_call_made_during_an_outage_succeeds_once_the_runtime_is_back(
    library: Path, workers: list[CodegymServer], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="codegym_client.outages")
    port = free_port()
    results: list[object] = []
    # The runtime is down when the call is made: nothing listens on its address yet.
    with RuntimeClient(f"127.0.0.1:{port}", timeout_s=5, attempts=1) as client:
        caller = threading.Thread(
            target=lambda: results.append(
                ride_out(lambda: client.create_session(env_id=ENV, config={"nums": [1, 2]}), "create", 60)
            )
        )
        caller.start()
        # The outage: the call failed and says what it waits for before a runtime serves the address.
        wait_until(lambda: "cannot serve it now" in caplog.text, 30, "the call to wait out the outage")
        assert not results
        runtime = start_runtime(library, workers, "--port", str(port))
        try:
            caller.join(60)
            assert len(results) == 1
            session = results[0].session_id  # type: ignore[attr-defined]
            assert client.get_session(session).step_index == 0
        finally:
            assert runtime.stop() == 0
    wait_until(lambda: port_free(port), 10, "the runtime's port to be free")


@pytest.mark.jail
def test_a_failure_that_does_not_clear_is_raised_at_once_and_a_wait_that_runs_out_raises(
    library: Path, workers: list[CodegymServer]
) -> None:
    runtime = start_runtime(library, workers)
    try:
        with RuntimeClient(runtime.address, timeout_s=5) as client:
            started = time.monotonic()
            with pytest.raises(EnvNotFound):
                ride_out(lambda: client.create_session(env_id="NoSuchEnv", config={}), "create", 60)
            assert time.monotonic() - started < 5
    finally:
        assert runtime.stop() == 0
    with RuntimeClient(runtime.address, timeout_s=1, attempts=1) as client, pytest.raises(RuntimeUnavailable):
        ride_out(lambda: client.create_session(env_id=ENV, config={"nums": [1]}), "create", 2)


def test_a_step_whose_outcome_is_unknown_is_waited_out_like_an_outage() -> None:
    """OUTCOME_UNKNOWN (the runtime's store failed while it committed a step) clears by itself as
    the store comes back, and every call sent through `ride_out` carries its step index, so the
    runtime answers it again from its record: it is waited out. A lost session is not."""
    outcome = RuntimeUnavailable(
        grpc.StatusCode.UNAVAILABLE, "commit failed", "Step", ((REASON_TRAILER, "OUTCOME_UNKNOWN"),)
    )
    assert outcome.reason == "OUTCOME_UNKNOWN" and not outcome.retryable
    assert clears_by_itself(outcome)
    lost = SessionNotFound(
        grpc.StatusCode.NOT_FOUND, "gone", "Step", ((REASON_TRAILER, "SESSION_NOT_FOUND"),)
    )
    assert not clears_by_itself(lost)


def test_the_calls_of_one_clock_wait_an_outage_out_once() -> None:
    """`Outage`, the clock TRL's spec and verl's loop and tool share: an outage is counted from the
    first call it failed; once the wait is over, each call is sent once; an answer (or a refusal
    that does not clear by itself: the runtime is up) starts the count again."""
    down = RuntimeUnavailable(grpc.StatusCode.UNAVAILABLE, "down", "Step")
    lost = SessionNotFound(
        grpc.StatusCode.NOT_FOUND, "gone", "Step", ((REASON_TRAILER, "SESSION_NOT_FOUND"),)
    )

    def fails(error: Exception) -> Callable[[], object]:
        def call() -> object:
            raise error

        return call

    clock = Outage(wait_s=0.3)
    started = time.monotonic()
    with pytest.raises(RuntimeUnavailable):
        clock.call(fails(down), "first")
    assert 0.25 <= time.monotonic() - started < 2 and clock.remaining() == 0.0
    started = time.monotonic()
    with pytest.raises(RuntimeUnavailable):  # the wait is spent: sent once
        clock.call(fails(down), "second")
    assert time.monotonic() - started < 0.2
    assert clock.call(lambda: "answered", "third") == "answered" and clock.remaining() == 0.3
    with pytest.raises(RuntimeUnavailable):
        asyncio.run(clock.call_async(fails_async(down), "async"))
    assert clock.remaining() == 0.0
    with pytest.raises(SessionNotFound):  # the runtime answered: not an outage
        clock.call(fails(lost), "lost")
    assert clock.remaining() == 0.3


def fails_async(error: Exception) -> Callable[[], Awaitable[object]]:
    async def call() -> object:
        raise error

    return call


def test_verl_shares_one_clock_per_runtime_and_wait() -> None:
    from codegym_client.verl.clients import shared_outage

    assert shared_outage("127.0.0.1:1", 5) is shared_outage("127.0.0.1:1", 5.0)
    assert shared_outage("127.0.0.1:1", 5) is not shared_outage("127.0.0.1:2", 5)
    assert shared_outage("127.0.0.1:1", 5) is not shared_outage("127.0.0.1:1", 6)

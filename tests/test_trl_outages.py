"""The TRL adapter (`codegym_client.trl`) through runtime outages: an episode rides out a runtime
that goes away and comes back on its address within `outage_wait_s` (its step sent with its index,
applied once); a session the runtime lost fails that episode only, unscored, and the next `reset`
plays; an outage longer than the wait fails the episode after about the wait, then ends the run
at the next `reset`.

Real processes throughout: a sandbox worker, runtimes on a fixed loopback port (sessions in memory,
or in a redis-server), the adapter's environments driven as TRL's `GRPOTrainer` drives them. Events
are ordered by conditions (a step's lease held in Redis, the adapter's log line saying it waits),
never by sleeps."""

from __future__ import annotations

import json
import logging
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from codegym.library.store import Library
from codegym.procs import free_port
from codegym_client import RuntimeClient, RuntimeUnavailable, SessionNotFound
from codegym_client.abilities import make_ability
from codegym_client.errors import EpisodeFailed, InfrastructureFailure
from codegym_client.trl import CodeGymEnvironment, CodeGymSpec, environment_class, skip_failed_episodes
from tests.conftest import ROOT
from tests.helpers.libraries import library_fixture
from tests.helpers.processes import wait_until
from tests.helpers.servers import CodegymServer, Redis, start_runtime, workers_fixture

pytestmark = pytest.mark.jail  # every test here starts a sandbox worker

COUNTER = "Test_0001_I__CounterEnv"
RUNTIME_ENVS = ROOT / "tests" / "fixtures" / "runtime_envs"
ABILITY = make_ability(COUNTER, {"target": 5})
ROW = {"prompt": [{"role": "user", "content": ""}], "ability": ABILITY, "env_id": COUNTER}
FIRST = "Counter at 0; reach 5."


library = library_fixture([RUNTIME_ENVS / f"{COUNTER}.py"])
workers = workers_fixture(1)


def environment(spec: CodeGymSpec) -> CodeGymEnvironment:
    """One instance, as TRL draws it from its pool (the counter env: one class)."""
    factory = spec.environment_factory
    assert isinstance(factory, type)
    return factory()


def tool(env: CodeGymEnvironment, name: str, **arguments: object) -> str:
    result: str = getattr(env, name)(**arguments)
    return result


def test_an_episode_rides_out_a_runtime_restart_and_its_step_is_applied_once(
    library: Path, workers: list[CodegymServer], caplog: pytest.LogCaptureFixture
) -> None:
    """Sessions in Redis: the runtime running the episode's step is SIGKILLed while the step holds
    its lease; the step waits out the outage (the adapter says so) until a runtime serves the
    address again, from the same Redis. The episode goes on as recorded: the counter reads 2
    after add 1 and the slow add, not 3, and the episode reaches reward 1."""
    caplog.set_level(logging.WARNING, logger="codegym_client.outages")
    redis = Redis()
    sandbox = workers[0].address
    port = free_port()
    args = [
        "serve",
        "runtime",
        "--port",
        str(port),
        "--library",
        str(library),
        "--sandbox",
        sandbox,
        "--sessions",
        redis.url,
        "--step-lease-s",
        "2",
    ]
    first = CodegymServer(args)
    second: CodegymServer | None = None
    try:
        spec = CodeGymSpec(first.address, instances=[{"ability": ABILITY}], outage_wait_s=120)
        env = environment(spec)
        assert env.reset(**ROW).endswith(FIRST)
        session_id = env._session.session_id
        assert tool(env, "Add", amount=1) == "1"
        with ThreadPoolExecutor(1) as pool:
            slow = pool.submit(tool, env, "Slow", ms=1500)
            wait_until(lambda: redis.lease_held(session_id) or slow.done(), 60, "the slow step to run")
            assert not slow.done(), slow.result()
            first.proc.send_signal(signal.SIGKILL)
            assert first.proc.wait(10) == -signal.SIGKILL
            waiting = f"CodeGym Step 1 of session {session_id}: the CodeGym runtime cannot serve it now"
            wait_until(lambda: waiting in caplog.text, 60, "the step to wait out the outage")
            assert not slow.done()
            second = CodegymServer(args)
            assert slow.result(timeout=120) == "2"
        assert tool(env, "Observe") == "2"  # the slow add was applied once
        assert spec.client().get_session(session_id).step_index == 3
        assert tool(env, "Add", amount=3) == "5"
        assert "Correct" in tool(env, "Done", answer=5)
        assert env.get_reward() == 1.0
        with pytest.raises(SessionNotFound):  # the step that ended the episode closed its session
            spec.client().get_session(session_id)
    finally:
        first.stop()
        if second is not None:
            assert second.stop() == 0
        redis.stop()


def test_a_session_the_runtime_lost_fails_that_episode_unscored_and_the_next_reset_plays(
    library: Path, workers: list[CodegymServer], caplog: pytest.LogCaptureFixture
) -> None:
    """Sessions in memory: the runtime restarts mid-episode (a step made meanwhile waits it out)
    and no longer knows the session. That episode fails: the tool raises an `Exception` (TRL shows
    it to the model), every later tool of it too, at once, and `get_reward()` is None (TRL leaves
    the rollout unscored); a shaping reward wrapped in `skip_failed_episodes` gives None too. No
    exception ends the run, and the instance's next `reset` plays an episode to reward 1."""
    caplog.set_level(logging.WARNING)
    port = free_port()
    first = start_runtime(library, workers, "--port", str(port))
    second: CodegymServer | None = None
    try:
        spec = CodeGymSpec(first.address, instances=[{"ability": ABILITY}], outage_wait_s=120)
        env = environment(spec)
        env.reset(**ROW)
        lost = env._session.session_id
        assert tool(env, "Add", amount=1) == "1"
        assert first.stop() == 0  # its sessions were in its memory
        with ThreadPoolExecutor(1) as pool:
            step = pool.submit(tool, env, "Add", amount=1)
            waiting = f"CodeGym Step 1 of session {lost}: the CodeGym runtime cannot serve it now"
            wait_until(lambda: waiting in caplog.text, 60, "the step to wait out the outage")
            second = start_runtime(library, workers, "--port", str(port))
            with pytest.raises(EpisodeFailed) as failed:
                step.result(timeout=120)
        assert isinstance(failed.value, Exception)  # what TRL's tool loop shows the model: not the run's end
        assert isinstance(failed.value.__cause__, SessionNotFound)
        assert "SESSION_NOT_FOUND" in caplog.text and "the episode ends unscored" in caplog.text
        assert env.get_reward() is None
        sent = caplog.text.count("CodeGym Step")
        with pytest.raises(EpisodeFailed):
            tool(env, "Observe")
        assert caplog.text.count("CodeGym Step") == sent  # refused at once: nothing sent, nothing waited
        shaping = skip_failed_episodes(lambda environments, **_: [0.5 for _ in environments])
        assert shaping(prompts=[""], completions=[""], environments=[env]) == [None]

        assert env.reset(**ROW).endswith(FIRST)  # the next episode of the same instance plays
        assert env._session.session_id not in ("", lost)
        assert tool(env, "Add", amount=5) == "5"
        assert "Correct" in tool(env, "Done", answer=5)
        assert env.get_reward() == 1.0
        assert shaping(prompts=[""], completions=[""], environments=[env]) == [0.5]
    finally:
        first.stop()
        if second is not None:
            assert second.stop() == 0


def test_an_outage_longer_than_the_wait_fails_the_episode_then_a_reset_ends_the_run(
    library: Path, workers: list[CodegymServer], caplog: pytest.LogCaptureFixture
) -> None:
    """`outage_wait_s=2` with the runtime gone mid-episode: the step gives up after about the wait
    (not the client's own resends, not forever), saying what it waited for, and fails its episode
    (unscored). The outage has then outlasted the wait: the next `reset` is sent once and ends the
    run with `InfrastructureFailure`. Environments that saw no outage yet wait the whole wait at
    `reset` before they end it."""
    caplog.set_level(logging.WARNING)
    runtime = start_runtime(library, workers)
    # A client that gives up at once (one send): any longer wait is the adapter's.
    client = RuntimeClient(runtime.address, timeout_s=2, attempts=1)
    try:
        try:
            spec = CodeGymSpec(
                runtime.address, instances=[{"ability": ABILITY}], client=client, outage_wait_s=2
            )
            env = environment(spec)
            env.reset(**ROW)
            session_id = env._session.session_id
            assert tool(env, "Add", amount=1) == "1"
        finally:
            assert runtime.stop() == 0
        started = time.monotonic()
        with pytest.raises(EpisodeFailed) as failed:
            tool(env, "Add", amount=1)
        waited = time.monotonic() - started
        assert isinstance(failed.value.__cause__, RuntimeUnavailable)
        assert 2.0 <= waited < 30, waited
        what = f"CodeGym Step 1 of session {session_id}"
        assert f"{what}: the CodeGym runtime cannot serve it now" in caplog.text
        assert f"{what}: gave up after" in caplog.text
        assert env.get_reward() is None

        with pytest.raises(InfrastructureFailure) as ended:
            try:
                env.reset(**ROW)
            except Exception:
                pytest.fail("a reset the runtime cannot serve was an ordinary Exception")
        assert isinstance(ended.value.__cause__, RuntimeUnavailable)
        assert (
            f"CodeGym CreateSession of {COUNTER}: the CodeGym runtime cannot serve it now" not in caplog.text
        )
        assert "ending the run" in caplog.text

        fresh = environment_class(
            "CounterEnv", spec.environment_factory.tool_schemas, lambda: client, outage_wait_s=2
        )  # type: ignore[union-attr]
        started = time.monotonic()
        with pytest.raises(InfrastructureFailure):
            fresh().reset(**ROW)
        assert 2.0 <= time.monotonic() - started < 30
        assert f"CodeGym CreateSession of {COUNTER}: the CodeGym runtime cannot serve it now" in caplog.text
    finally:
        client.close()


def test_a_run_started_while_the_runtime_is_down_waits_for_it(
    workers: list[CodegymServer], caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """A training script started during a runtime's restart: building the spec (GetEnv, ListEnvs)
    waits out the outage as the episodes' calls do, says so, and goes on once a runtime serves the
    address; it does not end the run before its first step."""
    caplog.set_level(logging.WARNING, logger="codegym_client.outages")
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"env_id": COUNTER, "config": {"target": 5}}) + "\n")
    library = tmp_path / "library.db"
    with Library(library) as lib:  # with a task: a spec over the whole library has a row
        lib.import_paths([RUNTIME_ENVS / f"{COUNTER}.py", tasks])
    port = free_port()
    runtime: CodegymServer | None = None
    try:
        with ThreadPoolExecutor(2) as pool:
            by_rows = pool.submit(
                CodeGymSpec, f"127.0.0.1:{port}", instances=[{"ability": ABILITY}], outage_wait_s=120
            )
            by_library = pool.submit(CodeGymSpec, f"127.0.0.1:{port}", library=True, outage_wait_s=120)
            for what in (f"CodeGym GetEnv {COUNTER}", "CodeGym ListEnvs"):
                wait_until(
                    lambda what=what: f"{what}: the CodeGym runtime cannot serve it now" in caplog.text,
                    60,
                    f"{what} to wait out the outage",
                )
            assert not by_rows.done() and not by_library.done()
            runtime = start_runtime(library, workers, "--port", str(port))
            for spec in (by_rows.result(timeout=120), by_library.result(timeout=120)):
                env = environment(spec)
                assert env.reset(**ROW).endswith(FIRST)
                assert tool(env, "Add", amount=5) == "5"
                assert "Correct" in tool(env, "Done", answer=5)
                assert env.get_reward() == 1.0
    finally:
        if runtime is not None:
            assert runtime.stop() == 0

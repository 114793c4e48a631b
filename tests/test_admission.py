"""Past its capacity the runtime says so: a step over `--max-steps-in-flight` is refused with
CAPACITY and a retry-after hint, nothing of it applied, and sent again later it is served.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from codegym.library.store import Library
from codegym_client import CapacityExceeded, RuntimeClient
from tests.conftest import ROOT
from tests.helpers.processes import sleeping_in_jails, wait_until
from tests.helpers.servers import CodegymServer, start_runtime, start_workers

pytestmark = pytest.mark.jail  # every test here starts a sandbox worker

COUNTER = "Test_0001_I__CounterEnv"
RUNTIME_ENVS = ROOT / "tests" / "fixtures" / "runtime_envs"


def action(name: str, **parameters: int) -> str:
    return json.dumps({"name": name, "parameters": parameters})


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[CodegymServer, CodegymServer]]:
    library = Path(tmp_path_factory.mktemp("admission")) / "library.db"
    with Library(library) as lib:
        lib.import_paths([RUNTIME_ENVS / f"{COUNTER}.py"])
    workers = start_workers(1)
    runtime = start_runtime(library, workers, "--max-steps-in-flight", "1")
    yield runtime, workers[0]
    assert runtime.stop() == 0
    for worker in workers:
        assert worker.stop() == 0


def test_a_step_past_the_steps_in_flight_is_refused_with_a_hint_and_served_when_sent_again(
    servers: tuple[CodegymServer, CodegymServer],
) -> None:
    runtime, worker = servers
    with RuntimeClient(runtime.address, timeout_s=60) as client:
        slow_one = client.create_session(env_id=COUNTER, config={"target": 5}).session_id
        other = client.create_session(env_id=COUNTER, config={"target": 7}).session_id
        answers: list[str] = []
        busy = threading.Thread(
            target=lambda: answers.append(client.step(slow_one, action("Slow", ms=3000)).observation)
        )
        busy.start()
        try:
            wait_until(lambda: bool(sleeping_in_jails(worker.pid)), 20, "the slow step to hold the runtime")
            with pytest.raises(CapacityExceeded) as refused:
                client.step(other, action("Add", amount=1))
            assert refused.value.reason == "CAPACITY"
            assert refused.value.retry_after_s == pytest.approx(0.1)
            assert "steps in flight" in str(refused.value.details())
        finally:
            busy.join(60)
        # Nothing of the refused step was applied: sent again, it is the session's first step.
        again = client.step(other, action("Add", amount=1))
        assert again.step_index == 1
        assert client.get_session(other).step_index == 1
        assert client.get_session(slow_one).step_index == 1 and len(answers) == 1

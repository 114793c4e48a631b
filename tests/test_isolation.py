"""Sessions sharing a jail are strangers: a hostile environment cannot see, read or signal its
neighbours, so their episodes are exactly what they would be alone.

Everything runs in one jail (one worker, `--jails 1`), so every victim's process sits beside the
hostile one's. The hostile session tries to leave a thread behind that keeps sending SIGSTOP and
SIGKILL to every pid (the zygote does not keep a process with a thread left running: it ends with
the step), and between the victims' steps it lists /proc, reads whatever it can of every pid, and
signals every pid and `kill(-1)`.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from codegym.contract import split_env_id
from codegym.library.store import Library
from codegym_client.runtime_client import RuntimeClient
from tests.conftest import ENV_DIR, ROOT, SAMPLES, sample_tasks
from tests.helpers.servers import CodegymServer
from tests.helpers.trajectories import record

pytestmark = pytest.mark.jail  # every test here starts a sandbox worker

NEIGHBOUR = ROOT / "tests" / "fixtures" / "runtime_envs" / "Test_0002_I__NeighbourEnv.py"
NEIGHBOUR_ID = "Test_0002_I__NeighbourEnv"


@pytest.fixture(scope="module")
def runtime(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CodegymServer]:
    library = tmp_path_factory.mktemp("library") / "library.db"
    with Library(library) as lib:
        report = lib.import_paths([ENV_DIR, SAMPLES / "tasks.jsonl", NEIGHBOUR])
    assert report.skipped == []
    worker = CodegymServer(["serve", "sandbox", "--port", "0", "--jails", "1"])
    try:
        args = ["serve", "runtime", "--port", "0", "--library", str(library), "--sandbox", worker.address]
        runtime = CodegymServer(args)
        try:
            yield runtime
        finally:
            assert runtime.stop() == 0
    finally:
        assert worker.stop() == 0


def recorded(tasks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    jobs = [
        {
            "path": str(ENV_DIR / f"{t['env_id']}.py"),
            "class": split_env_id(t["env_id"])[1],
            "config": t["config"],
        }
        for t in tasks
    ]
    return record(jobs)


def test_a_hostile_neighbour_in_the_same_jail_sees_reads_and_signals_nothing(runtime: CodegymServer) -> None:
    tasks = sample_tasks()[::3]
    expected = recorded(tasks)
    victims_done = threading.Event()
    snoops: list[dict[str, Any]] = []
    strikes: list[dict[str, Any]] = []
    with RuntimeClient(runtime.address, timeout_s=60) as client:
        hostile = client.create_session(env_id=NEIGHBOUR_ID, config={"answer": 7}, max_steps=4096)
        storm = client.step(hostile.session_id, '{"name": "Storm", "parameters": {}}')
        assert storm.observation == "storming", storm

        def attack() -> None:
            # At least a few rounds, and on until every victim has finished.
            rounds = 0
            while rounds < 3 or (not victims_done.is_set() and rounds < 1000):
                for tool, into in (("Snoop", snoops), ("Strike", strikes)):
                    reply = client.step(hostile.session_id, json.dumps({"name": tool, "parameters": {}}))
                    assert not reply.HasField("error"), reply.error
                    into.append(json.loads(reply.observation))
                rounds += 1

        def victim(task: dict[str, Any], want: dict[str, Any]) -> list[str]:
            created = client.create_session(env_id=task["env_id"], config=task["config"])
            seen = [created.observation]
            for action, _ in want["steps"]:
                reply = client.step(created.session_id, action)
                seen.append(reply.error.message if reply.HasField("error") else reply.observation)
            final = client.get_session(created.session_id)
            seen.append(f"reward={final.reward}")
            client.close_session(created.session_id)
            return seen

        with ThreadPoolExecutor(5) as pool:
            attacker = pool.submit(attack)
            try:
                played = list(pool.map(victim, tasks, expected))
            finally:
                victims_done.set()
            attacker.result()
        assert client.close_session(hostile.session_id)

    for task, want, seen in zip(tasks, expected, played, strict=True):
        assert seen == [want["first"], *(o for _, o in want["steps"]), f"reward={float(want['reward'])}"], (
            task
        )
    assert len(snoops) >= 3 and len(strikes) >= 3
    for snoop in snoops:
        # Its own process only: no neighbour, not the zygote, nothing of anyone else readable.
        assert snoop["pids"] == [snoop["me"]], snoop
        assert snoop["read"] == [], snoop
    for strike in strikes:
        # kill(-1) answers success even when every target refused (Linux ignores EPERM there): what
        # it reached shows in the victims' episodes above. Signals by pid must all be refused.
        assert [d for d in strike["delivered"] if not d.startswith("-1:")] == [], strike

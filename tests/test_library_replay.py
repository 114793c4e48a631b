"""`codegym library replay`: published reference trajectories played through real sandbox workers.

The library is built from the sample environments; its `trajectories` rows are the samples' real
recorded oracle trajectories (codegym/samples/trajectories.jsonl) rendered as CodeGym publishes
them, Python-literal strings (`repr` of lists), in each of the encodings the reader accepts.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sqlite3
from pathlib import Path
from typing import Any

import grpc
import pytest

from codegym.contract import sha256_text
from codegym.library.store import Library, canonical_config
from codegym.procs import free_port
from codegym.sandbox.v1 import sandbox_service_pb2 as sb
from codegym_cli import library_replay, library_replay_options
from codegym_cli.library_replay import (
    Settings,
    StateFile,
    Unreadable,
    parse_trajectory,
    replay_library,
)
from services.dispatcher import SandboxDispatcher, SandboxUnavailable
from tests.conftest import ENV_DIR, SAMPLES
from tests.helpers.servers import CodegymServer, workers_fixture

RUNTIME_ENVS = Path(__file__).resolve().parent / "fixtures" / "runtime_envs"
COUNTER = "Test_0001_I__CounterEnv"
MAX_SUBARRAY = "Sample_0001_I__MaxSubarraySumEnv"


def recordings() -> list[dict[str, Any]]:
    lines = (SAMPLES / "trajectories.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def std_traj(actions: list[str], style: int = 0) -> str:
    """The actions as a published `std_traj`: JSON texts, action dicts, or one-element lists."""
    if style == 0:
        return repr(actions)
    if style == 1:
        return repr([json.loads(a) for a in actions])
    return repr([[json.loads(a)] for a in actions])


def obs_traj(observations: list[str], first: str | None = None) -> str:
    return repr(observations if first is None else [first, *observations])


def published(line: dict[str, Any], style: int = 0, with_first: bool = False) -> tuple[str, str]:
    actions = [a for a, _ in line["steps"]]
    observations = [o for _, o in line["steps"]]
    return std_traj(actions, style), obs_traj(observations, line["first"] if with_first else None)


def build_library(path: Path) -> Path:
    with Library(path) as library:
        report = library.import_paths([ENV_DIR, SAMPLES / "tasks.jsonl", RUNTIME_ENVS / f"{COUNTER}.py"])
    assert report.skipped == []
    return path


def task_id(path: Path, env_id: str, config: dict[str, Any]) -> int:
    """The id of a task, added when the library lacks it."""
    with Library(path) as library:
        row = library.db.execute(
            "SELECT id FROM tasks WHERE env_id = ? AND config_json = ?", (env_id, canonical_config(config))
        ).fetchone()
        if row is not None:
            return int(row[0])
        with library.db:
            cursor = library.db.execute(
                "INSERT INTO tasks (env_id, config_json) VALUES (?, ?)", (env_id, canonical_config(config))
            )
        assert cursor.lastrowid is not None
        return cursor.lastrowid


def put_trajectory(path: Path, task: int, std: str, obs: str, source_sha: str = "") -> None:
    with sqlite3.connect(path) as db:
        db.execute(
            "INSERT OR REPLACE INTO trajectories (task_id, std_traj, obs_traj) VALUES (?, ?, ?)",
            (task, std, obs),
        )
        db.execute("UPDATE tasks SET source_sha = ? WHERE id = ?", (source_sha, task))


def put_recordings(path: Path, lines: list[dict[str, Any]]) -> list[int]:
    """Every line's trajectory, in turn in each encoding, with and without the reset observation."""
    ids = []
    for i, line in enumerate(lines):
        task = task_id(path, line["env_id"], line["config"])
        put_trajectory(path, task, *published(line, style=i % 3, with_first=i % 2 == 1))
        ids.append(task)
    return ids


def replay(
    capsys: pytest.CaptureFixture[str], library: Path, workers: list[CodegymServer], *options: str
) -> tuple[int, list[dict[str, Any]], str]:
    """Run the command as `codegym library replay` would; the exit code, the --out lines, stdout."""
    parser = argparse.ArgumentParser()
    library_replay_options.add_parser(parser.add_subparsers())
    out = library.parent / "replay.jsonl"
    sandbox = ",".join(w.address for w in workers)
    args = parser.parse_args(
        ["replay", "--library", str(library), "--sandbox", sandbox, "--out", str(out), *options]
    )
    capsys.readouterr()
    code = args.func(args)
    stdout = capsys.readouterr().out
    lines = [json.loads(text) for text in out.read_text().splitlines()]
    return code, lines, stdout


def by_task(lines: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {line["task_id"]: line for line in lines}


workers = workers_fixture(2, jails=2)


@pytest.fixture
def library(tmp_path: Path) -> Path:
    return build_library(tmp_path / "library.db")


# ---- reading the recordings (no sandbox) ----------------------------------------------------------


def test_the_encodings_read_alike_and_an_extra_first_observation_is_the_reset() -> None:
    line = recordings()[0]
    actions = [a for a, _ in line["steps"]]
    observations = [o for _, o in line["steps"]]
    read = [parse_trajectory(std_traj(actions, style), obs_traj(observations)) for style in range(3)]
    assert read[0] == read[1] == read[2]
    assert read[0].actions == actions and read[0].observations == observations and read[0].first is None
    with_first = parse_trajectory(std_traj(actions), obs_traj(observations, line["first"]))
    assert with_first.first == line["first"] and with_first.observations == observations
    # JSON text of the lists, OpenAI's `arguments`, a pair as env.step() returns it, a number.
    assert parse_trajectory(
        json.dumps([{"name": "Add", "arguments": '{"a": 1}'}]), json.dumps(["3"])
    ).actions == ['{"name": "Add", "parameters": {"a": 1}}']
    assert parse_trajectory(repr(['{"name": "Observe"}']), repr([(True, "9")])).observations == ["9"]
    assert parse_trajectory(repr(['{"name": "Observe"}']), repr([9])).observations == ["9"]
    quoted_twice = json.dumps(std_traj(actions)), json.dumps(obs_traj(observations))
    assert parse_trajectory(*quoted_twice) == read[0]


@pytest.mark.parametrize(
    ("std", "obs"),
    [
        ("not a list (", "['1']"),
        ("{'name': 'Observe'}", "['1']"),
        ("[1, 2]", "['1', '2']"),
        ("[\"{'name': 'Observe', 'parameters': {}}\"]", "['1']"),  # a Python dict as text: not JSON
        ("[{'name': 'Observe', 'parameters': [1]}]", "['1']"),
        ("[[{'name': 'A'}, {'name': 'B'}]]", "['1']"),
        ('[\'{"name": "Observe"}\']', "['1', '2', '3']"),
        ('[\'{"name": "Observe"}\', \'{"name": "Observe"}\']', "['1']"),
        ("[]", "[]"),
        ('[\'{"name": "Observe"}\']', "None"),
    ],
)
def test_anything_else_is_unreadable(std: str, obs: str) -> None:
    with pytest.raises(Unreadable):
        parse_trajectory(std, obs)


def test_a_state_file_cut_by_a_kill_keeps_its_whole_lines(tmp_path: Path) -> None:
    path = tmp_path / "state"
    whole = [{"task_id": i, "env_id": "E", "outcome": "identical", "key": f"k{i}"} for i in (1, 2)]
    path.write_text("".join(json.dumps(line) + "\n" for line in whole) + '{"task_id": 3, "env_')
    state = StateFile(path)
    assert sorted(state.done) == [1, 2]
    assert state.finished(1, "k1") is not None and state.finished(1, "changed") is None
    state.record({"task_id": 4, "env_id": "E", "outcome": "identical", "key": "k4"})
    state.close()
    assert sorted(StateFile(path).done) == [1, 2, 4]


def test_usage_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    library_replay_options.add_parser(parser.add_subparsers())
    library = build_library(tmp_path / "library.db")
    line = recordings()[0]
    put_trajectory(library, task_id(library, line["env_id"], line["config"]), *published(line))

    def code(*options: str) -> int:
        args = parser.parse_args(["replay", *options])
        return int(args.func(args))

    assert code("--library", str(tmp_path / "missing.db"), "--sandbox", "127.0.0.1:1") == 2
    assert code("--library", str(library), "--sandbox", " , ") == 2
    assert code("--library", str(library), "--sandbox", "a.example:1,b.example:2") == 2
    # Nothing listens there: no worker answers, which is not a replay's verdict on any task.
    dead = f"127.0.0.1:{free_port()}"
    assert code("--library", str(library), "--sandbox", dead, "--connect-timeout", "0.5") == 2
    assert "no sandbox worker answered" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(["replay", "--sandbox", dead, "--sample", "0"])
    assert exited.value.code == 2


# ---- replaying through real workers ---------------------------------------------------------------


@pytest.mark.jail
def test_recorded_trajectories_replay_identical(
    library: Path, workers: list[CodegymServer], capsys: pytest.CaptureFixture[str]
) -> None:
    ids = put_recordings(library, recordings())
    code, lines, stdout = replay(capsys, library, workers, "--concurrency", "8")
    assert code == 0, stdout
    assert sorted(line["task_id"] for line in lines) == sorted(ids)
    assert {line["outcome"] for line in lines} == {"identical"}
    assert all(line["reward"] == 1.0 and line["done"] for line in lines)
    assert f"{len(ids)} identical, 0 different, 0 failed, 0 infra, 0 unreadable" in stdout
    total = next(row for row in stdout.splitlines() if row.startswith("total "))
    assert total.split()[1:3] == [str(len(ids)), str(len(ids))]
    assert any(row.startswith(MAX_SUBARRAY) for row in stdout.splitlines())


@pytest.mark.jail
def test_an_altered_observation_is_different_at_its_step(
    library: Path, workers: list[CodegymServer], capsys: pytest.CaptureFixture[str]
) -> None:
    lines = recordings()
    same, altered, reset = lines[0], lines[1], lines[2]
    put_recordings(library, [same])
    steps = [list(step) for step in altered["steps"]]
    steps[2][1] = steps[2][1] + " (edited)"
    altered_task = task_id(library, altered["env_id"], altered["config"])
    put_trajectory(library, altered_task, *published({**altered, "steps": steps}))
    reset_task = task_id(library, reset["env_id"], reset["config"])
    put_trajectory(library, reset_task, *published({**reset, "first": "Another reset."}, with_first=True))

    code, out, stdout = replay(capsys, library, workers)
    assert code == 1
    found = by_task(out)
    assert found[altered_task]["outcome"] == "different"
    assert found[altered_task]["step"] == 3
    assert found[altered_task]["action"] == altered["steps"][2][0]
    assert found[altered_task]["expected"] == altered["steps"][2][1] + " (edited)"
    assert found[altered_task]["got"] == altered["steps"][2][1]
    assert found[reset_task]["outcome"] == "different" and found[reset_task]["step"] == 0
    assert found[reset_task]["expected"] == "Another reset." and found[reset_task]["got"] == reset["first"]
    assert [line["outcome"] for line in out].count("identical") == 1
    assert f"different  task {altered_task} {altered['env_id']} step 3" in stdout


@pytest.mark.jail
def test_unreadable_rows_are_reported_apart_and_never_as_different(
    library: Path, workers: list[CodegymServer], capsys: pytest.CaptureFixture[str]
) -> None:
    lines = recordings()
    good = put_recordings(library, lines[:1])[0]
    garbage = task_id(library, lines[1]["env_id"], lines[1]["config"])
    put_trajectory(library, garbage, "<<garbage>>", published(lines[1])[1])
    short = task_id(library, lines[2]["env_id"], lines[2]["config"])
    put_trajectory(library, short, published(lines[2])[0], obs_traj([o for _, o in lines[2]["steps"]][:-2]))

    code, out, stdout = replay(capsys, library, workers)
    found = by_task(out)
    assert found[good]["outcome"] == "identical"
    assert found[garbage]["outcome"] == "unreadable" and "std_traj" in found[garbage]["message"]
    assert found[short]["outcome"] == "unreadable" and "observations" in found[short]["message"]
    assert code == 0  # nothing differed or failed
    assert "0 different" in stdout and "2 unreadable" in stdout


def variant_of_max_subarray() -> str:
    """MaxSubarraySumEnv whose Observe answers otherwise: the code some task was recorded with."""
    source = (ENV_DIR / f"{MAX_SUBARRAY}.py").read_text()
    changed = source.replace("return str(len(self.nums))", 'return "Length: " + str(len(self.nums))', 1)
    assert changed != source
    return changed


@pytest.mark.jail
def test_a_task_recorded_with_a_variant_is_replayed_with_that_code(
    library: Path, workers: list[CodegymServer], capsys: pytest.CaptureFixture[str]
) -> None:
    source = variant_of_max_subarray()
    sha = sha256_text(source)
    with sqlite3.connect(library) as db:
        tools_json, tools_text = db.execute(
            "SELECT tools_json, tools_text FROM envs WHERE env_id = ?", (MAX_SUBARRAY,)
        ).fetchone()
        db.execute(
            "INSERT INTO variants (sha256, env_id, source, tools_json, tools_text) VALUES (?, ?, ?, ?, ?)",
            (sha, MAX_SUBARRAY, source, tools_json, tools_text),
        )
    own = [line for line in recordings() if line["env_id"] == MAX_SUBARRAY][:3]

    def as_variant_saw_it(line: dict[str, Any]) -> dict[str, Any]:
        steps = [
            [action, "Length: " + obs if json.loads(action)["name"] == "Observe" else obs]
            for action, obs in line["steps"]
        ]
        assert steps != line["steps"]
        return {**line, "steps": steps}

    recorded_with_variant, same_without_source, missing_code = (
        task_id(library, line["env_id"], line["config"]) for line in own
    )
    put_trajectory(library, recorded_with_variant, *published(as_variant_saw_it(own[0])), source_sha=sha)
    # The same kind of recording on a task that names no code of its own: its env's code answers "9".
    put_trajectory(library, same_without_source, *published(as_variant_saw_it(own[1])))
    put_trajectory(library, missing_code, *published(own[2]), source_sha="ab" * 32)

    code, out, _ = replay(capsys, library, workers)
    found = by_task(out)
    assert found[recorded_with_variant]["outcome"] == "identical"
    assert found[recorded_with_variant]["source_sha"] == sha
    assert found[same_without_source]["outcome"] == "different"
    assert found[same_without_source]["got"] == own[1]["steps"][0][1]
    assert found[missing_code]["outcome"] == "failed" and found[missing_code]["fault"] == "library"
    assert code == 1


@pytest.mark.jail
def test_a_sample_with_a_seed_picks_the_same_rows_every_time(
    library: Path, workers: list[CodegymServer], capsys: pytest.CaptureFixture[str]
) -> None:
    ids = put_recordings(library, recordings())
    runs = itertools.count()

    def sample(seed: str, *more: str) -> list[int]:
        state = library.parent / f"state-{next(runs)}"  # a fresh state: every run replays its sample
        code, out, _ = replay(
            capsys, library, workers, "--sample", "3", "--seed", seed, "--state", str(state), *more
        )
        assert code == 0
        assert not any(line["resumed"] for line in out)
        return sorted(line["task_id"] for line in out)

    first = sample("7")
    assert len(first) == 3 and set(first) <= set(ids)
    assert sample("7", "--concurrency", "1") == first
    assert sample("8") != first
    prefixed = sample("7", "--prefix", "Sample_0002")
    with Library(library, read_only=True) as lib:
        assert {
            lib.db.execute("SELECT env_id FROM tasks WHERE id = ?", (i,)).fetchone()[0] for i in prefixed
        } == {"Sample_0002_I__PalindromeCheckEnv"}


class Gate:
    """Workers for a partial run: tasks outside `allowed` never get an answer (their create waits
    until the run is stopped), as a run killed while they were in flight."""

    def __init__(self, dispatcher: SandboxDispatcher, allowed: set[int]) -> None:
        self.dispatcher = dispatcher
        self.allowed = allowed

    async def execute(self, op: sb.Operation, source: str, key: str = "") -> sb.OperationResult:
        if int(key.split("-")[1]) not in self.allowed:  # keys are replay-{task id}-{nonce}
            await asyncio.Event().wait()
        return await self.dispatcher.execute(op, source, key)

    async def release(self, key: str) -> None:
        await self.dispatcher.release(key)


@pytest.mark.jail
def test_a_second_run_resumes_where_a_stopped_one_left_off(
    library: Path, workers: list[CodegymServer], capsys: pytest.CaptureFixture[str]
) -> None:
    ids = put_recordings(library, recordings()[:20])
    state_path = library.parent / "replay.jsonl.state"  # the default beside --out
    allowed = set(ids[:6])  # taken first: the run's other tasks wait behind them

    async def stopped_run() -> None:
        dispatcher = SandboxDispatcher([w.address for w in workers])
        state = StateFile(state_path)
        done = asyncio.Event()
        finished: list[int] = []

        def progress(line: dict[str, Any]) -> None:
            finished.append(line["task_id"])
            if len(finished) == len(allowed):
                done.set()

        with Library(library, read_only=True) as lib:
            run = asyncio.create_task(
                replay_library(lib, ids, Gate(dispatcher, allowed), state, None, Settings(3), progress)
            )
            await done.wait()
            run.cancel()
            with pytest.raises(asyncio.CancelledError):
                await run
        state.close()
        await dispatcher.close()
        assert sorted(finished) == sorted(allowed)

    asyncio.run(stopped_run())
    assert sorted(StateFile(state_path).done) == sorted(allowed)

    code, out, stdout = replay(capsys, library, workers)
    assert code == 0
    assert sorted(line["task_id"] for line in out) == sorted(ids)
    assert {line["task_id"] for line in out if line["resumed"]} == allowed
    assert f"{len(ids)} tasks ({len(allowed)} finished earlier" in stdout
    assert f"{len(ids)} identical" in stdout
    assert sorted(StateFile(state_path).done) == sorted(ids)

    # A recording changed since its verdict is replayed again; the rest are all taken from the state.
    changed = ids[0]
    line = recordings()[0]
    steps = [list(step) for step in line["steps"]]
    steps[0][1] = "changed"
    put_trajectory(library, changed, *published({**line, "steps": steps}))
    code, out, stdout = replay(capsys, library, workers)
    assert code == 1
    assert [line["task_id"] for line in out if not line["resumed"]] == [changed]
    assert by_task(out)[changed]["outcome"] == "different"
    assert StateFile(state_path).finished(changed, by_task(out)[changed]["key"]) == {
        k: v for k, v in by_task(out)[changed].items() if k != "resumed"
    }
    assert f"{len(ids) - 1} identical, 1 different" in stdout


@pytest.mark.jail
def test_an_environment_that_raises_or_hangs_is_failed(
    library: Path, workers: list[CodegymServer], capsys: pytest.CaptureFixture[str]
) -> None:
    def action(name: str, **parameters: Any) -> str:
        return json.dumps({"name": name, "parameters": parameters})

    boom = task_id(library, COUNTER, {"target": 2})
    put_trajectory(
        library,
        boom,
        std_traj([action("Observe"), action("Add", amount=1), action("Boom"), action("Done", answer=2)]),
        obs_traj(["0", "1", "?", "?"]),
    )
    cannot_start = task_id(library, COUNTER, {"target": 1, "fail": "raise"})
    put_trajectory(library, cannot_start, std_traj([action("Observe")]), obs_traj(["0"]))
    spins = task_id(library, COUNTER, {"target": 3})
    put_trajectory(library, spins, std_traj([action("Add", amount=1), action("Spin")]), obs_traj(["1", "?"]))
    fine = put_recordings(library, recordings()[:1])[0]

    code, out, stdout = replay(capsys, library, workers, "--step-timeout-ms", "1000")
    assert code == 1
    found = by_task(out)
    assert found[fine]["outcome"] == "identical"
    for task, step, status in ((boom, 3, "env_error"), (cannot_start, 0, "env_error"), (spins, 2, "timeout")):
        assert found[task]["outcome"] == "failed", found[task]
        assert (found[task]["fault"], found[task]["step"], found[task]["status"]) == (
            "environment",
            step,
            status,
        )
    assert "boom" in found[boom]["message"]
    assert "3 failed" in stdout and "0 different" in stdout and "0 infra" in stdout


class Flaky:
    """Workers behind a broken network: `down` tasks never get through; `once` tasks' first
    operation is lost (the next send goes through)."""

    def __init__(self, dispatcher: SandboxDispatcher, down: set[int], once: set[int]) -> None:
        self.dispatcher = dispatcher
        self.down = down
        self.once = set(once)

    async def execute(self, op: sb.Operation, source: str, key: str = "") -> sb.OperationResult:
        task = int(key.split("-")[1])
        if task in self.down or task in self.once:
            self.once.discard(task)
            raise SandboxUnavailable(grpc.StatusCode.UNAVAILABLE, "sandbox workers unavailable (test)")
        return await self.dispatcher.execute(op, source, key)

    async def release(self, key: str) -> None:
        await self.dispatcher.release(key)


@pytest.mark.jail
def test_an_infrastructure_fault_is_failed_apart_and_tried_again_next_run(
    library: Path, workers: list[CodegymServer], capsys: pytest.CaptureFixture[str]
) -> None:
    down, once, *rest = put_recordings(library, recordings()[:4])
    state_path = library.parent / "state"

    async def run() -> library_replay.Tally:
        dispatcher = SandboxDispatcher([w.address for w in workers])
        state = StateFile(state_path)
        try:
            with Library(library, read_only=True) as lib:
                return await replay_library(
                    lib, [down, once, *rest], Flaky(dispatcher, {down}, {once}), state, None, Settings(2)
                )
        finally:
            state.close()
            await dispatcher.close()

    tally = asyncio.run(run())
    totals = tally.total()
    assert (totals["infra"], totals["identical"], totals["different"], totals["failed"]) == (1, 3, 0, 0)
    assert tally.problems[0]["task_id"] == down and tally.problems[0]["fault"] == "infrastructure"
    assert sorted(StateFile(state_path).done) == sorted([once, *rest])  # no verdict on `down`

    code, out, stdout = replay(capsys, library, workers, "--state", str(state_path))
    assert code == 0
    assert [line["task_id"] for line in out if not line["resumed"]] == [down]
    assert "4 identical" in stdout

"""The operator's side of the curriculum: `codegym library stats|sample|quarantine|label`, and
`export`/`eval --learnability`, against a real runtime and sandbox worker on port 0.

A run plays three sample tasks through the runtime with the recorded oracle actions: one always
solved (mastered), one always answered wrong (unsolved), one solved once in two (learnable). The
commands then read what the runtime recorded, over its RPCs, as an operator would; the bad inputs
(a run nobody played, a runtime that is not there, a library without the tasks) each give one
clear line.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from codegym.library.store import Library, canonical_config
from codegym.procs import free_port
from codegym_cli.cli import build_parser, main
from codegym_cli.eval import load_tasks
from codegym_client import RuntimeClient
from tests.conftest import ENV_DIR, ROOT, SAMPLES
from tests.helpers.processes import wait_until
from tests.helpers.servers import CodegymServer, start_runtime, start_workers

RUN = "run-curriculum"
MAX_SUBARRAY = "Sample_0001_I__MaxSubarraySumEnv"
MERGE = "Sample_0005_I__MergeIntervalsEnv"
COUNTER = "Test_0001_I__CounterEnv"
# (env id, config, outcomes of the run's episodes): mastered, unsolved, learnable.
PLAYS: list[tuple[str, dict[str, Any], list[bool]]] = [
    (MAX_SUBARRAY, {"nums": [1]}, [True, True]),
    (MERGE, {"intervals": [[5, 7], [1, 2]]}, [False, False]),
    (MERGE, {"intervals": [[1, 4], [4, 5]]}, [True, False]),
]
LABELS = {0: "mastered", 1: "unsolved", 2: "learnable"}
TRAJECTORIES = [json.loads(x) for x in (SAMPLES / "trajectories.jsonl").read_text().splitlines() if x.strip()]


def ability(env_id: str, config: dict[str, Any]) -> str:
    return f"codegym_v1@{env_id}@{json.dumps(config)}"


def oracle_actions(env_id: str, config: dict[str, Any]) -> list[str]:
    for t in TRAJECTORIES:
        if t["env_id"] == env_id and t["config"] == config:
            return [action for action, _ in t["steps"]]
    raise KeyError((env_id, config))


def wrong_answer(action: str) -> str:
    """The oracle's final Done with an answer no task of these has."""
    call = json.loads(action)
    assert call["name"] == "Done"
    call["parameters"]["answer"] = [[-1, -1]] if isinstance(call["parameters"]["answer"], list) else -12345
    return json.dumps(call)


def play(client: RuntimeClient, env_id: str, config: dict[str, Any], solve: bool) -> None:
    actions = oracle_actions(env_id, config)
    if not solve:
        actions = [*actions[:-1], wrong_answer(actions[-1])]
    session = client.create_session(ability=ability(env_id, config), run_id=RUN, policy_version=7).session_id
    for action in actions:
        response = client.step(session, action)
        assert not response.error.code, response
    assert response.done and (response.reward > 0) == solve, response
    client.close_session(session)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run `codegym ARGV` in this process: its exit code, stdout and stderr."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[dict[str, Any]], str]:
    """`run`, for a command whose stdout is JSON lines (every line is one)."""
    code, out, err = run(capsys, *argv)
    return code, [json.loads(line) for line in out.splitlines()], err


def sample_library(path: Path) -> Path:
    with Library(path) as library:
        library.import_paths([ENV_DIR, SAMPLES / "tasks.jsonl"])
        library.import_paths([ROOT / "tests" / "fixtures" / "runtime_envs" / f"{COUNTER}.py"])
    return path


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sample_library(tmp_path_factory.mktemp("curriculum") / "library.db")


@pytest.fixture(scope="module")
def target(library: Path) -> Iterator[str]:
    workers = start_workers(1, jails=2)
    runtime = None
    try:
        runtime = start_runtime(library, workers)
        yield runtime.address
    finally:
        for server in [runtime, *workers]:
            if isinstance(server, CodegymServer):
                server.stop()


def stats_lines(target: str, *args: str) -> list[dict[str, Any]]:
    from codegym_cli.library_curriculum import entry_dict

    with RuntimeClient(target) as client:
        return [entry_dict(e) for e in client.stats(*args)]


@pytest.fixture(scope="module")
def played(target: str) -> str:
    """The run's episodes, played and visible in the record (it is flushed about once a second)."""
    with RuntimeClient(target) as client:
        for env_id, config, outcomes in PLAYS:
            for solve in outcomes:
                play(client, env_id, config, solve)
    episodes = sum(len(outcomes) for _, _, outcomes in PLAYS)

    def recorded() -> bool:
        lines = stats_lines(target, RUN)
        return sum(line.get("episodes", 0) for line in lines if line["kind"] == "task") == episodes

    wait_until(recorded, 30, "the run's episodes in the runtime's record")
    return target


@pytest.mark.jail
def test_stats_prints_each_played_task_then_each_env_as_json_lines(
    played: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, lines, err = cli(capsys, "library", "stats", "--target", played, "--run", RUN, "--played-only")
    assert code == 0, err
    kinds = [line["kind"] for line in lines]
    assert kinds == sorted(kinds, key=lambda k: k != "task"), "tasks first, then envs"
    tasks = {line["ability"]: line for line in lines if line["kind"] == "task"}
    assert set(tasks) == {ability(env_id, config) for env_id, config, _ in PLAYS}
    for env_id, config, outcomes in PLAYS:
        task = tasks[ability(env_id, config)]
        assert (task["env_id"], task["episodes"], task["passes"]) == (env_id, len(outcomes), sum(outcomes))
        assert task["pass_rate"] == pytest.approx(sum(outcomes) / len(outcomes))
        assert task["recent_episodes"] == len(outcomes)
        assert task["endings"] == {"done": len(outcomes)}
        assert task["mean_steps"] == pytest.approx(len(oracle_actions(env_id, config)))
        assert task["last_policy_version"] == 7
        # Every field is there, defaults included, with its proto name and a JSON number.
        assert {"step_errors", "oracle_steps", "pool", "recent_pass_rate"} <= set(task)
        assert isinstance(task["episodes"], int)
    envs = {line["env_id"]: line for line in lines if line["kind"] == "env"}
    assert envs[MAX_SUBARRAY]["episodes"] == 2 and envs[MAX_SUBARRAY]["passes"] == 2
    assert envs[MERGE]["episodes"] == 4 and envs[MERGE]["passes"] == 1
    assert envs[MERGE]["quarantined"] is False and envs[MERGE]["quarantine_reason"] == ""
    assert "3 tasks (3 played)" in err

    code, only_envs, _ = cli(capsys, "library", "stats", "--target", played, "--run", RUN, "--envs-only")
    assert code == 0 and {line["kind"] for line in only_envs} == {"env"}
    code, prefixed, _ = cli(
        capsys, "library", "stats", "--target", played, "--run", RUN, "--played-only", "--env-prefix", MERGE
    )
    assert code == 0 and {line["env_id"] for line in prefixed} == {MERGE}


@pytest.mark.jail
def test_stats_of_a_run_nobody_played_is_empty_and_says_so(
    played: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, lines, err = cli(capsys, "library", "stats", "--target", played, "--run", "nobody", "--played-only")
    assert code == 0
    assert [line for line in lines if line["kind"] == "task"] == []
    assert "no finished episode of run 'nobody' is recorded" in err


@pytest.mark.jail
def test_sample_prints_n_chosen_tasks_and_the_pools(played: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "library",
        "sample",
        "--target",
        played,
        "--run",
        RUN,
        "-n",
        "4",
        "--seed",
        "3",
        "--min-episodes",
        "2",
    ]
    code, chosen, err = cli(capsys, *argv)
    assert code == 0, err
    assert len(chosen) == 4 and len({c["ability"] for c in chosen}) == 4
    for task in chosen:
        assert set(task) == {"ability", "env_id", "pool", "pass_rate", "episodes"}
        assert task["ability"].startswith(f"codegym_v1@{task['env_id']}@")
        assert task["pool"] in {"learnable", "unseen", "mastered", "unsolved"}
    learnable = ability(MERGE, {"intervals": [[1, 4], [4, 5]]})
    assert {
        "ability": learnable,
        "env_id": MERGE,
        "pool": "learnable",
        "pass_rate": 0.5,
        "episodes": 2,
    } in chosen
    assert "4 of 4 chosen for run 'run-curriculum'; pools:" in err and "learnable 1" in err
    # The same seed and record give the same choice.
    assert cli(capsys, *argv)[1] == chosen

    code, _, err = cli(
        capsys,
        "library",
        "sample",
        "--target",
        played,
        "--run",
        RUN,
        "-n",
        "2",
        "--low",
        "0.8",
        "--high",
        "0.2",
    )
    assert code == 2 and "--low 0.8 must be below --high 0.2" in err


@pytest.mark.jail
def test_label_writes_learnability_that_export_and_eval_filter_by(
    played: str, library: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    labelled = tmp_path / "labelled.db"
    shutil.copy(library, labelled)
    argv = ["library", "label", "--from-stats", "--target", played, "--run", RUN, "--library", str(labelled)]

    # Two episodes each: under the default four, every label is left as it was.
    code, _, err = run(capsys, *argv)
    assert code == 0 and "3 played tasks have fewer than 4 episodes" in err
    with Library(labelled) as lib:
        assert {t.learnability for t in lib.iter_tasks()} == {""}

    code, out, err = run(capsys, *argv, "--min-episodes", "2")
    assert code == 0, err
    assert f"labelled 3 tasks in {labelled} from run '{RUN}': unsolved 1, learnable 1, mastered 1" in out
    with Library(labelled) as lib:
        for i, (env_id, config, _) in enumerate(PLAYS):
            task = lib.task(env_id, canonical_config(config))
            assert task is not None and task.learnability == LABELS[i]
            assert task.difficulty in ("easy", "medium", "hard")  # the published column, untouched
        assert sum(1 for t in lib.iter_tasks() if t.learnability) == 3

    out_file = tmp_path / "learnable.jsonl"
    export = ["export", "--library", str(labelled), "--include-unverified", "--out", str(out_file)]
    assert main([*export, "--learnability", "learnable"]) == 0
    rows = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert [r["ability"] for r in rows] == [ability(*PLAYS[2][:2])]
    assert rows[0]["extra_info"]["learnability"] == "learnable"
    with Library(labelled) as lib:
        _, task_count = lib.counts()
    assert f"dropped {task_count - 1} labelled otherwise or not labelled" in capsys.readouterr().err
    assert main([*export, "--learnability", "mastered,unsolved"]) == 0
    rows = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert sorted(r["ability"] for r in rows) == sorted([ability(*PLAYS[0][:2]), ability(*PLAYS[1][:2])])
    parquet = tmp_path / "all.parquet"
    assert main(["export", "--library", str(labelled), "--include-unverified", "--out", str(parquet)]) == 0
    import pyarrow.parquet as pq

    labels = [r["extra_info"]["learnability"] for r in pq.read_table(parquet).to_pylist()]
    assert sorted(label for label in labels if label) == ["learnable", "mastered", "unsolved"]

    eval_argv = ["eval", "--library", str(labelled), "--out", str(tmp_path / "ev"), "--model", "m"]
    tasks = load_tasks(build_parser().parse_args([*eval_argv, "--learnability", "mastered"]))
    assert [t.ability for t in tasks] == [ability(*PLAYS[0][:2])]
    with pytest.raises(SystemExit):
        build_parser().parse_args([*eval_argv, "--learnability", "hard"])  # difficulty is not a label
    capsys.readouterr()


@pytest.mark.jail
def test_label_into_a_library_without_the_tasks_says_so(
    played: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = tmp_path / "other.db"
    with Library(other) as lib:
        lib.import_paths([ENV_DIR / "Sample_0006_I__ArrayGcdEnv.py"])
    argv = ["library", "label", "--from-stats", "--target", played, "--run", RUN, "--min-episodes", "1"]
    code, _, err = run(capsys, *argv, "--library", str(other))
    assert code == 1
    assert f"3 of the tasks to label are not in {other} (is it the library the runtime serves?)" in err

    code, _, err = run(capsys, *argv, "--library", str(tmp_path / "missing.db"))
    assert code == 2 and "no library at" in err
    code, _, err = run(capsys, *argv, "--run", "nobody", "--library", str(other))  # the last --run counts
    assert code == 1 and "no finished episode of run 'nobody' is recorded: nothing to label" in err


@pytest.mark.jail
def test_quarantine_lists_failing_envs_with_evidence_and_lift_lets_them_back(
    target: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with RuntimeClient(target) as client:
        session = client.create_session(env_id=COUNTER, config={"target": 3}, run_id=RUN).session_id
        for _ in range(24):
            assert client.step(session, '{"name": "Boom", "parameters": {}}').error.code
        client.close_session(session)

    def listed() -> list[dict[str, Any]]:
        code, lines, _ = cli(capsys, "library", "quarantine", "--target", target)
        assert code == 0
        return lines

    wait_until(lambda: bool(listed()), 30, "the failing environment quarantined")
    (line,) = listed()
    assert line["kind"] == "env" and line["env_id"] == COUNTER and line["quarantined"] is True
    assert "failed" in line["quarantine_reason"] and line["step_errors"]["env_error"] >= 24
    assert line["recent_errors"]

    assert main(["library", "quarantine", "--target", target, "--lift", COUNTER]) == 0
    assert capsys.readouterr().out == f"lifted the quarantine of {COUNTER}: it is sampled again\n"
    assert listed() == []
    code, _, err = cli(capsys, "library", "quarantine", "--target", target, "--lift", COUNTER)
    assert code == 1 and f"{COUNTER} is not quarantined: nothing lifted" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["library", "stats"],
        ["library", "sample", "--run", RUN, "-n", "2"],
        ["library", "quarantine"],
        ["library", "quarantine", "--lift", COUNTER],
        ["library", "label", "--from-stats"],
        ["library", "history"],
    ],
)
def test_a_runtime_that_is_not_there_is_one_line_and_exit_1(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    nowhere = f"127.0.0.1:{free_port()}"
    if "label" in argv:
        argv = [*argv, "--library", str(sample_library(tmp_path / "library.db"))]
    code, lines, err = cli(capsys, *argv, "--target", nowhere, "--connect-timeout", "1")
    assert code == 1 and lines == []
    assert err.splitlines() == [
        f"codegym {' '.join(argv[:2])}: cannot reach {nowhere}: connection refused (nothing listens there)"
    ]


@pytest.mark.jail
def test_history_prints_the_runs_pools_by_policy_version_and_refuses_an_unknown_run(
    played: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The run played at policy version 7: one point, its three played tasks by pool (the default
    band, fewer than 4 episodes each: all still learnable), their three groups of two episodes
    (two of them with rewards all equal) and their moves out of unseen. A run nobody played is one
    clear line."""
    code, points, err = cli(capsys, "library", "history", "--target", played, "--run", RUN)
    assert code == 0, err
    assert [
        (p["policy_version"], p["played"], p["learnable"], p["mastered"], p["unsolved"]) for p in points
    ] == [(7, 3, 3, 0, 0)]
    assert [
        (p["groups"], p["multi_episode_groups"], p["zero_variance_groups"], p["moves"]) for p in points
    ] == [(3, 3, 2, [{"from_pool": "unseen", "to_pool": "learnable", "tasks": 3}])]
    assert points[0]["at"] > 0 and "1 policy versions of run" in err
    code, points, err = cli(capsys, "library", "history", "--target", played, "--run", "nobody-ran-this")
    assert code == 1 and points == []
    assert "refused RunHistory: INVALID_ARGUMENT: no run 'nobody-ran-this' is recorded" in err, err


def test_a_library_from_before_the_label_is_read_as_unlabelled_and_gains_the_column(tmp_path: Path) -> None:
    path = tmp_path / "older.db"
    with Library(path) as lib:
        lib.import_paths([ENV_DIR / "Sample_0006_I__ArrayGcdEnv.py", SAMPLES / "tasks.jsonl"])
    db = sqlite3.connect(path)
    with db:
        db.execute("ALTER TABLE tasks DROP COLUMN learnability")  # as an earlier release wrote it
    db.close()
    with Library(path, read_only=True) as lib:  # read as it is: nothing changed, no label
        tasks = lib.tasks_of("Sample_0006_I__ArrayGcdEnv")
        assert tasks and {t.learnability for t in tasks} == {""}
    with Library(path) as lib:  # opened for writing: the column is added
        assert lib.set_learnability([(tasks[0].env_id, tasks[0].config_json, "learnable")]) == 1
        assert lib.tasks_of("Sample_0006_I__ArrayGcdEnv")[0].learnability == "learnable"

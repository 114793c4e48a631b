"""`codegym pipeline` end to end: scripted LLM over HTTP, real synthesis, verification and sandbox servers.

One problem per way of failing, each ending in the right stage with the right reason; good problems
end in the library, export as CodeGym training instances, and serve through the runtime, where
their oracle reaches reward 1. A run killed in the middle of the solvability stage finishes on
rerun with the same library and no new LLM request.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from codegym.library.store import Library
from codegym_client.runtime_client import RuntimeClient
from codegym_jobs.export.instances import PROTOCOL, user_message
from codegym_jobs.oracle import record_oracle
from codegym_jobs.pipeline.runner import STAGES, Pipeline, PipelineConfig
from codegym_jobs.pipeline.state import PipelineState
from codegym_testkit.fake_llm import ScriptedLLM
from tests.conftest import ROOT, SAMPLES
from tests.helpers.pipeline_cases import CASES, EXPECTED, case_problem, case_script, write_problems
from tests.helpers.servers import CodegymServer

GOOD = ("Sample_0001_I", "Sample_0007_I", "Sample_0009_I")


def sample_problems(*ids: str) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (SAMPLES / "problems.jsonl").read_text().splitlines()]
    return [r for r in rows if r["question_id"] in ids]


@pytest.fixture(scope="module")
def llm() -> Iterator[ScriptedLLM]:
    with ScriptedLLM(case_script) as server:
        yield server


@pytest.fixture(scope="module")
def stack(llm: ScriptedLLM, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Two sandbox workers, a verification and a synthesis server, as real processes."""
    cache = tmp_path_factory.mktemp("synthesis")
    procs = [CodegymServer(["serve", "sandbox", "--port", "0", "--jails", "2"]) for _ in range(2)]
    sandbox = ",".join(p.address for p in procs)
    procs.append(CodegymServer(["serve", "verification", "--port", "0", "--sandbox", sandbox]))
    procs.append(
        CodegymServer(
            ["serve", "synthesis", "--port", "0", "--llm-base-url", llm.base_url, "--out", str(cache)]
        )
    )
    try:
        yield {"sandbox": sandbox, "verification": procs[2].address, "synthesis": procs[3].address}
    finally:
        for proc in reversed(procs):
            proc.stop()


def pipeline_args(problems: Path, work: Path, stack: dict[str, str], *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "codegym_cli.cli",
        "pipeline",
        "run",
        "--problems",
        str(problems),
        "--work",
        str(work),
        "--synthesis",
        stack["synthesis"],
        "--verification",
        stack["verification"],
        "--model",
        "scripted",
        "--case-time-ms",
        "2000",
        *extra,
    ]


def run_pipeline(
    problems: Path, work: Path, stack: dict[str, str], *extra: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        pipeline_args(problems, work, stack, *extra), capture_output=True, text=True, timeout=600, cwd=ROOT
    )


def stage_rows(work: Path) -> dict[tuple[str, str], dict[str, Any]]:
    with sqlite3.connect(work / "pipeline.db") as db:
        rows = db.execute("SELECT problem_id, stage, status, reason, data, attempts, finished_at FROM stages")
        return {
            (pid, stage): {"status": s, "reason": r, "data": json.loads(d), "attempts": a, "at": at}
            for pid, stage, s, r, d, a, at in rows
        }


def library_snapshot(path: Path) -> dict[str, Any]:
    with Library(path) as library:
        return {
            env_id: (record.sha256, [(t.config_json, t.difficulty, t.solve_fc_round) for t in record.tasks])
            for env_id, record in library.load_all().items()
        }


@pytest.fixture(scope="module")
def finished_run(stack: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("work")
    problems = work / "problems.jsonl"
    write_problems(problems, [*CASES.values(), *sample_problems(*GOOD)])
    result = run_pipeline(problems, work, stack, "--hard-tests")
    return {"work": work, "result": result, "rows": stage_rows(work), "library": work / "library.db"}


@pytest.mark.slow
@pytest.mark.jail
def test_every_failure_ends_in_its_stage_with_its_reason(finished_run: dict[str, Any]) -> None:
    result = finished_run["result"]
    assert result.returncode == 0, result.stderr[-3000:]
    rows = finished_run["rows"]
    for problem_id, (stage, status, reason) in EXPECTED.items():
        row = rows.get((problem_id, stage))
        assert row is not None, (
            f"{problem_id} never reached {stage}: {sorted(k for k in rows if k[0] == problem_id)}"
        )
        assert row["status"] == status, (problem_id, row)
        assert row["reason"].startswith(reason), (problem_id, row["reason"])
        later = [
            s
            for (pid, s) in rows
            if pid == problem_id and s != stage and rows[(pid, s)]["status"] != "passed"
        ]
        assert later == [], (problem_id, later)
    # The table names every stage and the rejection classes.
    for text in ("environment", "solvability", "main_failed", "unsolvable", "shortcut", "contract_violation"):
        assert text in result.stdout


@pytest.mark.slow
@pytest.mark.jail
def test_failure_details(finished_run: dict[str, Any]) -> None:
    rows = finished_run["rows"]
    invalid = rows[("Case_bad_tests", "validate")]["data"]["invalid"]
    # Two samples of 15 lines: 3 good and 3 of each defect per sample.
    assert invalid == {"answer_too_long": 6, "ref_env_error": 6, "ref_memory_limit": 6, "ref_timeout": 6}
    disagree = rows[("Case_disagree", "validate")]["data"]
    assert disagree["solution_function"] == "gcd_all" and disagree["disagreement_rate"] == 1.0
    assert disagree["invalid"] == {"disagrees_with_solution": disagree["distinct"]}
    # Without entry_point the solution's function is found by its parameters and agrees.
    agreeing = rows[("Case_seventh", "validate")]["data"]
    assert agreeing["solution_function"] == "gcd_all" and agreeing["disagreement_rate"] == 0.0
    assert agreeing["cross_checked"] == agreeing["valid"] > 10
    seventh = rows[("Case_seventh", "solvability")]["data"]
    assert seventh["oracle_index"] == 6
    # Done(1) is right on the smoke test ([2, 4, 3]) and wrong later; the other wrong ones fail at once.
    assert seventh["candidates"] == {"failed_smoke": 8, "failed": 1, "oracle": 1}
    loops = rows[("Case_loops", "solvability")]["data"]
    assert any(f.startswith("solve_timeout") for f in loops["first_failures"])
    assert rows[("Case_hang", "check")]["reason"].startswith(
        "main_timeout: __main__ did not finish within 5000"
    )
    shortcut = rows[("Case_shortcut", "filters")]["data"]
    # Observe (the array length) equals the GCD now and then, on well under half the tests.
    hits, probed = shortcut["probes"]["Observe"]
    assert shortcut["shortcut_tools"] == ["Peek"] and hits < probed / 2
    # Configs outside 10..256 oracle steps are dropped, the rest kept with their step counts.
    kept = rows[("Case_seventh", "filters")]["data"]["tasks"]
    assert kept and all(10 <= t["solve_fc_round"] <= 256 for t in kept)


@pytest.mark.slow
@pytest.mark.jail
def test_library_holds_exactly_the_good_environments(finished_run: dict[str, Any]) -> None:
    snapshot = library_snapshot(finished_run["library"])
    codes = sorted(env_id.split("__")[0] for env_id in snapshot)
    assert codes == sorted(["Case_loops", "Case_seventh", *GOOD])
    with Library(finished_run["library"]) as library:
        record = library.get(next(e for e in snapshot if e.startswith("Sample_0001_I")))
    assert record is not None
    origin = record.metadata["origin"]
    assert (
        origin["problem_id"] == "Sample_0001_I" and origin["model"] == "scripted" and origin["pipeline_run"]
    )
    assert record.metadata["verification"]["validate"]["solution_function"] == "max_sub_array"
    assert {t.difficulty for t in record.tasks} >= {"easy", "hard"}
    assert all(10 <= t.solve_fc_round <= 256 for t in record.tasks)
    status = subprocess.run(
        [
            sys.executable,
            "-m",
            "codegym_cli.cli",
            "pipeline",
            "status",
            "--work",
            str(finished_run["work"]),
            "--problems",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert status.returncode == 0
    assert "Case_shortcut" in status.stdout and "filters" in status.stdout
    for stage in ("negative_controls", "determinism", "guessability"):
        assert stage in status.stdout and stage in record.metadata["verification"]


@pytest.mark.slow
@pytest.mark.jail
def test_negative_controls_determinism_and_guessability(finished_run: dict[str, Any]) -> None:
    rows = finished_run["rows"]
    pays_any = rows[("Case_pays_any", "negative_controls")]["data"]
    assert pays_any["paid"] and len({p["kind"] for p in pays_any["paid"]}) > 3
    pays_text = rows[("Case_pays_text", "negative_controls")]["data"]
    assert {p["kind"] for p in pays_text["paid"]} == {"as_string"}
    paid = pays_text["paid"][0]
    assert json.loads(paid["answer"]) == str(json.loads(paid["reference"])) and paid["reward"] == 1
    assert "reward_accepts_wrong_answers" in finished_run["result"].stdout
    differences = rows[("Case_nondeterministic", "determinism")]["data"]["differences"]
    assert differences[0]["what"] == "observation" and differences[0]["step"] > 0
    # The good environments pass every new check, with one sandbox run per test for the controls.
    for pid in ("Case_seventh", *GOOD):
        controls = rows[(pid, "negative_controls")]
        assert controls["status"] == "passed" and controls["data"]["runs"] == controls["data"]["tests"]
        assert rows[(pid, "determinism")]["status"] == "passed"
    with Library(finished_run["library"]) as library:
        records = library.load_all()
    jump = next(r for e, r in records.items() if e.startswith("Sample_0007_I"))
    assert jump.tasks and {t.guess_rate for t in jump.tasks} == {0.5}
    assert jump.metadata["verification"]["guessability"]["guess_rate"] == 0.5
    gcd = next(r for e, r in records.items() if e.startswith("Case_seventh"))
    assert all(t.guess_rate is not None and 0 < t.guess_rate < 1 for t in gcd.tasks)
    out = finished_run["work"] / "guess.jsonl"
    export = subprocess.run(
        [
            sys.executable,
            "-m",
            "codegym_cli.cli",
            "export",
            "--library",
            str(finished_run["library"]),
            "--out",
            str(out),
            "--max-guess-rate",
            "0.4",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert export.returncode == 0, export.stderr
    items = [json.loads(line) for line in out.read_text().splitlines()]
    assert items and all(i["extra_info"]["guess_rate"] <= 0.4 for i in items)
    assert not any(i["extra_info"]["env_id"].startswith("Sample_0007_I") for i in items)


@pytest.mark.slow
@pytest.mark.jail
async def test_exported_instances_serve_and_the_oracle_reaches_reward_1(
    finished_run: dict[str, Any], stack: dict[str, str], tmp_path: Path
) -> None:
    out = tmp_path / "train.jsonl"
    export = subprocess.run(
        [
            sys.executable,
            "-m",
            "codegym_cli.cli",
            "export",
            "--library",
            str(finished_run["library"]),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert export.returncode == 0, export.stderr
    instances = [json.loads(line) for line in out.read_text().splitlines()]
    with Library(finished_run["library"]) as library:
        records = list(library.load_all().values())
    assert len(instances) == sum(len(r.tasks) for r in records)
    for item in instances[:3]:
        assert item["prompt"][1]["content"].startswith(PROTOCOL)
        assert item["reward_model"] == {"ground_truth": None, "style": "agent_env"}
    trajectories = await record_oracle(records, stack["sandbox"])
    by_ability = {}
    for t in trajectories:
        record = next(r for r in records if r.env_id == t["env_id"])
        ability = f"codegym_v1@{record.env_id}@{json.dumps(t['config'])}"
        by_ability[ability] = t
    runtime = CodegymServer(
        [
            "serve",
            "runtime",
            "--port",
            "0",
            "--library",
            str(finished_run["library"]),
            "--sandbox",
            stack["sandbox"],
        ]
    )
    try:
        with RuntimeClient(runtime.address, timeout_s=60) as client:
            # Two instances per environment, through the runtime, replaying the oracle's actions.
            chosen: dict[str, list[dict[str, Any]]] = {}
            for item in instances:
                chosen.setdefault(item["code_id"], [])
                if len(chosen[item["code_id"]]) < 2:
                    chosen[item["code_id"]].append(item)
            for items in chosen.values():
                for item in items:
                    trajectory = by_ability[item["ability"]]
                    session = client.create_session(ability=item["ability"])
                    assert session.observation == trajectory["first"]
                    for action, observation in trajectory["steps"]:
                        step = client.step(session.session_id, action)
                        assert step.observation == observation
                    assert step.done and step.reward == 1.0
                    assert len(trajectory["steps"]) == item["extra_info"]["solve_fc_round"]
    finally:
        runtime.stop()


def test_export_matches_codegym_instances_field_by_field(tmp_path: Path) -> None:
    from codegym_jobs.export.instances import build_instances
    from tests.conftest import FIXTURE_ENVS, training_instances

    path = tmp_path / "lib.db"
    with Library(path) as library:
        library.import_paths(
            [FIXTURE_ENVS, ROOT / "tests" / "fixtures" / "data" / "training_instance_sample.jsonl"]
        )
        records = list(library.load_all().values())
    exported = {i["ability"]: i for i in build_instances(records).train}
    for sample in training_instances():
        ours = exported[sample["ability"]]
        assert list(ours) == list(sample)
        for key in (
            "ability",
            "answer",
            "code_id",
            "data_source",
            "plugin_call_max_round",
            "prompt",
            "reward_model",
        ):
            assert ours[key] == sample[key], key
        assert ours["extra_info"]["solve_fc_round"] == sample["extra_info"]["solve_fc_round"]
    assert user_message("task") == f"{PROTOCOL}\n\nQuestion:\n\n\ntask\n"


@pytest.mark.slow
@pytest.mark.jail
def test_a_run_killed_during_solvability_resumes_without_new_llm_requests(
    stack: dict[str, str], llm: ScriptedLLM, tmp_path: Path
) -> None:
    problems = tmp_path / "problems.jsonl"
    write_problems(problems, [case_problem("slow"), *sample_problems("Sample_0009_I")])
    work = tmp_path / "work"
    proc = subprocess.Popen(
        pipeline_args(problems, work, stack), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT
    )
    killed_in: list[str] = []
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            if (work / "pipeline.db").exists():
                try:
                    rows = stage_rows(work)
                except sqlite3.OperationalError:  # the run has made the file, not yet its tables
                    time.sleep(0.05)
                    continue
                slow = {s: r["status"] for (pid, s), r in rows.items() if pid == "Case_slow"}
                if slow.get("solve_functions") == "passed" and "solvability" not in slow:
                    proc.send_signal(signal.SIGKILL)
                    killed_in.append("solvability")
                    break
            time.sleep(0.05)
    finally:
        if proc.poll() is None and not killed_in:
            proc.kill()
        proc.wait(30)
    assert killed_in == ["solvability"], "the run ended before its solvability stage could be interrupted"
    before = stage_rows(work)
    requests = llm.count()
    resumed = run_pipeline(problems, work, stack)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert llm.count() == requests
    after = stage_rows(work)
    for key, row in before.items():
        if row["status"] in ("passed", "rejected"):
            assert after[key]["attempts"] == 1 and after[key]["at"] == row["at"], key
    assert after[("Case_slow", "library")]["status"] == "passed"
    # The same problems run without interruption give the same library.
    fresh = tmp_path / "fresh"
    assert run_pipeline(problems, fresh, stack).returncode == 0
    assert library_snapshot(work / "library.db") == library_snapshot(fresh / "library.db")


@pytest.mark.slow
@pytest.mark.jail
def test_shortcuts_with_arguments_and_resident_against_cold(finished_run: dict[str, Any]) -> None:
    rows = finished_run["rows"]
    shortcut = rows[("Case_shortcut_args", "filters")]["data"]
    hits, probed = shortcut["probes"]["Answer(nums)"]
    assert shortcut["shortcut_tools"] == ["Answer"] and hits == probed > 0
    module_state = rows[("Case_module_state", "determinism")]["data"]
    assert module_state["differences"] == []  # each oracle run is one process: the runs agree
    difference = module_state["resident_difference"]
    assert difference["what"] == "observation" and difference["step"] == module_state["resident_steps"]
    assert difference["resident"].endswith(f"steps in this process: {difference['step']}")
    assert difference["cold"].endswith("steps in this process: 1")
    # The good environments: one trajectory each replayed resident and cold, the same.
    for pid in ("Case_seventh", *GOOD):
        data = rows[(pid, "determinism")]["data"]
        assert data["resident_steps"] > 0 and "resident_difference" not in data, (pid, data)
        assert rows[(pid, "filters")]["data"]["shortcut_tools"] == [], pid


@pytest.mark.slow
@pytest.mark.jail
def test_only_runs_the_problems_a_file_names_such_as_a_runs_mastered_envs(
    stack: dict[str, str], tmp_path: Path
) -> None:
    problems = tmp_path / "problems.jsonl"
    write_problems(problems, sample_problems(*GOOD))
    # What `codegym library stats --envs-only` prints, filtered to the envs a run has mastered.
    mastered = tmp_path / "mastered.jsonl"
    mastered.write_text(
        json.dumps({"kind": "env", "env_id": f"{GOOD[1]}__JumpGameEnv", "pass_rate": 1.0}) + "\n"
    )
    result = run_pipeline(problems, tmp_path / "work", stack, "--hard-tests", "--only", str(mastered))
    assert result.returncode == 0, result.stderr
    assert {pid for pid, _ in stage_rows(tmp_path / "work")} == {GOOD[1]}
    assert set(library_snapshot(tmp_path / "work" / "library.db")) == {f"{GOOD[1]}__JumpGameEnv"}

    nobody = tmp_path / "nobody.txt"
    nobody.write_text("Nope_0000__NoEnv\n")
    refused = run_pipeline(problems, tmp_path / "work2", stack, "--only", str(nobody))
    assert refused.returncode == 2 and "no usable problem" in refused.stderr


def test_every_stage_is_run_by_its_own_step_in_order(tmp_path: Path) -> None:
    """The stages' table (Pipeline.steps) names each of STAGES, in order: a stage added to one and
    not the other fails here, not half way through a run."""

    async def steps() -> tuple[str, ...]:
        async with grpc.aio.insecure_channel("127.0.0.1:1") as channel:  # never called
            with Library(tmp_path / "lib.db") as library:
                pipeline = Pipeline(
                    PipelineState(tmp_path / "work"), library, channel, channel, PipelineConfig()
                )
                return tuple(pipeline.steps)

    assert asyncio.run(steps()) == STAGES

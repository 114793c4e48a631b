"""`codegym eval` end to end: scripted agents over HTTP, the real runtime and sandbox workers.

Every figure of the summary is checked against what the script implies: an oracle agent solves
everything, a wrong one ends every episode at once, a malformed one only makes format errors, one
that never calls Done is truncated at the round limit; native tool calls, an endpoint that fails
with 429 and 500 first, difficulty filtering on export, and resuming after a kill.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from services.runtime.library import Library
from tests.conftest import ENV_DIR, EXAMPLES, ROOT
from tests.helpers.agents import flaky, malformed_agent, never_done_agent, oracle_agent, wrong_agent
from tests.helpers.fake_llm import ScriptedLLM
from tests.helpers.servers import ServerProcess

TRAJECTORIES = [json.loads(x) for x in (EXAMPLES / "trajectories.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("eval") / "library.db"
    with Library(path) as lib:
        lib.import_paths([ENV_DIR, EXAMPLES / "tasks.jsonl"])
    return path


@pytest.fixture(scope="module")
def task_texts(library: Path) -> dict[str, str]:
    with Library(library) as lib:
        return {r.env_id: r.task_text for r in lib.load_all().values()}


@pytest.fixture(scope="module")
def runtime(library: Path) -> Iterator[str]:
    workers = [ServerProcess(["serve", "sandbox", "--port", "0", "--jails", "1"]) for _ in range(2)]
    sandbox = ",".join(w.address for w in workers)
    server = ServerProcess(
        ["serve", "runtime", "--port", "0", "--library", str(library), "--sandbox", sandbox]
    )
    try:
        yield server.address
    finally:
        server.stop()
        for worker in workers:
            worker.stop()


@pytest.fixture(scope="module")
def instances(library: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One training instance per environment (CodeGym's format)."""
    out = tmp_path_factory.mktemp("instances") / "all.jsonl"
    result = subprocess.run(
        [sys.executable, "-m", "codegym_cli.cli", "export", "--library", str(library), "--out", str(out),
         "--include-unverified"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    first: dict[str, dict[str, Any]] = {}
    for line in out.read_text().splitlines():
        item = json.loads(line)
        first.setdefault(item["code_id"], item)
    chosen = out.with_name("one_per_env.jsonl")
    chosen.write_text("".join(json.dumps(i) + "\n" for i in first.values()))
    return chosen


@pytest.fixture(scope="module")
def short_instances(instances: Path) -> Path:
    """The same instances with a round limit of 20 (`plugin_call_max_round`)."""
    short = instances.with_name("short.jsonl")
    lines = [json.loads(x) for x in instances.read_text().splitlines()]
    short.write_text("".join(json.dumps({**i, "plugin_call_max_round": 20}) + "\n" for i in lines))
    return short


def run_eval(runtime: str, llm: ScriptedLLM, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "codegym_cli.cli", "eval", "--target", runtime, "--llm-base-url", llm.base_url,
         "--model", "scripted-agent", "--out", str(out), "--max-retries", "4", "--backoff-s", "0.05", *args],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip


def summary_of(out: Path) -> dict[str, Any]:
    return json.loads((out / "summary.json").read_text())


def oracle_turns(instances: Path) -> list[int]:
    lengths = []
    for line in instances.read_text().splitlines():
        item = json.loads(line)
        env_id, config = item["ability"].split("@", 2)[1], json.loads(item["ability"].split("@", 2)[2])
        lengths.append(
            next(len(t["steps"]) for t in TRAJECTORIES if t["env_id"] == env_id and t["config"] == config)
        )
    return lengths


def test_oracle_agent_solves_every_task(
    runtime: str, instances: Path, task_texts: dict[str, str], tmp_path: Path
) -> None:
    with ScriptedLLM(oracle_agent(TRAJECTORIES, task_texts)) as llm:
        result = run_eval(runtime, llm, tmp_path, "--instances", str(instances), "--samples", "2")
        requests = llm.count()
    assert result.returncode == 0, result.stderr[-2000:]
    overall = summary_of(tmp_path)["overall"]
    turns = oracle_turns(instances)
    assert overall["episodes"] == 2 * len(turns) == 24
    assert overall["success_rate"] == overall["pass@1"] == overall["pass@2"] == 1.0
    assert overall["end_reasons"] == {"solved": 24}
    assert overall["mean_turns"] == round(sum(turns) / len(turns), 2)
    assert requests == 2 * sum(turns) and overall["prompt_tokens"] > 0
    assert "Sample_0004_I__CountIslandsEnv" in result.stdout and "100.0%" in result.stdout
    episode = json.loads((tmp_path / "episodes.jsonl").read_text().splitlines()[0])
    assert episode["reward"] == 1.0 and episode["messages"][0]["role"] == "system"
    assert len(episode["actions"]) == len(episode["observations"]) == episode["turns"]


@pytest.mark.parametrize(
    ("agent", "reason", "turns"),
    [
        (wrong_agent, "wrong_answer", 1),
        (malformed_agent, "format_errors", 20),
        (never_done_agent, "truncated", 20),
    ],
)
def test_failing_agents_end_for_the_right_reason(
    runtime: str, short_instances: Path, tmp_path: Path, agent: Any, reason: str, turns: int
) -> None:
    with ScriptedLLM(agent) as llm:
        result = run_eval(runtime, llm, tmp_path, "--instances", str(short_instances), "--samples", "2")
    assert result.returncode == 0, result.stderr[-2000:]
    overall = summary_of(tmp_path)["overall"]
    assert overall["end_reasons"] == {reason: 24}
    assert overall["success_rate"] == overall["pass@1"] == overall["pass@2"] == 0.0
    assert overall["mean_turns"] == turns  # 20: the instances' plugin_call_max_round


def test_native_tool_calls(runtime: str, library: Path, task_texts: dict[str, str], tmp_path: Path) -> None:
    with ScriptedLLM(oracle_agent(TRAJECTORIES, task_texts, native=True)) as llm:
        result = run_eval(
            runtime,
            llm,
            tmp_path,
            "--library",
            str(library),
            "--tool-mode",
            "json",
            "--prefix",
            "Sample_0009",
            "--limit",
            "3",
        )
        body = llm.requests[0]
    assert result.returncode == 0, result.stderr[-2000:]
    assert summary_of(tmp_path)["overall"]["end_reasons"] == {"solved": 3}
    assert {t["function"]["name"] for t in body["tools"]} >= {"Observe", "Done"}
    assert all(m["role"] != "system" for m in body["messages"])
    episode = json.loads((tmp_path / "episodes.jsonl").read_text().splitlines()[0])
    assert episode["messages"][-1]["role"] == "tool" and episode["messages"][-2]["tool_calls"]


def test_an_endpoint_that_fails_first_is_retried(
    runtime: str, instances: Path, task_texts: dict[str, str], tmp_path: Path
) -> None:
    one = tmp_path / "one.jsonl"
    one.write_text(instances.read_text().splitlines()[0] + "\n")
    with ScriptedLLM(flaky(oracle_agent(TRAJECTORIES, task_texts), [429, 500])) as llm:
        result = run_eval(runtime, llm, tmp_path / "out", "--instances", str(one))
        requests = llm.count()
    assert result.returncode == 0, result.stderr[-2000:]
    assert summary_of(tmp_path / "out")["overall"]["end_reasons"] == {"solved": 1}
    assert requests == oracle_turns(one)[0] + 2


def test_difficulty_scores_go_to_the_library_and_filter_the_export(
    runtime: str, library: Path, task_texts: dict[str, str], tmp_path: Path
) -> None:
    lib = tmp_path / "lib.db"
    shutil.copy(library, lib)
    args = ("--library", str(lib), "--prefix", "Sample_0003", "--samples", "2")
    with ScriptedLLM(wrong_agent) as llm:
        assert run_eval(runtime, llm, tmp_path / "hard", *args).returncode == 0
    with ScriptedLLM(oracle_agent(TRAJECTORIES, task_texts)) as llm:
        assert run_eval(runtime, llm, tmp_path / "easy", *args).returncode == 0
    name = summary_of(tmp_path / "hard")["score_name"]
    assert name == "scripted-agent_Bo2_score"

    def export(summary: Path) -> tuple[list[dict[str, Any]], str]:
        out = tmp_path / f"{summary.name}.jsonl"
        result = subprocess.run(
            [sys.executable, "-m", "codegym_cli.cli", "export", "--library", str(lib), "--out", str(out),
             "--include-unverified", "--difficulty", str(summary / "summary.json"), "--max-success", "0.25"],
            capture_output=True, text=True, timeout=60, cwd=ROOT,
        )  # fmt: skip
        lines = [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []
        return lines, result.stderr

    hard, note = export(tmp_path / "hard")
    assert len(hard) == 9 and all(i["code_id"] == "Sample_0003_I" for i in hard)
    assert all(i["extra_info"][name] == 0.0 for i in hard)
    assert "99 not evaluated" in note
    easy, note = export(tmp_path / "easy")
    assert easy == [] and "dropped 9 outside" in note


def test_a_killed_run_resumes_without_replaying_finished_episodes(
    runtime: str, instances: Path, task_texts: dict[str, str], tmp_path: Path
) -> None:
    agent = oracle_agent(TRAJECTORIES, task_texts)

    def slow(body: dict[str, Any]) -> Any:
        reply = agent(body)
        reply.delay_s = 0.01
        return reply

    out = tmp_path / "out"
    with ScriptedLLM(slow) as llm:
        cmd = [sys.executable, "-m", "codegym_cli.cli", "eval", "--target", runtime, "--llm-base-url", llm.base_url,
               "--model", "scripted-agent", "--out", str(out), "--instances", str(instances), "--samples", "2",
               "--concurrency", "2"]  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
        episodes = out / "episodes.jsonl"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if episodes.exists() and len(episodes.read_text().splitlines()) >= 6:
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.02)
        proc.wait(30)
        finished = [json.loads(x) for x in episodes.read_text().splitlines() if x.strip()]
        assert 6 <= len(finished) < 24
        before = llm.count()
        result = run_eval(runtime, llm, out, "--instances", str(instances), "--samples", "2")
        after = llm.count()
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [json.loads(x) for x in episodes.read_text().splitlines()]
    assert len(lines) == 24 and len({x["key"] for x in lines}) == 24
    replayed = lines[len(finished) :]
    assert after - before == sum(x["turns"] for x in replayed)
    assert summary_of(out)["overall"]["end_reasons"] == {"solved": 24}

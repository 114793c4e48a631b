"""`codegym eval` end to end: scripted agents over HTTP, the real runtime and sandbox workers.

Every figure of the summary is checked against what the script implies: an oracle agent solves
everything, a wrong one ends every episode at once, a malformed one only makes format errors, one
that never calls Done is truncated at the round limit; native tool calls, an endpoint that fails
with 429 and 500 first, difficulty filtering on export, and resuming after a kill.

Only the agent's own outcomes count: a runtime that goes away mid-run and an endpoint that fails
past its retries leave failed attempts with their error, outside every figure and score, and
the same command played again plays exactly those. The scripted server as docs/eval.md starts it
(`python -m codegym_testkit.fake_llm`) plays every sample environment as its oracle would.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from codegym.library.store import Library
from codegym_jobs.evaluation.results import done_keys, summarize
from codegym_testkit.agents import (
    CONTEXT_OVERFLOW,
    flaky,
    malformed_agent,
    never_done_agent,
    oracle_agent,
    short_context_agent,
    wrong_agent,
)
from codegym_testkit.fake_llm import Reply, ScriptedLLM
from codegym_testkit.sample_configs import SAMPLE_CLASSES, sample_configs
from codegym_testkit.waiting import wait_until
from services.synthesis.llm import context_overflow
from tests.conftest import ENV_DIR, ROOT, SAMPLES
from tests.helpers.libraries import SAMPLE_LIBRARY, library_fixture
from tests.helpers.servers import CodegymServer, deployed_runtime, workers_fixture

TRAJECTORIES = [json.loads(x) for x in (SAMPLES / "trajectories.jsonl").read_text().splitlines()]


library = library_fixture(SAMPLE_LIBRARY)


@pytest.fixture(scope="module")
def task_texts(library: Path) -> dict[str, str]:
    with Library(library) as lib:
        return {r.env_id: r.task_text for r in lib.load_all().values()}


# Two sandbox workers (their addresses, comma-separated), shared by every runtime here.
sandbox = workers_fixture(2, addresses=True, clean_stop=False)


def start_runtime(library: Path, sandbox: str, port: int = 0) -> CodegymServer:
    return CodegymServer(
        ["serve", "runtime", "--port", str(port), "--library", str(library), "--sandbox", sandbox]
    )


@pytest.fixture(scope="module")
def runtime(request: pytest.FixtureRequest) -> Iterator[str]:
    """A runtime serving the sample library: CODEGYM_TEST_RUNTIME when set, else one started here."""
    deployed = deployed_runtime()
    if deployed:
        yield deployed
        return
    server = start_runtime(request.getfixturevalue("library"), request.getfixturevalue("sandbox"))
    try:
        yield server.address
    finally:
        server.stop()


@pytest.fixture(scope="module")
def instances(library: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One training instance per environment (CodeGym's format)."""
    out = tmp_path_factory.mktemp("instances") / "all.jsonl"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "codegym_cli.cli",
            "export",
            "--library",
            str(library),
            "--out",
            str(out),
            "--include-unverified",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
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


def eval_command(runtime: str, llm: ScriptedLLM, out: Path, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "codegym_cli.cli",
        "eval",
        "--target",
        runtime,
        "--llm-base-url",
        llm.base_url,
        "--model",
        "scripted-agent",
        "--out",
        str(out),
        "--max-retries",
        "4",
        "--backoff-s",
        "0.05",
        *args,
    ]


def run_eval(runtime: str, llm: ScriptedLLM, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        eval_command(runtime, llm, out, *args), capture_output=True, text=True, timeout=600, cwd=ROOT
    )


def jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def scores_of(library: Path, prefix: str) -> dict[str, dict[str, float]]:
    """config JSON → its scores, for the task configs of environments starting with `prefix`."""
    with Library(library) as lib:
        return {
            t.config_json: dict(t.scores)
            for env_id, record in lib.load_all().items()
            if env_id.startswith(prefix)
            for t in record.tasks
        }


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


@pytest.mark.jail
@pytest.mark.deployable
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


@pytest.mark.jail
@pytest.mark.deployable
@pytest.mark.parametrize(
    ("agent", "reason", "turns"),
    [
        (wrong_agent, "wrong_answer", 1),
        (malformed_agent, "format_errors", 20),
        (never_done_agent, "truncated", 20),
        (short_context_agent, "context_length", 3),
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
    episodes, failures = jsonl(tmp_path / "episodes.jsonl"), tmp_path / "failures.jsonl"
    assert len(episodes) == 24 and (not failures.exists() or jsonl(failures) == [])
    if reason == "context_length":  # the endpoint's words are kept with the episode
        assert all("maximum context length is 4096 tokens" in e["error"] for e in episodes)


@pytest.mark.jail
@pytest.mark.deployable
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


@pytest.mark.jail
@pytest.mark.deployable
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


@pytest.mark.jail
@pytest.mark.deployable
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
            [
                sys.executable,
                "-m",
                "codegym_cli.cli",
                "export",
                "--library",
                str(lib),
                "--out",
                str(out),
                "--include-unverified",
                "--difficulty",
                str(summary / "summary.json"),
                "--max-success",
                "0.25",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
        lines = [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []
        return lines, result.stderr

    hard, note = export(tmp_path / "hard")
    assert len(hard) == 9 and all(i["code_id"] == "Sample_0003_I" for i in hard)
    assert all(i["extra_info"][name] == 0.0 for i in hard)
    assert "99 not evaluated" in note
    easy, note = export(tmp_path / "easy")
    assert easy == [] and "dropped 9 outside" in note


@pytest.mark.jail
@pytest.mark.deployable
def test_a_killed_run_resumes_without_replaying_finished_episodes(
    runtime: str, instances: Path, task_texts: dict[str, str], tmp_path: Path
) -> None:
    agent = oracle_agent(TRAJECTORIES, task_texts)
    out = tmp_path / "out"
    episodes = out / "episodes.jsonl"
    # Past 12 episodes the model answers nothing until the run is killed: however late the kill
    # (a loaded machine), the run is cut before its end.
    held = threading.Event()

    def slow(body: dict[str, Any]) -> Any:
        if not held.is_set() and episodes.exists() and episodes.read_text().count("\n") >= 12:
            held.wait(120)
        reply = agent(body)
        reply.delay_s = 0.01
        return reply

    with ScriptedLLM(slow) as llm:
        cmd = [
            sys.executable,
            "-m",
            "codegym_cli.cli",
            "eval",
            "--target",
            runtime,
            "--llm-base-url",
            llm.base_url,
            "--model",
            "scripted-agent",
            "--out",
            str(out),
            "--instances",
            str(instances),
            "--samples",
            "2",
            "--concurrency",
            "2",
        ]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if episodes.exists() and len(episodes.read_text().splitlines()) >= 6:
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.02)
        proc.wait(30)
        held.set()
        # Killed while it may be writing a line (6 KB: more than one write): the lines before the
        # last newline are whole, and what follows it, if anything, is a torn line.
        text = episodes.read_text()
        whole = text[: text.rfind("\n") + 1]
        finished = [json.loads(x) for x in whole.splitlines()]
        assert 6 <= len(finished) < 24
        before = llm.count()
        result = run_eval(runtime, llm, out, "--instances", str(instances), "--samples", "2")
        after = llm.count()
    assert result.returncode == 0, result.stderr[-2000:]
    resumed = episodes.read_text()
    assert resumed.startswith(whole)  # the torn line cut, nothing else
    lines = [json.loads(x) for x in resumed.splitlines()]  # none glued to a fragment
    assert len(lines) == 24 and len({x["key"] for x in lines}) == 24  # the torn episode played again
    replayed = lines[len(finished) :]
    assert after - before == sum(x["turns"] for x in replayed)
    assert summary_of(out)["overall"]["end_reasons"] == {"solved": 24}


@pytest.mark.jail
def test_a_runtime_lost_mid_run_costs_a_rerun_not_a_figure(
    library: Path, sandbox: str, instances: Path, task_texts: dict[str, str], tmp_path: Path
) -> None:
    agent = oracle_agent(TRAJECTORIES, task_texts)
    # Once armed, a request from an episode past its second step waits for `release`: the runtime
    # goes away while episodes are mid-way (sessions with steps made), not between episodes.
    armed, reached, release = threading.Event(), threading.Event(), threading.Event()

    def gated(body: dict[str, Any]) -> Reply:
        if armed.is_set() and len(body["messages"]) >= 6:
            reached.set()
            release.wait(120)
        return agent(body)

    out = tmp_path / "out"
    args = ("--instances", str(instances), "--samples", "2", "--concurrency", "2", "--give-up-after", "6")
    first = start_runtime(library, sandbox)
    port = int(first.address.rsplit(":", 1)[1])
    try:
        with ScriptedLLM(gated) as llm:
            command = eval_command(first.address, llm, out, *args)
            with open(tmp_path / "stdout", "w") as stdout, open(tmp_path / "stderr", "w") as stderr:
                proc = subprocess.Popen(command, stdout=stdout, stderr=stderr, cwd=ROOT)
                try:
                    wait_until(
                        lambda: len(jsonl(out / "episodes.jsonl")) >= 4 or proc.poll() is not None,
                        180,
                        "4 counted episodes",
                    )
                    armed.set()
                    wait_until(lambda: reached.is_set() or proc.poll() is not None, 60, "an episode mid-way")
                    assert proc.poll() is None, "the run ended before the runtime went away"
                    first.stop(signal.SIGKILL)
                    release.set()
                    code = proc.wait(300)
                finally:
                    release.set()
                    if proc.poll() is None:
                        proc.kill()
                        proc.wait(10)
            text = (tmp_path / "stdout").read_text()
            finished = jsonl(out / "episodes.jsonl")
            failed = jsonl(out / "failures.jsonl")
            summary = summary_of(out)
            assert code == 1, text + (tmp_path / "stderr").read_text()[-2000:]
            assert 4 <= len(finished) < 24 and failed
            # Every failure is the runtime's, with a diagnosable error, and outside the figures.
            assert {f["end_reason"] for f in failed} == {"runtime_error"}
            assert all(re.match(r"^[A-Z]\w+: \S", f["error"]) for f in failed)
            assert any("UNAVAILABLE" in f["error"] for f in failed)
            assert any(f["turns"] >= 2 for f in failed)  # lost mid-episode, after steps were made
            assert not {f["key"] for f in failed} & {e["key"] for e in finished}
            overall = summary["overall"]
            assert overall["episodes"] == len(finished) and overall["end_reasons"] == {
                "solved": len(finished)
            }
            assert overall["success_rate"] == overall["pass@1"] == 1.0
            assert summary["not_counted"]["episodes"] == len(failed)
            assert summary["not_counted"]["reasons"] == {"runtime_error": len(failed)}
            assert f"{len(failed)} episodes not counted (runtime_error {len(failed)})" in text
            skipped = re.search(r"(\d+) episodes not played", text)
            assert len(finished) + len(failed) + (int(skipped.group(1)) if skipped else 0) == 24

            # The same command against a runtime on the same address plays exactly what was lost.
            second = start_runtime(library, sandbox, port)
            try:
                before = llm.count()
                rerun = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
                requests = llm.count() - before
            finally:
                second.stop()
    finally:
        first.stop()
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr[-2000:]
    lines = jsonl(out / "episodes.jsonl")
    assert lines[: len(finished)] == finished  # the counted episodes are kept as they were
    replayed = lines[len(finished) :]
    assert len(lines) == len({x["key"] for x in lines}) == 24
    assert {x["key"] for x in replayed} >= {f["key"] for f in failed}
    assert requests == sum(x["turns"] for x in replayed)  # nothing finished was played again
    summary = summary_of(out)
    assert summary["overall"]["end_reasons"] == {"solved": 24} and summary["overall"]["success_rate"] == 1.0
    assert summary["not_counted"]["episodes"] == 0
    assert f"{len(replayed)} episodes played now ({len(replayed)} counted, 0 not counted)" in rerun.stdout


@pytest.mark.jail
@pytest.mark.deployable
def test_a_failing_endpoint_scores_nothing_and_is_played_again(
    runtime: str, library: Path, task_texts: dict[str, str], tmp_path: Path
) -> None:
    lib = tmp_path / "lib.db"
    shutil.copy(library, lib)
    out = tmp_path / "out"
    args = ("--library", str(lib), "--prefix", "Sample_0003", "--samples", "2")
    with ScriptedLLM(lambda body: Reply(status=500, error="scripted outage")) as llm:
        result = run_eval(runtime, llm, out, *args, "--give-up-after", "0")
        requests = llm.count()
    assert result.returncode == 1, result.stderr[-2000:]
    assert requests == 18 * 5  # each episode's first request, tried 1 + --max-retries times
    failed = jsonl(out / "failures.jsonl")
    assert len(failed) == 18 and jsonl(out / "episodes.jsonl") == []
    assert all(f["end_reason"] == "llm_error" and f["turns"] == 0 for f in failed)
    assert all(
        f["error"].startswith("LLMUnavailable: agent: LLM endpoint unavailable after 5 attempts: 500")
        and "scripted outage" in f["error"]
        for f in failed
    )
    summary = summary_of(out)
    assert summary["overall"] == {"tasks": 0, "episodes": 0, "not_counted": 18}
    assert summary["configs"] == {}
    assert "18 episodes not counted (llm_error 18)" in result.stdout
    assert "18 × LLMUnavailable: agent: LLM endpoint unavailable" in result.stdout
    assert (
        "0 configs scored" in result.stdout
        and "9 configs without a counted episode not scored" in result.stdout
    )
    name = summary["score_name"]
    assert all(name not in scores for scores in scores_of(lib, "Sample_0003").values())

    # Nothing was measured, so nothing is "hard": the export keeps no config.
    hard = tmp_path / "hard.jsonl"
    export = subprocess.run(
        [
            sys.executable,
            "-m",
            "codegym_cli.cli",
            "export",
            "--library",
            str(lib),
            "--out",
            str(hard),
            "--include-unverified",
            "--difficulty",
            str(out / "summary.json"),
            "--max-success",
            "0.25",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert jsonl(hard) == [] and "dropped 0 outside, 108 not evaluated" in export.stderr

    with ScriptedLLM(oracle_agent(TRAJECTORIES, task_texts)) as llm:
        rerun = run_eval(runtime, llm, out, *args)
        requests = llm.count()
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    played = jsonl(out / "episodes.jsonl")
    assert sorted(x["key"] for x in played) == sorted(f["key"] for f in failed)
    assert requests == sum(x["turns"] for x in played)
    summary = summary_of(out)
    assert summary["overall"]["end_reasons"] == {"solved": 18} and summary["not_counted"]["episodes"] == 0
    assert [scores[name] for scores in scores_of(lib, "Sample_0003").values()] == [1.0] * 9


@pytest.mark.jail
def test_the_scripted_server_plays_the_sample_envs_as_their_oracle(sandbox: str, tmp_path: Path) -> None:
    """The default script (what `python -m codegym_testkit.fake_llm` serves, as docs/eval.md starts it)
    plays as an agent, on configs no trajectory was recorded for."""
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(
        "".join(
            json.dumps({"env_id": path.stem, "difficulty": "medium", "config": config}) + "\n"
            for path in sorted(ENV_DIR.glob("*__*Env.py"))
            for config in sample_configs(path.stem.split("__", 1)[1], 1, seed=2024)
        )
    )
    recorded = {json.dumps(t["config"], sort_keys=True) for t in TRAJECTORIES}
    assert not any(
        json.dumps(json.loads(x)["config"], sort_keys=True) in recorded
        for x in tasks.read_text().splitlines()
    )
    lib = tmp_path / "lib.db"
    with Library(lib) as library:
        library.import_paths([ENV_DIR, tasks])
    server = start_runtime(lib, sandbox)
    try:
        with ScriptedLLM() as llm:
            text = run_eval(server.address, llm, tmp_path / "text", "--library", str(lib))
            native = run_eval(
                server.address,
                llm,
                tmp_path / "json",
                "--library",
                str(lib),
                "--tool-mode",
                "json",
                "--prefix",
                "Sample_000",
            )
    finally:
        server.stop()
    assert text.returncode == 0, text.stderr[-2000:]
    summary = summary_of(tmp_path / "text")
    assert summary["overall"]["end_reasons"] == {"solved": len(SAMPLE_CLASSES)} == {"solved": 12}
    assert summary["overall"]["success_rate"] == 1.0
    assert set(summary["environments"]) == {p.stem for p in ENV_DIR.glob("*__*Env.py")}
    assert "12 configs scored" in text.stdout
    assert all(s == {"scripted-agent_Bo1_score": 1.0} for s in scores_of(lib, "").values())
    assert native.returncode == 0, native.stderr[-2000:]
    assert summary_of(tmp_path / "json")["overall"]["end_reasons"] == {"solved": 9}
    episode = jsonl(tmp_path / "json" / "episodes.jsonl")[0]
    assert episode["messages"][-1]["role"] == "tool" and episode["messages"][-2]["tool_calls"]


def test_failures_an_older_version_wrote_as_episodes_are_played_again(tmp_path: Path) -> None:
    """Before failures were kept apart, `runtime_error`/`llm_error` lines sat in episodes.jsonl."""
    ability = 'codegym_v1@Sample_0006_I__ArrayGcdEnv@{"nums": [12, 18]}'
    base = {
        "ability": ability,
        "env_id": "Sample_0006_I__ArrayGcdEnv",
        "turns": 3,
        "prompt_tokens": 1,
        "completion_tokens": 1,
        "error": "",
    }
    lines = [
        {**base, "key": f"{ability}#0", "sample": 0, "end_reason": "solved"},
        {**base, "key": f"{ability}#1", "sample": 1, "end_reason": "runtime_error"},
        {**base, "key": f"{ability}#2", "sample": 2, "end_reason": "llm_error"},
    ]
    path = tmp_path / "episodes.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"key": "cut by a kil')
    assert done_keys(path) == {f"{ability}#0"}
    summary = summarize(path, 3, "m")
    assert summary["overall"]["episodes"] == 1 and summary["overall"]["success_rate"] == 1.0
    assert summary["not_counted"]["reasons"] == {"runtime_error": 1, "llm_error": 1}
    assert summary["configs"][ability]["samples"] == 1


def bad_request(body: dict[str, Any]) -> openai.BadRequestError:
    response = httpx.Response(400, request=httpx.Request("POST", "http://127.0.0.1/v1/chat/completions"))
    return openai.BadRequestError(f"Error code: 400 - {body}", response=response, body=body)


@pytest.mark.parametrize(
    ("body", "overflow"),
    [
        ({"object": "error", "message": CONTEXT_OVERFLOW, "code": 400}, True),  # vLLM, the conversation
        (
            {
                "message": "'max_tokens' or 'max_completion_tokens' is too large: 8000. This model's maximum "
                "context length is 4096 tokens and your request has 2778 input tokens (8000 > 4096 - 2778)."
            },
            True,  # vLLM, the same limit reached by the completion's share: the first-turn rule decides
        ),
        (
            {"message": "The input (5000 tokens) is longer than the model's context length (4096 tokens)."},
            True,
        ),
        ({"message": "the request exceeds the available context size, try increasing it"}, True),
        ({"message": "Please reduce the length of the messages.", "code": "context_length_exceeded"}, True),
        (
            {
                "message": "max_tokens is too large: 100000. This model supports at most 16384 completion tokens"
            },
            False,  # OpenAI: a setting, whatever the conversation
        ),
        (
            {
                "message": "1 validation error: temperature must be <= 2",
                "input": "a task about the model's context window and its maximum context length is 10 rows",
            },
            False,  # a malformed request echoing the conversation: only the error's own message counts
        ),
        ({"message": "The model `no-such-model` does not exist."}, False),
    ],
)
def test_which_400s_are_a_context_overflow(body: dict[str, Any], overflow: bool) -> None:
    assert context_overflow(bad_request(body)) is overflow


@pytest.mark.jail
@pytest.mark.deployable
def test_an_overflow_at_the_first_turn_is_a_setting_not_an_episode(
    runtime: str, short_instances: Path, tmp_path: Path
) -> None:
    """The task alone does not fit with --max-tokens: every attempt is an llm_error, none counted
    (no score), so the same command plays them again once the setting is fixed."""
    with ScriptedLLM(lambda body: Reply(status=400, error=CONTEXT_OVERFLOW)) as llm:
        args = ("--instances", str(short_instances), "--samples", "1", "--give-up-after", "0")
        result = run_eval(runtime, llm, tmp_path, *args)
    assert result.returncode == 1, result.stderr[-2000:]
    failed = jsonl(tmp_path / "failures.jsonl")
    assert len(failed) == 12 and all(
        f["end_reason"] == "llm_error" and "maximum context length is 4096" in f["error"] for f in failed
    )
    episodes = tmp_path / "episodes.jsonl"
    assert not episodes.exists() or jsonl(episodes) == []

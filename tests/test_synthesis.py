"""Synthesis: parsing, the LLM gateway against a scripted OpenAI-compatible HTTP server (real
`openai` client, real HTTP), problem ingestion, the `codegym synthesize` command and the gRPC
service run as a real process."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from codegym.contract import analyze_source
from codegym.library.store import Library
from codegym.synthesis.v1 import synthesis_service_pb2 as sy
from codegym.synthesis.v1 import synthesis_service_pb2_grpc as sy_grpc
from codegym_testkit.fake_llm import GOOD_SOLVE, SAMPLE, ScriptedLLM, good_env, good_tests, stage_of
from codegym_testkit.fake_llm import Reply as R
from services.synthesis.llm import LLMGateway, LLMUnavailable, StageParams
from services.synthesis.llm_cache import ResponseCache
from services.synthesis.parsing import parse_env_output, parse_solve_output, parse_test_lines, splice_solve
from services.synthesis.problems import load_problems
from services.synthesis.settings import LLMSettings
from tests.conftest import ROOT, SHARED_DATA
from tests.helpers.servers import CodegymServer

PROBLEMS = SHARED_DATA / "raw_problems_sample.jsonl"
MESSAGES = [{"role": "user", "content": "hello"}]


# ---- parsing --------------------------------------------------------------------------------------


def test_env_output_last_complete_block_after_think() -> None:
    draft = good_env("DraftEnv")
    text = f"<think>first idea:\n{draft}\n</think>\nHere it is.\n{good_env('FinalGcdEnv')}\n<env>\nclass Half"
    parsed = parse_env_output(text)
    assert parsed.status == "ok" and parsed.env_class == "FinalGcdEnv"
    assert parsed.env_source.startswith("import ast") and "```" not in parsed.env_source
    assert "greatest common divisor" in parsed.task_text


@pytest.mark.parametrize(
    ("text", "finish", "status", "words"),
    [
        ("<env>\nx = 1\n</env>", "stop", "missing_marker", "<task>"),
        ("<task>t</task> no code", "stop", "missing_marker", "<env>"),
        ("<task>t</task><env>\nclass A(gymnasium.Env:\n", "length", "truncated", "token limit"),
        ("<task>t</task><env>\ndef f(:\n  pass\n</env>", "stop", "syntax_error", "line 1"),
        (
            "<task>t</task><env>\nimport gymnasium\nclass AEnv(gymnasium.Env):\n    pass\n</env>",
            "stop",
            "contract_violation",
            "func_mapping",
        ),
        (
            "<task>t</task><env>\n" + SAMPLE + "\n" + SAMPLE.replace("ArrayGcdEnv", "OtherEnv") + "</env>",
            "stop",
            "contract_violation",
            "several env classes",
        ),
        ("<task>  </task><env>\n" + SAMPLE + "</env>", "stop", "missing_marker", "empty"),
    ],
)
def test_env_output_rejections_have_reasons(text: str, finish: str, status: str, words: str) -> None:
    parsed = parse_env_output(text, finish)
    assert parsed.status == status, parsed
    assert any(words in r for r in parsed.reasons), parsed.reasons


def test_test_lines_json_only_class_checked_difficulty_by_position() -> None:
    body = good_tests("GEnv", count=15).replace("</tests>", "")
    extra = "\nGEnv@{'nums': [1]}\nOtherEnv@{\"nums\": [2]}\nGEnv@[1, 2]\nno at sign\n</tests>"
    tests = parse_test_lines("<think>GEnv@{}</think>" + body + extra, "GEnv")
    ok = [t for t in tests if t.status == "ok"]
    assert [t.difficulty for t in ok] == ["easy"] * 5 + ["medium"] * 5 + ["hard"] * 5
    bad = [t.reason for t in tests if t.status != "ok"]
    assert len(bad) == 4
    assert "not valid JSON" in bad[0] and "not GEnv" in bad[1] and "not a JSON object" in bad[2]
    assert "not 'Env@{json}'" in bad[3]
    assert all(t.difficulty == "hard" for t in parse_test_lines(good_tests("GEnv", 3), "GEnv", hard=True))


def test_splice_replaces_the_solve_span_or_adds_it() -> None:
    replaced = splice_solve(SAMPLE, GOOD_SOLVE.replace("return call", "# spliced\n    return call"))
    assert replaced.count("def solve(self):") == 1 and "# spliced" in replaced
    assert analyze_source(replaced).ok and replaced.endswith(SAMPLE[SAMPLE.index("\n\ndef _parse_config") :])
    start = SAMPLE.index("    def solve(self):")
    end = SAMPLE.index("\n\n\ndef _parse_config")
    without = SAMPLE[:start].rstrip() + "\n" + SAMPLE[end:]
    added = splice_solve(without, GOOD_SOLVE)
    assert added.count("def solve(self):") == 1 and analyze_source(added).ok
    assert "solve" in analyze_source(added).methods


@pytest.mark.parametrize(
    ("text", "status", "words"),
    [
        ("no marker here", "missing_marker", "<answer>"),
        ("<answer>\ndef solve(self):\n    return (\n</answer>", "syntax_error", "line"),
        ("<answer>\ndef solve():\n    return 1\n</answer>", "contract_violation", "self"),
        ("<answer>\ndef play(self):\n    return 1\n</answer>", "contract_violation", "found 0"),
    ],
)
def test_solve_candidates(text: str, status: str, words: str) -> None:
    parsed = parse_solve_output(text, SAMPLE)
    assert parsed.status == status and any(words in r for r in parsed.reasons), parsed
    good = parse_solve_output(f"<answer>\n```python\n{GOOD_SOLVE}```\n</answer>", SAMPLE)
    assert good.status == "ok" and analyze_source(good.env_source).ok


# ---- the gateway against real HTTP ----------------------------------------------------------------


def gateway(llm: ScriptedLLM, tmp_path: Path, **settings: Any) -> LLMGateway:
    options: dict[str, Any] = {"backoff_s": 0.05, "max_retries": 3, "timeout_s": 5.0, **settings}
    return LLMGateway(LLMSettings(base_url=llm.base_url, **options), ResponseCache(tmp_path / "cache.db"))


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def scripted(replies: list[R]) -> Any:
    """Answer requests with `replies` in order (the last one repeats)."""
    state = {"i": 0}

    def script(body: dict[str, Any]) -> R:
        reply = replies[min(state["i"], len(replies) - 1)]
        state["i"] += 1
        n = int(body.get("n") or 1)
        if reply.status == 200 and len(reply.contents) == 1 and n > 1:
            return R([reply.contents[0] + f" #{i}" for i in range(n)], finish_reason=reply.finish_reason)
        return reply

    return script


def test_429_with_retry_after_is_honoured_and_counted(tmp_path: Path) -> None:
    replies = [R(status=429, error="slow down", headers={"retry-after-ms": "300"}), R(["fine"])]
    with ScriptedLLM(scripted(replies)) as llm:

        async def go() -> tuple[list[Any], float, Any]:
            gw = gateway(llm, tmp_path)
            started = time.monotonic()
            out = await gw.complete("environment", MESSAGES, StageParams(samples=1))
            await gw.close()
            return out, time.monotonic() - started, gw.usage["environment"]

        out, elapsed, usage = run(go())
    assert [c.text for c in out] == ["fine"]
    assert elapsed >= 0.3  # Retry-After wins over the 0.05 s back-off
    assert (usage.requests, usage.retries) == (2, 1)


def test_server_errors_and_timeouts_are_retried_then_reported(tmp_path: Path) -> None:
    replies = [R(status=500), R(status=503), R(["x"], delay_s=1.0), R(["ok"])]
    with ScriptedLLM(scripted(replies)) as llm:

        async def go() -> tuple[list[Any], Any]:
            gw = gateway(llm, tmp_path, timeout_s=0.4)
            out = await gw.complete("unit_tests", MESSAGES, StageParams(samples=1))
            await gw.close()
            return out, gw.usage["unit_tests"]

        out, usage = run(go())
        assert [c.text for c in out] == ["ok"] and (usage.requests, usage.retries) == (4, 3)

    with ScriptedLLM(scripted([R(status=500, error="always broken")])) as llm:

        async def fail() -> None:
            gw = gateway(llm, tmp_path / "b", max_retries=2)
            try:
                await gw.complete("environment", MESSAGES, StageParams(samples=1))
            finally:
                await gw.close()

        with pytest.raises(LLMUnavailable, match="after 3 attempts: 500"):
            run(fail())
        assert llm.count() == 3


def test_endpoint_down_is_unavailable(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    gw = LLMGateway(LLMSettings(base_url=f"http://127.0.0.1:{port}/v1", backoff_s=0.01, max_retries=1))

    async def go() -> None:
        try:
            await gw.complete("environment", MESSAGES, StageParams(samples=1))
        finally:
            await gw.close()

    with pytest.raises(LLMUnavailable, match="connection failed"):
        run(go())


def test_samples_use_n_or_parallel_requests_and_the_cache(tmp_path: Path) -> None:
    with ScriptedLLM(scripted([R(["answer"])])) as llm:

        async def go(gw: LLMGateway) -> list[str]:
            out = await gw.complete("solve_functions", MESSAGES, StageParams(samples=4))
            await gw.close()
            return [c.text for c in out]

        first = run(go(gateway(llm, tmp_path)))
        assert first == [f"answer #{i}" for i in range(4)] and llm.count() == 1
        again = gateway(llm, tmp_path)
        assert run(go(again)) == first and llm.count() == 1
        assert again.usage["solve_functions"].cache_hits == 4 and again.usage["solve_functions"].requests == 0

    with ScriptedLLM(scripted([R(["solo"])]), n_supported=False) as llm:
        gw = gateway(llm, tmp_path / "no-n")
        assert run(go(gw)) == ["solo"] * 4
        assert llm.count() == 5 and not gw.n_supported  # one refused n=4, then 4 single requests

    # An endpoint that returns fewer choices than asked: the rest come from single requests.
    def short(body: dict[str, Any]) -> R:
        return R(["one", "two"]) if int(body.get("n") or 1) > 1 else R(["single"])

    with ScriptedLLM(short) as llm:
        assert run(go(gateway(llm, tmp_path / "short"))) == ["one", "two", "single", "single"]


def test_token_usage_is_accounted(tmp_path: Path) -> None:
    content = "x" * 400
    with ScriptedLLM(scripted([R([content])])) as llm:

        async def go() -> Any:
            gw = gateway(llm, tmp_path)
            await gw.complete("environment", [{"role": "user", "content": "p" * 800}], StageParams(samples=2))
            await gw.close()
            return gw.usage["environment"]

        usage = run(go())
    assert usage.prompt_tokens == 200 and usage.completion_tokens == 2 * len(content + " #0") // 4


# ---- problems -------------------------------------------------------------------------------------


def test_problem_rows_are_validated_and_none_dropped_silently(tmp_path: Path) -> None:
    rows = [
        {"question_id": "A_1", "question": "q", "solution": "def f(): pass"},
        {"question_id": "A_2", "question": "q"},
        {"question_id": "A_1", "question": "again", "solution": "x"},
        {"question_id": "A_3", "question": "q", "solution": "   "},
        {"question_id": "bad id!", "question": "q", "solution": "x"},
        {"question_id": "A_4", "question": "", "solution": "x"},
    ]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "{broken\n")
    problems, errors = load_problems(path)
    assert [p.question_id for p in problems] == ["A_1"]
    reasons = [e.reason for e in errors]
    assert len(reasons) == 6
    assert "missing field(s): solution" in reasons[0] and "duplicate question_id A_1" in reasons[1]
    assert "empty solution" in reasons[2] and "not usable as a code id" in reasons[3]
    assert "empty question" in reasons[4] and "not valid JSON" in reasons[5]

    parquet = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist([json.loads(x) for x in PROBLEMS.read_text().splitlines()]), parquet)
    from_parquet, errors = load_problems(parquet)
    assert errors == [] and len(from_parquet) == 10
    assert from_parquet == load_problems(PROBLEMS)[0]


# ---- the command ----------------------------------------------------------------------------------


def synthesize(llm: ScriptedLLM, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    args = [
        "synthesize",
        "--problems",
        str(PROBLEMS),
        "--out",
        str(out),
        "--llm-base-url",
        llm.base_url,
        *extra,
    ]
    return subprocess.run(
        [sys.executable, "-m", "codegym_cli.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


@pytest.mark.slow  # over 10 s
def test_codegym_synthesize_runs_all_stages_and_reruns_for_free(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with ScriptedLLM() as llm:
        first = synthesize(llm, out, "--stage", "solve_functions.samples=6")
        assert first.returncode == 0, first.stdout + first.stderr
        calls = llm.count()
        assert {stage_of(r) for r in llm.requests} == {
            "environment",
            "unit_tests",
            "hard_tests",
            "solve_functions",
        }
        second = synthesize(llm, out, "--stage", "solve_functions.samples=6")
        assert second.returncode == 0 and llm.count() == calls  # no HTTP call the second time
    summary = json.loads((out / "summary.json").read_text())
    assert summary["environments"] == 10
    assert summary["stages"]["environment"] == {"accepted": 10, "rejected": 0, "reasons": {}}
    assert summary["stages"]["unit_tests"]["accepted"] == 300
    assert summary["stages"]["solve_functions"] == {
        "accepted": 40,
        "rejected": 20,
        "reasons": {"no complete <answer> block": 20},
    }
    assert (
        summary["usage"]["environment"]["cache_hits"] == 10
        and summary["usage"]["environment"]["requests"] == 0
    )
    assert "solve_functions" in second.stdout and "no complete <answer> block" in second.stdout
    envs = sorted((out / "envs").glob("*.py"))
    assert len(envs) == 10 and all(analyze_source(p.read_text()).ok for p in envs)
    with Library(tmp_path / "lib.db") as lib:
        report = lib.import_paths([out / "envs", out / "tests"])
    assert report.skipped == [] and len(report.added) == 10 and report.tasks_added == 350
    rejected = [json.loads(x) for p in (out / "rejected").glob("*.jsonl") for x in p.read_text().splitlines()]
    assert len(rejected) == 20 and all(r["stage"] == "solve_functions" for r in rejected)


@pytest.mark.slow  # over 10 s
def test_codegym_synthesize_reports_refused_rows_and_bad_overrides(tmp_path: Path) -> None:
    with ScriptedLLM() as llm:
        bad = synthesize(llm, tmp_path / "o", "--stage", "nonsense=1")
        assert bad.returncode != 0 and "STAGE.KEY=VALUE" in bad.stderr
        rows = tmp_path / "rows.jsonl"
        rows.write_text(json.dumps({"question_id": "X_1", "question": "q"}) + "\n")
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "codegym_cli.cli",
                "synthesize",
                "--problems",
                str(rows),
                "--out",
                str(tmp_path / "o"),
                "--llm-base-url",
                llm.base_url,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
        assert result.returncode == 2 and "missing field(s): solution" in result.stderr
        assert llm.count() == 0


# ---- the gRPC service -----------------------------------------------------------------------------


def problem_message(index: int = 0) -> sy.Problem:
    row = json.loads(PROBLEMS.read_text().splitlines()[index])
    return sy.Problem(question_id=row["question_id"], question=row["question"], solution=row["solution"])


def test_synthesis_service(tmp_path: Path) -> None:
    with ScriptedLLM() as llm:
        server = CodegymServer(
            ["serve", "synthesis", "--port", "0", "--llm-base-url", llm.base_url, "--out", str(tmp_path)]
        )
        try:
            with grpc.insecure_channel(server.address) as channel:
                stub = sy_grpc.SynthesisServiceStub(channel)
                env = stub.GenerateEnvironment(
                    sy.GenerateEnvironmentRequest(problem=problem_message()), timeout=60
                )
                (candidate,) = env.candidates
                assert candidate.status == sy.PARSE_STATUS_OK and candidate.env_class.endswith("GcdEnv")
                assert env.usage.requests == 1 and env.usage.prompt_tokens > 0
                tests = stub.GenerateUnitTests(
                    sy.GenerateUnitTestsRequest(
                        task_text=candidate.task_text,
                        env_source=candidate.env_source,
                        hard=True,
                        seed_tests=["x"],
                    ),
                    timeout=60,
                )
                assert len(tests.tests) == 5 and {t.difficulty for t in tests.tests} == {"hard"}
                solves = stub.GenerateSolveFunctions(
                    sy.GenerateSolveFunctionsRequest(
                        task_text=candidate.task_text, env_source=candidate.env_source, count=3
                    ),
                    timeout=60,
                )
                statuses = [c.status for c in solves.candidates]
                assert statuses == [sy.PARSE_STATUS_OK, sy.PARSE_STATUS_OK, sy.PARSE_STATUS_MISSING_MARKER]
                assert "def solve(self):" in solves.candidates[0].env_source
                stream = list(
                    stub.SynthesizeStream(
                        sy.SynthesizeStreamRequest(problems=[problem_message(i) for i in range(3)]),
                        timeout=120,
                    )
                )
                assert stream[-1].stage == "summary" and stream[-1].accepted == 3 and stream[-1].done == 3
                assert {(m.question_id, m.stage) for m in stream[:-1]} == {
                    (problem_message(i).question_id, s)
                    for i in range(3)
                    for s in ("environment", "unit_tests", "hard_tests", "solve_functions")
                }
                assert Path(stream[-1].output, "summary.json").exists()
                err = None
                try:
                    stub.GenerateEnvironment(sy.GenerateEnvironmentRequest(problem=sy.Problem()), timeout=10)
                except grpc.RpcError as exc:
                    err = exc
                assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT
        finally:
            assert server.stop() == 0


def test_synthesis_service_with_the_llm_down_answers_unavailable(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    server = CodegymServer(
        [
            "serve",
            "synthesis",
            "--port",
            "0",
            "--llm-base-url",
            dead,
            "--out",
            str(tmp_path),
            "--max-retries",
            "1",
            "--backoff-s",
            "0.01",
        ]
    )
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = sy_grpc.SynthesisServiceStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                stub.GenerateEnvironment(sy.GenerateEnvironmentRequest(problem=problem_message()), timeout=30)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "connection failed" in (info.value.details() or "")
    finally:
        assert server.stop() == 0


def test_environment_stage_through_http_keeps_every_candidate_with_its_reason(tmp_path: Path) -> None:
    from services.synthesis.problems import Problem
    from services.synthesis.stages import Synthesizer

    two_classes = (
        "<task>t</task><env>\n" + SAMPLE + "\n" + SAMPLE.replace("ArrayGcdEnv", "TwinEnv") + "</env>"
    )
    outputs = {
        0: R(["<think>let me think</think>" + good_env("GoodGcdEnv")]),
        1: R([good_env("CutEnv")[:900]], finish_reason="length"),
        2: R(["Sorry, here is the code without markers: import gymnasium"]),
        3: R([two_classes]),
    }
    order = iter(range(4))

    def script(body: dict[str, Any]) -> R:
        return outputs[next(order)]

    with ScriptedLLM(script, n_supported=False) as llm:

        async def go() -> list[Any]:
            gw = gateway(llm, tmp_path)
            try:
                return await Synthesizer(gw).environment(
                    Problem("P_1", "q", "def f(): pass"), StageParams(samples=4, model="m")
                )
            finally:
                await gw.close()

        envs = run(go())
    assert sorted(e.status for e in envs) == ["contract_violation", "missing_marker", "ok", "truncated"]
    by_status = {e.status: e for e in envs}
    assert by_status["ok"].env_class == "GoodGcdEnv"
    assert "token limit" in by_status["truncated"].reasons[0]
    assert "several env classes" in by_status["contract_violation"].reasons[0]

"""CodeGym's TRL adapter inside TRL itself: one step of TRL's own `GRPOTrainer` with
`CodeGymSpec.environment_factory`, against a real runtime serving the sample library
(tests/helpers/trl_run.py: a scripted model, TRL's Qwen2.5 chat template).

TRL needs torch, so this runs where tests/test_verl_real.py runs: `make test-trainers` (a venv of
its own, `CODEGYM_TEST_RUNTIME` naming a runtime started from the project's venv). Elsewhere the
file skips; `CODEGYM_TESTS_REQUIRE_TRAINERS=1` turns that skip into a failure.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from codegym_testkit.trainer_script import trajectory

REQUIRED = os.environ.get("CODEGYM_TESTS_REQUIRE_TRAINERS") == "1"
RUNTIME = os.environ.get("CODEGYM_TEST_RUNTIME", "").strip()
if importlib.util.find_spec("trl") is None or importlib.util.find_spec("torch") is None or not RUNTIME:
    why = "needs TRL, torch and CODEGYM_TEST_RUNTIME (run `make test-trainers`)"
    if REQUIRED:
        raise RuntimeError(f"CODEGYM_TESTS_REQUIRE_TRAINERS=1: this file {why}")
    pytest.skip(why, allow_module_level=True)

from codegym_client import RuntimeClient, SessionNotFound  # noqa: E402
from tests.helpers.trl_run import RUN_NAME, UNFINISHED, UNFINISHED_CALLS  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(600)
def test_one_grpo_step_of_trls_trainer_scores_the_environments_and_leaves_no_session(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    run = subprocess.run(
        [sys.executable, "-m", "tests.helpers.trl_run", RUNTIME, str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=540,
        env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'clients'}"},
    )
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(out.read_text())
    (step, _summary) = result["log"]
    # TRL's own reward columns, one per environment class (its multi-environment path): the oracle
    # scores 1, the wrong final answer 0, the episode left unanswered 0; no tool call failed.
    assert step["rewards/ArrayGcdEnv/mean"] == 1.0
    assert step["rewards/MaxSubarraySumEnv/mean"] == 0.0
    assert step["rewards/MergeIntervalsEnv/mean"] == 0.0
    assert step["reward"] == pytest.approx(1 / 3)
    calls = len(trajectory("Sample_0006_I__ArrayGcdEnv")["steps"]) + 3 + UNFINISHED_CALLS
    assert step["tools/call_frequency"] == pytest.approx(calls / 3) and step["tools/failure_frequency"] == 0.0
    assert step["grad_norm"] >= 0.0 and step["num_tokens"] > 0
    # The unfinished episodes' sessions were open in the runtime when the script exited without
    # closing them (TRL never does): the adapter's exit hook closed every one.
    assert len(result["sessions"]) == 2 and result["open"] == result["sessions"]
    with RuntimeClient(RUNTIME, timeout_s=30) as client:
        for session_id in result["sessions"]:
            with pytest.raises(SessionNotFound):
                client.get_session(session_id)
        # The spec's callback named the sessions after GRPOConfig's run_name and the global step
        # (0: the first step's rollouts): the runtime recorded the finished episodes for that run
        # (the unfinished one, closed before its end, is not an outcome).
        assert result["run"] == {"run_id": RUN_NAME, "policy_version": 0}
        played = {
            e.task.env_id: e.task
            for e in client.stats(RUN_NAME, played_only=True)
            if e.WhichOneof("entry") == "task"
        }
        assert {"Sample_0006_I__ArrayGcdEnv", "Sample_0001_I__MaxSubarraySumEnv"} <= set(played)
        assert UNFINISHED["env_id"] not in played
        gcd = played["Sample_0006_I__ArrayGcdEnv"]
        assert (gcd.episodes, gcd.passes, gcd.last_policy_version) == (2, 2, 0)


@pytest.mark.timeout(600)
def test_one_grpo_step_on_the_curriculum_stream(tmp_path: Path) -> None:
    """`spec.curriculum()` as GRPOTrainer's train_dataset (an IterableDataset: TRL repeats each
    row num_generations times, so a group plays one task): one step trains on the runtime's choice
    for the run the callback names, and its episodes are recorded for that run."""
    out = tmp_path / "run.json"
    run = subprocess.run(
        [sys.executable, "-m", "tests.helpers.trl_run", RUNTIME, str(out), "--curriculum"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=540,
        env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'clients'}"},
    )
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(out.read_text())
    (step, _summary) = result["log"]
    assert step["num_tokens"] > 0 and "reward" in step
    assert result["run"]["run_id"] == RUN_NAME + "-curriculum"
    with RuntimeClient(RUNTIME, timeout_s=30) as client:
        recorded = [
            e.task
            for e in client.stats(RUN_NAME + "-curriculum", played_only=True)
            if e.WhichOneof("entry") == "task"
        ]
    assert recorded and all(t.last_policy_version == 0 for t in recorded)

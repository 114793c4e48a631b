"""`codegym env describe|check` as a user runs them: a real process, real exit codes."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.conftest import FIXTURE_ENVS, PYTHON, sample_env_paths, training_instances


def codegym(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PYTHON, "-m", "codegym_cli.cli", *args], capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("instance", training_instances(), ids=lambda d: d["code_id"])
def test_describe_text_prints_the_system_message(instance: dict) -> None:
    env_id = instance["ability"].split("@")[1]
    result = codegym("env", "describe", str(FIXTURE_ENVS / f"{env_id}.py"))
    assert result.returncode == 0, result.stderr
    assert result.stdout == instance["prompt"][0]["content"]


def test_describe_keeps_whitespace_only_docstring_lines(tmp_path: Path, good_source: str) -> None:
    # CodeGym's prompts keep such a line's whitespace, one indentation level less (issue 16).
    blank = "        Get the number of elements in the hidden array.\n\n        Args:"
    assert blank in good_source
    env = tmp_path / "X_1__MaxSubarraySumEnv.py"
    env.write_text(good_source.replace(blank, blank.replace("\n\n", "\n        \n"), 1))
    result = codegym("env", "describe", str(env))
    assert result.returncode == 0, result.stderr
    assert "    Get the number of elements in the hidden array.\n    \n    Args:\n" in result.stdout
    plain = tmp_path / "X_2__MaxSubarraySumEnv.py"
    plain.write_text(good_source)
    expected = codegym("env", "describe", str(plain)).stdout.replace(
        "array.\n\n    Args:", "array.\n    \n    Args:", 1
    )
    assert result.stdout == expected


def test_describe_json_prints_tool_definitions() -> None:
    result = codegym("env", "describe", "--format", "json", str(sample_env_paths()[0]))
    assert result.returncode == 0
    tools = json.loads(result.stdout)
    assert tools[0]["function"]["name"] == "Observe"
    assert all(t["type"] == "function" for t in tools)


@pytest.mark.slow  # one command line per sample env: over 10 s on 2 busy cores
def test_check_passes_every_sample_env() -> None:
    for path in sample_env_paths():
        result = codegym("env", "check", str(path))
        assert result.returncode == 0, result.stdout
        assert "contract OK" in result.stdout


def test_check_rejects_a_violation_with_its_name(tmp_path: Path, good_source: str) -> None:
    bad = tmp_path / "X_1__MaxSubarraySumEnv.py"
    bad.write_text(good_source.replace('"Done": self.DONE,', '"Done": self.DONE,\n            "Fly": 7,'))
    result = codegym("env", "check", str(bad))
    assert result.returncode == 1
    assert "tool Fly has no method Fly()" in result.stdout
    report = json.loads(codegym("env", "check", "--format", "json", str(bad)).stdout)
    assert report["ok"] is False and report["violations"][0]["code"] == "tool_without_method"


def test_check_reports_safety_findings(tmp_path: Path, good_source: str) -> None:
    risky = tmp_path / "X_1__MaxSubarraySumEnv.py"
    risky.write_text(good_source.replace("import json\n", "import json\nimport subprocess\n", 1))
    result = codegym("env", "check", str(risky))
    assert result.returncode == 0
    assert "import: subprocess" in result.stdout


def test_usage_errors_exit_2(tmp_path: Path) -> None:
    assert codegym("env", "check").returncode == 2
    assert codegym("env", "check", str(tmp_path / "missing.py")).returncode == 2
    assert codegym("env", "describe", "--format", "yaml", str(sample_env_paths()[0])).returncode == 2


def test_every_command_has_help() -> None:
    for args in (["--help"], ["env", "--help"], ["env", "describe", "--help"], ["env", "check", "--help"]):
        result = codegym(*args)
        assert result.returncode == 0 and "usage:" in result.stdout

"""Shared fixtures: paths to the sample data and the project's example environments."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
ENV_DIR = EXAMPLES / "envs"
FIXTURE_ENVS = ROOT / "tests" / "fixtures" / "envs"
SHARED_DATA = ROOT / "tests" / "fixtures" / "data"
PYTHON = sys.executable


def sample_env_paths() -> list[Path]:
    return sorted(ENV_DIR.glob("*__*Env.py"))


def sample_tasks() -> list[dict[str, Any]]:
    return [json.loads(line) for line in (EXAMPLES / "tasks.jsonl").read_text().splitlines() if line.strip()]


def training_instances() -> list[dict[str, Any]]:
    path = SHARED_DATA / "training_instance_sample.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "deployable: needs only a runtime serving the sample library; runs against CODEGYM_TEST_RUNTIME "
        "when set (see tests/helpers/servers.py)",
    )


@pytest.fixture(scope="session")
def good_source() -> str:
    return (ENV_DIR / "Sample_0001_I__MaxSubarraySumEnv.py").read_text()

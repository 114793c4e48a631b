"""Shared fixtures: paths to the sample data and the project's example environments."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import jail_guard

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "codegym" / "samples"  # the sample environments and their data (package data)
ENV_DIR = SAMPLES / "envs"
FIXTURE_ENVS = ROOT / "tests" / "fixtures" / "envs"
SHARED_DATA = ROOT / "tests" / "fixtures" / "data"
PYTHON = sys.executable
JAIL_WATCH = pytest.StashKey[Any]()


def sample_env_paths() -> list[Path]:
    return sorted(ENV_DIR.glob("*__*Env.py"))


def sample_tasks() -> list[dict[str, Any]]:
    return [json.loads(line) for line in (SAMPLES / "tasks.jsonl").read_text().splitlines() if line.strip()]


def training_instances() -> list[dict[str, Any]]:
    path = SHARED_DATA / "training_instance_sample.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# The markers (`jail`, `slow`, `deployable`) are declared in pyproject.toml; `--strict-markers`.


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Any:
    """Watch an unmarked test for jails from before its fixtures start (tests/helpers/jail_guard.py)."""
    if item.get_closest_marker("jail") is None and jail_guard.supported():
        item.stash[JAIL_WATCH] = jail_guard.JailWatch()
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    """Fail a test that started a jail but is not marked `jail` (its fixtures included)."""
    try:
        result = yield
    finally:
        watch = item.stash.get(JAIL_WATCH, None)
        started = watch.stop() if watch is not None else []
    if started:
        pytest.fail(
            "this test started a sandbox worker's jails but is not marked `jail`: add "
            "@pytest.mark.jail (or a module-level pytestmark); nsjail processes seen: " + "; ".join(started),
            pytrace=False,
        )
    return result


def pytest_runtest_teardown(item: pytest.Item) -> None:
    """A test whose setup failed never ran its call: end its watch here."""
    watch = item.stash.get(JAIL_WATCH, None)
    if watch is not None:
        watch.stop()


@pytest.fixture(scope="session")
def good_source() -> str:
    return (ENV_DIR / "Sample_0001_I__MaxSubarraySumEnv.py").read_text()


@pytest.fixture
def get_env_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The env ids every `RuntimeClient.get_env` of the test asked for, in order (the calls still go
    to the runtime): how the TRL spec's GetEnv traffic is counted."""
    from codegym_client import RuntimeClient

    asked: list[str] = []
    get_env = RuntimeClient.get_env

    def counting(self: RuntimeClient, env_id: str) -> Any:
        asked.append(env_id)
        return get_env(self, env_id)

    monkeypatch.setattr(RuntimeClient, "get_env", counting)
    return asked

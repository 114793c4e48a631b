"""examples/tree_rollouts runs against real runtime and sandbox workers: each root episode is forked
after its chosen tool calls, every branch plays on under its own random policy, and each group of
branches comes back with rewards that differ (what a GRPO-style learner needs from a group). The
example is run as a user runs it, a process of its own, and its printed groups are read."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.helpers.libraries import SAMPLE_LIBRARY, library_fixture
from tests.helpers.servers import CodegymServer, workers_fixture
from tests.test_metrics import metrics_address, scrape

pytestmark = pytest.mark.jail  # every step runs in a real jail

EXAMPLE = ROOT / "examples" / "tree_rollouts" / "tree_rollouts.py"
GROUP = re.compile(r"^group (\S+) @ step (\d+) \((\S+)\): rewards ([-\d. ]+)$")

library = library_fixture(SAMPLE_LIBRARY)
workers = workers_fixture(2, addresses=True)


@pytest.fixture(scope="module")
def runtime(library: Path, workers: str) -> Iterator[CodegymServer]:
    args = ["serve", "runtime", "--port", "0", "--library", str(library), "--sandbox", workers]
    server = CodegymServer([*args, "--metrics-port", "0"])
    try:
        yield server
    finally:
        server.stop()


def test_the_example_branches_episodes_whose_groups_rewards_differ(runtime: CodegymServer) -> None:
    args = ["--target", runtime.address, "--roots", "4", "--ways", "4", "--branch-at", "3", "--seed", "1"]
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    groups = [GROUP.match(line) for line in lines if line.startswith("group ")]
    assert groups and all(groups), done.stdout
    # 4 roots, each forked 4 ways after its third tool call: a group each.
    assert [match.group(2) for match in groups if match] == ["3"] * 4, done.stdout
    for match in groups:
        assert match is not None
        rewards = [float(x) for x in match.group(4).split()]
        assert len(rewards) == 4
        assert len(set(rewards)) > 1, f"a group whose rewards are all equal: {match.group(0)}"
    assert lines[-1] == f"{len(groups)} groups, {len(groups)} with rewards that differ"
    # The run ended cleanly: every session it opened (roots, the nodes it forked, leaves) is closed.
    assert scrape(metrics_address(runtime))["codegym_runtime_sessions_open"] == 0

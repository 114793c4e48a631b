"""`make bench-fork` runs: its quick mode's smallest part (back to back: creates, forks, the forks'
first steps) against a real `codegym up`, so the bench cannot rot between the runs that fill
docs/benchmarks.md. What it measures is read from its JSON, not judged (timing is the bench's
business, not a test's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.jail  # `codegym up` runs real sandbox workers


def test_the_quick_back_to_back_part_measures_every_call(tmp_path: Path) -> None:
    out = tmp_path / "fork.json"
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "fork_bench.py"),
            "--quick",
            "--parts",
            "backtoback",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(out.read_text())
    part = figures["parts"]["backtoback"]
    for call in ("create", "fork", "fork first step", "created first step"):
        assert part[call]["n"] == 200, (call, part[call])
        assert part[call]["per_s"] > 0 and part[call]["cpu_ms"] > 0, (call, part[call])
    (target,) = figures["targets"]
    assert target["target"] == "back to back: forks/s over creates/s"
    assert "forks/s over creates/s" in done.stdout and "fork first step" in done.stdout

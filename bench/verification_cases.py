"""What the verification bench (bench/verification_bench.py) verifies and what it keeps of each run:
one sample environment with candidate solve()s and test configs, the naive runner the services are
compared with, and the measurements as records (of one call, of the services, of the naive way).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import median
from codegym.contract import sha256_text
from codegym.contract.source import method_source
from codegym.sandbox.v1 import sandbox_service_pb2 as sb
from codegym.verification.v1 import verification_service_pb2 as vf
from codegym_client.api.common.v1 import common_pb2 as cm
from codegym_testkit.sample_configs import sample_configs

ROOT = Path(__file__).resolve().parent.parent
ENV = ROOT / "codegym" / "samples" / "envs" / "Sample_0001_I__MaxSubarraySumEnv.py"
ENV_CLASS = "MaxSubarraySumEnv"
WORKERS = 2  # sandbox workers started, and naive processes run at a time (the machine has 2 cores)
CANDIDATES = 10
TESTS = 30
# The limits CheckSolvability uses by default, for the ExecuteBatch matrix.
CASE_LIMITS = sb.Limits(wall_ms=10_000, cpu_ms=10_000, memory_mb=256)
MAX_STEPS = 1_024


# One (candidate, test) case the naive way: a fresh interpreter imports the env file, builds the
# env from its config, puts the candidate in place of solve() and prints the reward.
NAIVE_RUNNER = """\
import importlib.util
import json
import sys

env_path, config_json, solve_path, class_name = sys.argv[1:5]
spec = importlib.util.spec_from_file_location("env_under_test", env_path)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
cls = getattr(module, class_name)
namespace = dict(vars(module))
with open(solve_path) as f:
    exec(compile(f.read(), "<solve>", "exec"), namespace)
cls.solve = namespace["solve"]
env = cls.from_env_str(f"{cls.__name__}@{json.dumps(json.loads(config_json))}")
env.solve()
print(env.reward)
"""


def kadane_trace(nums: list[int]) -> tuple[int, int, int]:
    """(n, best, current) as the env's solve() holds them when it calls Done."""
    best = current = nums[0]
    for value in nums[1:]:
        current = max(value, current + value)
        best = max(best, current)
    return len(nums), best, current


def candidate_sets(source: str, configs: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
    """(all pass, full matrix): 10 copies of the env's solve(); and 9 copies that answer wrong only
    on the last test (told apart by what solve() itself read through the tools), then the original."""
    body = method_source(source, "solve")
    done = 'return call("Done", answer=best)'
    key = kadane_trace(configs[-1]["nums"])
    if done not in body or [kadane_trace(c["nums"]) for c in configs].count(key) != 1:
        raise RuntimeError("cannot build candidates that fail only on the last test")
    wrong = body.replace(done, f'return call("Done", answer=best + ((n, best, current) == {key}))')
    all_pass = [f"# candidate {i}\n{body}" for i in range(CANDIDATES)]
    full = [f"# candidate {i}\n{wrong}" for i in range(CANDIDATES - 1)] + [all_pass[-1]]
    return all_pass, full


@dataclass
class Inputs:
    """What the measurements send: the env, its test configs, and the two candidate sets."""

    source: str
    sha: str
    configs: list[dict[str, Any]]
    tasks: list[cm.TaskConfig]
    all_pass: list[str]  # 10 copies of the env's solve()
    full: list[str]  # 9 wrong on the last test only, then the env's solve()
    matrix: list[tuple[int, int]]  # every (candidate, test)


def prepare_inputs() -> Inputs:
    source = ENV.read_text()
    configs = sample_configs(ENV_CLASS, TESTS, seed=0)
    all_pass, full = candidate_sets(source, configs)
    return Inputs(
        source=source,
        sha=sha256_text(source),
        configs=configs,
        tasks=[cm.TaskConfig(config_json=json.dumps(c)) for c in configs],
        all_pass=all_pass,
        full=full,
        matrix=[(c, t) for c in range(CANDIDATES) for t in range(TESTS)],
    )


@dataclass
class Measured:
    """One call measured: the walls of its timed runs, its last response, and CPU per call."""

    walls: list[float]
    last: Any
    servers_cpu_s: float  # per call
    bench_cpu_s: float  # per call

    @property
    def wall(self) -> float:
        return median(self.walls)


@dataclass
class ServiceRuns:
    allpass: Measured  # CheckSolvability, every candidate the env's solve()
    fullm: Measured  # CheckSolvability, the full matrix
    batch: Measured  # ExecuteBatch of the full matrix straight to the workers
    units: Measured  # ValidateUnitTests
    negative: Measured  # CheckNegativeControls
    determ5: Measured  # CheckDeterminism, default 5 tests
    determ30: Measured  # CheckDeterminism, all tests
    guess: Measured  # MeasureGuessability


def outcome_summary(response: vf.CheckSolvabilityResponse) -> str:
    counts: dict[str, int] = {}
    for report in response.candidates:
        name = vf.CandidateOutcome.Name(report.outcome).removeprefix("CANDIDATE_OUTCOME_").lower()
        counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{n} {name}" for name, n in counts.items())


@dataclass
class NaiveRun:
    sample: list[tuple[int, int]]  # the (candidate, test) cases timed
    wall: float
    cpu: float  # of the processes, reaped
    rewards: list[float | None]

    @property
    def wall_per_case(self) -> float:
        return self.wall / len(self.sample)

    @property
    def cpu_per_case(self) -> float:
        return self.cpu / len(self.sample)

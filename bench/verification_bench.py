"""Verification benchmark: solvability of one environment (10 solve() candidates × 30 tests).

Starts two sandbox workers (`codegym serve sandbox --jails N`, one per core) and one
`codegym serve verification` over them as separate processes, then measures:

- CheckSolvability with the env's own solve() as all 10 candidates (the service stops at the
  first candidate that solves every test, so this runs 10 smoke cases + 29), and with candidates
  0..8 wrong only on the last test (a full matrix: all 10 candidates run on all 30 tests);
- the same 300 (candidate, test) cases sent straight to the workers with `ExecuteBatch`;
- ValidateUnitTests on the 30 configs;
- the checks after solvability on the same 30 tests: CheckNegativeControls (every wrong answer
  derived from each reference answer, one sandbox run per test), CheckDeterminism (the oracle
  twice per test, on the default 5 tests and on all 30) and MeasureGuessability;
- the naive way, in the same run: each case as one fresh, unjailed Python process (import the
  env file, build the env from its config, replace solve(), run it, print the reward), two at a
  time; a sample of the cases is timed and extrapolated to all 300.

Walls are medians of --runs calls after one warm-up; CPU is per call: the servers' process trees
(workers with their jails, and the verification service) from /proc, the bench process from
getrusage, the naive processes from getrusage of reaped children.

    .venv/bin/python bench/verification_bench.py [--runs 5] [--jails 1] [--naive-sample 40]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import median, rusage_cpu_s, start_process, tree_cpu_s  # noqa: E402
from codegym.contract import sha256_text  # noqa: E402
from codegym.contract.source import method_source  # noqa: E402
from codegym.procs import ServerProcess  # noqa: E402
from codegym.sandbox.v1 import sandbox_service_pb2 as sb  # noqa: E402
from codegym.sandbox.v1 import sandbox_service_pb2_grpc as sb_grpc  # noqa: E402
from codegym.verification.v1 import verification_service_pb2 as vf  # noqa: E402
from codegym.verification.v1 import verification_service_pb2_grpc as vf_grpc  # noqa: E402
from codegym_client.api.common.v1 import common_pb2 as cm  # noqa: E402
from codegym_testkit.sample_configs import sample_configs  # noqa: E402

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


async def measure(call: Callable[[], Awaitable[Any]], runs: int, server_pids: list[int]) -> Measured:
    """`runs` timed calls after one warm-up; the servers' CPU from /proc, the bench's from getrusage."""
    await call()  # warm-up
    servers0, bench0 = tree_cpu_s(server_pids), rusage_cpu_s(resource.RUSAGE_SELF)
    walls = []
    last = None
    for _ in range(runs):
        t = time.perf_counter()
        last = await call()
        walls.append(time.perf_counter() - t)
    servers1, bench1 = tree_cpu_s(server_pids), rusage_cpu_s(resource.RUSAGE_SELF)
    return Measured(walls, last, (servers1 - servers0) / runs, (bench1 - bench0) / runs)


def start_servers(jails: int, procs: list[ServerProcess]) -> tuple[list[str], str]:
    """WORKERS sandbox workers and a verification service over them: (workers' addresses, its address).

    Each process is added to `procs` as soon as it runs, so the caller stops every one started
    even when a later one fails to start.
    """
    addrs = []
    for _ in range(WORKERS):
        worker = start_process(
            [
                "-m",
                "codegym_cli.cli",
                "serve",
                "sandbox",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--jails",
                str(jails),
            ]
        )
        procs.append(worker)
        addrs.append(worker.address)
    verification = start_process(
        [
            "-m",
            "codegym_cli.cli",
            "serve",
            "verification",
            "--sandbox",
            ",".join(addrs),
            "--host",
            "127.0.0.1",
            "--port",
            "0",
        ]
    )
    procs.append(verification)
    return addrs, verification.address


def stop_servers(procs: list[ServerProcess]) -> None:
    for proc in procs:
        proc.stop()


def solvability_call(
    vstub: vf_grpc.VerificationServiceStub, inputs: Inputs, candidates: list[str]
) -> Callable[[], Awaitable[vf.CheckSolvabilityResponse]]:
    request = vf.CheckSolvabilityRequest(
        env_source=inputs.source, tasks=inputs.tasks, solve_sources=candidates
    )
    return lambda: vstub.CheckSolvability(request, timeout=300)


def batch_operations(inputs: Inputs, cases: list[tuple[int, int]]) -> list[sb.Operation]:
    """The `full` candidates on `cases` as solve operations; the first one carries the source."""
    ops = [
        sb.Operation(
            source=sb.SourceRef(sha256=inputs.sha),
            limits=CASE_LIMITS,
            solve=sb.SolveOp(
                config_json=inputs.tasks[t].config_json, solve_source=inputs.full[c], max_steps=MAX_STEPS
            ),
        )
        for c, t in cases
    ]
    ops[0].source.code = inputs.source  # the worker caches it before running the rest
    return ops


def matrix_call(
    wstubs: list[sb_grpc.SandboxServiceStub], inputs: Inputs
) -> Callable[[], Awaitable[dict[tuple[int, int], sb.OperationResult]]]:
    """The matrix split over the workers (alternate cases), one ExecuteBatch each, at once."""
    shares = [inputs.matrix[w::WORKERS] for w in range(WORKERS)]
    requests = [sb.ExecuteBatchRequest(operations=batch_operations(inputs, share)) for share in shares]

    async def execute_matrix() -> dict[tuple[int, int], sb.OperationResult]:
        responses = await asyncio.gather(
            *(stub.ExecuteBatch(req, timeout=300) for stub, req in zip(wstubs, requests, strict=True))
        )
        return {
            case: result
            for share, response in zip(shares, responses, strict=True)
            for case, result in zip(share, response.results, strict=True)
        }

    return execute_matrix


def validate_call(
    vstub: vf_grpc.VerificationServiceStub, inputs: Inputs
) -> Callable[[], Awaitable[vf.ValidateUnitTestsResponse]]:
    request = vf.ValidateUnitTestsRequest(env_source=inputs.source, tasks=inputs.tasks)
    return lambda: vstub.ValidateUnitTests(request, timeout=120)


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


async def measure_checks(
    vstub: vf_grpc.VerificationServiceStub,
    inputs: Inputs,
    units: vf.ValidateUnitTestsResponse,
    runs: int,
    pids: list[int],
) -> tuple[Measured, Measured, Measured, Measured]:
    """The checks after solvability, on the tests ValidateUnitTests found valid: negative controls,
    determinism on 5 and on all tests, guessability."""
    cases = [
        vf.ShortcutCase(config_json=t.task.config_json, answer_json=t.answer_json)
        for t in units.tests
        if t.valid
    ]
    oracle = method_source(inputs.source, "solve")
    config_jsons = [c.config_json for c in cases]

    def controls() -> Awaitable[vf.CheckNegativeControlsResponse]:
        request = vf.CheckNegativeControlsRequest(env_source=inputs.source, cases=cases)
        return vstub.CheckNegativeControls(request, timeout=300)

    def determinism(tests: int) -> Callable[[], Awaitable[vf.CheckDeterminismResponse]]:
        request = vf.CheckDeterminismRequest(
            env_source=inputs.source, solve_source=oracle, config_jsons=config_jsons, tests=tests
        )
        return lambda: vstub.CheckDeterminism(request, timeout=300)

    def guessability() -> Awaitable[vf.MeasureGuessabilityResponse]:
        return vstub.MeasureGuessability(vf.MeasureGuessabilityRequest(cases=cases), timeout=60)

    negative = await measure(controls, runs, pids)
    determ5 = await measure(determinism(5), runs, pids)
    determ30 = await measure(determinism(TESTS), runs, pids)
    guess = await measure(guessability, runs, pids)
    return negative, determ5, determ30, guess


async def measure_services(
    inputs: Inputs, worker_addrs: list[str], vaddr: str, runs: int, pids: list[int]
) -> ServiceRuns:
    """Every verification call, and the matrix straight to the workers, measured in turn."""
    async with grpc.aio.insecure_channel(vaddr) as vch:
        vstub = vf_grpc.VerificationServiceStub(vch)
        worker_channels = [grpc.aio.insecure_channel(a) for a in worker_addrs]
        wstubs = [sb_grpc.SandboxServiceStub(ch) for ch in worker_channels]
        allpass = await measure(solvability_call(vstub, inputs, inputs.all_pass), runs, pids)
        fullm = await measure(solvability_call(vstub, inputs, inputs.full), runs, pids)
        batch = await measure(matrix_call(wstubs, inputs), runs, pids)
        units = await measure(validate_call(vstub, inputs), runs, pids)
        checks = await measure_checks(vstub, inputs, units.last, runs, pids)
        for ch in worker_channels:
            await ch.close()
    return ServiceRuns(allpass, fullm, batch, units, *checks)


def outcome_summary(response: vf.CheckSolvabilityResponse) -> str:
    counts: dict[str, int] = {}
    for report in response.candidates:
        name = vf.CandidateOutcome.Name(report.outcome).removeprefix("CANDIDATE_OUTCOME_").lower()
        counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{n} {name}" for name, n in counts.items())


async def naive_cases(
    cases: list[tuple[int, int]], configs: list[dict[str, Any]], candidate_files: list[Path], runner: Path
) -> tuple[float, float, list[float | None]]:
    """(wall s, CPU s of the processes, rewards) for `cases`, one fresh process each, WORKERS at a time."""
    limit = asyncio.Semaphore(WORKERS)

    async def one(c: int, t: int) -> float | None:
        async with limit:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                str(runner),
                str(ENV),
                json.dumps(configs[t]),
                str(candidate_files[c]),
                ENV_CLASS,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
            )
            out, _ = await asyncio.wait_for(proc.communicate(), 60)
        return float(out.split()[-1]) if proc.returncode == 0 and out.strip() else None

    cpu0 = rusage_cpu_s(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    rewards = await asyncio.gather(*(one(c, t) for c, t in cases))
    wall = time.perf_counter() - t
    return wall, rusage_cpu_s(resource.RUSAGE_CHILDREN) - cpu0, list(rewards)


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


async def measure_naive(inputs: Inputs, folder: Path, sample_size: int) -> NaiveRun:
    """The naive way: a sample of the same matrix cases, one fresh process each (after one warm-up)."""
    runner = folder / "naive_runner.py"
    runner.write_text(NAIVE_RUNNER)
    candidate_files = []
    for i, candidate in enumerate(inputs.full):
        path = folder / f"candidate_{i}.py"
        path.write_text(candidate)
        candidate_files.append(path)
    sample = sorted(random.Random(0).sample(inputs.matrix, min(sample_size, len(inputs.matrix))))
    await naive_cases(sample[:1], inputs.configs, candidate_files, runner)  # warm-up
    wall, cpu, rewards = await naive_cases(sample, inputs.configs, candidate_files, runner)
    return NaiveRun(sample, wall, cpu, rewards)


Section = tuple[str, dict[str, object]]


def ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


def wall_figures(t: Measured) -> dict[str, object]:
    return {"wall_ms_p50": ms(t.wall), "wall_ms_min_max": f"{ms(min(t.walls))} / {ms(max(t.walls))}"}


def cpu_figures(t: Measured) -> dict[str, object]:
    return {"servers_cpu_ms_per_call": ms(t.servers_cpu_s), "bench_cpu_ms_per_call": ms(t.bench_cpu_s)}


def setup_section(args: argparse.Namespace, load_start: float) -> Section:
    return (
        "setup",
        {
            "environment": f"{ENV_CLASS}: {CANDIDATES} solve() candidates × {TESTS} tests",
            "servers": f"{WORKERS} × `serve sandbox --jails {args.jails}` + `serve verification`",
            "timing": f"wall = median of {args.runs} calls after 1 warm-up; CPU per call",
            "load_average_1m_start_end": f"{load_start:.2f} / {os.getloadavg()[0]:.2f}",
        },
    )


def solvability_figures(t: Measured) -> dict[str, object]:
    r: vf.CheckSolvabilityResponse = t.last
    return {
        **wall_figures(t),
        "verdict": f"{vf.Verdict.Name(r.verdict).removeprefix('VERDICT_')}, oracle {r.oracle_index}",
        "candidates": outcome_summary(r),
        "cases_run": r.cases_run,
        "sandbox_cpu_ms_from_response": r.cpu_ms,
        **cpu_figures(t),
        "ms_per_case": round(ms(t.wall) / max(1, r.cases_run), 2),
    }


def batch_section(batch: Measured, n: int) -> Section:
    results: dict[tuple[int, int], sb.OperationResult] = batch.last
    rewarded = sum(1 for r in results.values() if r.status == sb.STATUS_OK and r.reward == 1.0)
    return (
        f"ExecuteBatch, {n} cases split over {WORKERS} workers (one call each, concurrent)",
        {
            **wall_figures(batch),
            "cases_per_s": round(n / batch.wall, 1),
            "ms_per_case": round(ms(batch.wall) / n, 2),
            "reward_1": f"{rewarded}/{n} (expected {n - CANDIDATES + 1})",
            "source_needed": sum(1 for r in results.values() if r.status == sb.STATUS_SOURCE_NEEDED),
            "sandbox_cpu_ms_from_results": sum(r.usage.cpu_ms for r in results.values()),
            **cpu_figures(batch),
        },
    )


def validate_section(units: Measured) -> Section:
    vu: vf.ValidateUnitTestsResponse = units.last
    return (
        f"ValidateUnitTests, {TESTS} configs",
        {
            **wall_figures(units),
            "verdict": f"{vf.Verdict.Name(vu.verdict).removeprefix('VERDICT_')}, valid {vu.valid}/{TESTS}",
            **cpu_figures(units),
        },
    )


def check_sections(runs: ServiceRuns) -> list[Section]:
    """The checks after solvability, each also as a multiple of CheckSolvability stopping at the oracle."""
    negative, determ5, determ30, guess = runs.negative, runs.determ5, runs.determ30, runs.guess
    checks: list[tuple[str, Measured, dict[str, object]]] = [
        (
            f"CheckNegativeControls, {TESTS} tests",
            negative,
            {
                "wrong_answers": negative.last.controls,
                "kinds": dict(negative.last.kinds),
                "sandbox_runs": negative.last.runs,
                "sandbox_cpu_ms_from_response": negative.last.cpu_ms,
            },
        ),
        (
            "CheckDeterminism, default 5 tests (10 runs)",
            determ5,
            {"sandbox_runs": determ5.last.runs, "sandbox_cpu_ms_from_response": determ5.last.cpu_ms},
        ),
        (
            f"CheckDeterminism, all {TESTS} tests ({2 * TESTS} runs)",
            determ30,
            {"sandbox_runs": determ30.last.runs, "sandbox_cpu_ms_from_response": determ30.last.cpu_ms},
        ),
        (
            f"MeasureGuessability, {TESTS} tests (no sandbox)",
            guess,
            {"guess_rate": round(guess.last.guess_rate, 3)},
        ),
    ]
    allpass = runs.allpass
    return [
        (
            title,
            {
                **wall_figures(t),
                "verdict": vf.Verdict.Name(t.last.verdict).removeprefix("VERDICT_"),
                **extra,
                **cpu_figures(t),
                "wall_vs_solvability_stop_at_oracle": round(t.wall / allpass.wall, 2),
                "servers_cpu_vs_solvability_stop_at_oracle": round(
                    t.servers_cpu_s / max(1e-9, allpass.servers_cpu_s), 2
                ),
            },
        )
        for title, t, extra in checks
    ]


def naive_section(naive: NaiveRun, results: dict[tuple[int, int], sb.OperationResult], n: int) -> Section:
    sampled = len(naive.sample)
    agree = sum(
        1
        for case, reward in zip(naive.sample, naive.rewards, strict=True)
        if reward is not None and results[case].status == sb.STATUS_OK and reward == results[case].reward
    )
    return (
        f"naive: one fresh `python` per case, {WORKERS} at a time; {sampled} of {n} cases timed,"
        f" extrapolated to {n}",
        {
            f"sample_wall_ms_{sampled}_cases": ms(naive.wall),
            "ms_per_case": round(ms(naive.wall_per_case), 2),
            f"wall_ms_{n}_cases_extrapolated": ms(naive.wall_per_case * n),
            f"cpu_ms_{n}_cases_extrapolated": ms(naive.cpu_per_case * n),
            "rewards_agree_with_sandbox": f"{agree}/{sampled}",
        },
    )


def ratio_section(runs: ServiceRuns, naive: NaiveRun, n: int) -> Section:
    allpass, fullm, batch = runs.allpass, runs.fullm, runs.batch
    ap: vf.CheckSolvabilityResponse = allpass.last
    fm: vf.CheckSolvabilityResponse = fullm.last
    return (
        "ratios (naive / verification, same cases; target ≥ 20× faster)",
        {
            f"wall_naive_over_executebatch_{n}": round(naive.wall_per_case * n / batch.wall, 1),
            f"wall_naive_over_checksolvability_full_{fm.cases_run}": round(
                naive.wall_per_case * fm.cases_run / fullm.wall, 1
            ),
            f"wall_naive_over_checksolvability_allpass_{ap.cases_run}": round(
                naive.wall_per_case * ap.cases_run / allpass.wall, 1
            ),
            f"cpu_naive_over_executebatch_{n}_servers_plus_bench": round(
                naive.cpu_per_case * n / (batch.servers_cpu_s + batch.bench_cpu_s), 1
            ),
            f"cpu_naive_over_checksolvability_full_{fm.cases_run}_servers_plus_bench": round(
                naive.cpu_per_case * fm.cases_run / (fullm.servers_cpu_s + fullm.bench_cpu_s), 1
            ),
        },
    )


def report(
    args: argparse.Namespace, inputs: Inputs, runs: ServiceRuns, naive: NaiveRun, load_start: float
) -> list[Section]:
    n = len(inputs.matrix)
    return [
        setup_section(args, load_start),
        (
            "CheckSolvability, all 10 candidates = env's solve() (stops at candidate 0)",
            solvability_figures(runs.allpass),
        ),
        (
            "CheckSolvability, full matrix (candidates 0-8 wrong on the last test only)",
            solvability_figures(runs.fullm),
        ),
        batch_section(runs.batch, n),
        validate_section(runs.units),
        *check_sections(runs),
        naive_section(naive, runs.batch.last, n),
        ratio_section(runs, naive, n),
    ]


async def run(args: argparse.Namespace) -> list[Section]:
    load_start = os.getloadavg()[0]  # other work on the machine skews every figure
    inputs = prepare_inputs()
    procs: list[ServerProcess] = []
    tmp = tempfile.TemporaryDirectory(prefix="verification_bench_", dir="/tmp")
    try:
        worker_addrs, vaddr = start_servers(args.jails, procs)
        runs = await measure_services(inputs, worker_addrs, vaddr, args.runs, [p.pid for p in procs])
        naive = await measure_naive(inputs, Path(tmp.name), args.naive_sample)
    finally:
        stop_servers(procs)
        tmp.cleanup()
    return report(args, inputs, runs, naive, load_start)


def print_sections(sections: list[Section]) -> None:
    width = max(len(k) for _, figures in sections for k in figures)
    for title, figures in sections:
        print(f"== {title}")
        for key, value in figures.items():
            print(f"  {key:<{width}}  {value}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=5, help="timed calls per measurement (after 1 warm-up)")
    parser.add_argument(
        "--jails", type=int, default=1, help="jails per sandbox worker (2 workers are started)"
    )
    parser.add_argument(
        "--naive-sample", type=int, default=40, help="cases timed the naive way (extrapolated to 300)"
    )
    print_sections(asyncio.run(run(parser.parse_args())))


if __name__ == "__main__":
    main()

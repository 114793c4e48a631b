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
from pathlib import Path
from typing import Any

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import rusage_cpu_s, start_process, tree_cpu_s  # noqa: E402
from bench.verification_cases import (  # noqa: E402
    CASE_LIMITS,
    ENV,
    ENV_CLASS,
    MAX_STEPS,
    NAIVE_RUNNER,
    TESTS,
    WORKERS,
    Inputs,
    Measured,
    NaiveRun,
    ServiceRuns,
    prepare_inputs,
)
from bench.verification_report import Section, print_sections, report  # noqa: E402
from codegym.contract.source import method_source  # noqa: E402
from codegym.procs import ServerProcess  # noqa: E402
from codegym.sandbox.v1 import sandbox_service_pb2 as sb  # noqa: E402
from codegym.sandbox.v1 import sandbox_service_pb2_grpc as sb_grpc  # noqa: E402
from codegym.verification.v1 import verification_service_pb2 as vf  # noqa: E402
from codegym.verification.v1 import verification_service_pb2_grpc as vf_grpc  # noqa: E402


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

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
import signal
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

from bench.common import median, start_process  # noqa: E402
from codegym.common.v1 import common_pb2 as cm  # noqa: E402
from codegym.contract import sha256_text  # noqa: E402
from codegym.contract.source import method_source  # noqa: E402
from codegym.sandbox.v1 import sandbox_service_pb2 as sb  # noqa: E402
from codegym.sandbox.v1 import sandbox_service_pb2_grpc as sb_grpc  # noqa: E402
from codegym.verification.v1 import verification_service_pb2 as vf  # noqa: E402
from codegym.verification.v1 import verification_service_pb2_grpc as vf_grpc  # noqa: E402
from tests.helpers.sample_configs import sample_configs  # noqa: E402

ENV = ROOT / "examples" / "envs" / "Sample_0001_I__MaxSubarraySumEnv.py"
ENV_CLASS = "MaxSubarraySumEnv"
WORKERS = 2  # sandbox workers started, and naive processes run at a time (the machine has 2 cores)
CANDIDATES = 10
TESTS = 30
# The limits CheckSolvability uses by default, for the ExecuteBatch matrix.
CASE_LIMITS = sb.Limits(wall_ms=10_000, cpu_ms=10_000, memory_mb=256)
MAX_STEPS = 1_024
CLK_TCK = os.sysconf("SC_CLK_TCK")

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


def tree_cpu_s(root_pids: list[int]) -> float:
    """User + system CPU seconds of processes and all their descendants, reaped children included."""
    children: dict[int, list[int]] = {}
    stats: dict[int, list[str]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            stats[int(entry.name)] = fields
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    ticks = 0
    stack = list(root_pids)
    while stack:
        pid = stack.pop()
        stack.extend(children.get(pid, []))
        fields = stats.get(pid)
        if fields:
            ticks += sum(int(v) for v in fields[11:15])  # utime stime cutime cstime
    return ticks / CLK_TCK


def rusage_cpu_s(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


@dataclass
class Timed:
    walls: list[float]
    last: Any
    servers_cpu_s: float  # per call
    bench_cpu_s: float  # per call

    @property
    def wall(self) -> float:
        return median(self.walls)


async def timed(call: Callable[[], Awaitable[Any]], runs: int, server_pids: list[int]) -> Timed:
    await call()  # warm-up
    servers0, bench0 = tree_cpu_s(server_pids), rusage_cpu_s(resource.RUSAGE_SELF)
    walls = []
    last = None
    for _ in range(runs):
        t = time.perf_counter()
        last = await call()
        walls.append(time.perf_counter() - t)
    servers1, bench1 = tree_cpu_s(server_pids), rusage_cpu_s(resource.RUSAGE_SELF)
    return Timed(walls, last, (servers1 - servers0) / runs, (bench1 - bench0) / runs)


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


async def run(args: argparse.Namespace) -> list[tuple[str, dict[str, object]]]:
    load_start = os.getloadavg()[0]  # other work on the machine skews every figure
    source = ENV.read_text()
    configs = sample_configs(ENV_CLASS, TESTS, seed=0)
    tasks = [cm.TaskConfig(config_json=json.dumps(c)) for c in configs]
    all_pass, full = candidate_sets(source, configs)
    matrix = [(c, t) for c in range(CANDIDATES) for t in range(TESTS)]
    sha = sha256_text(source)

    procs: list[subprocess.Popen[str]] = []
    tmp = tempfile.TemporaryDirectory(prefix="verification_bench_", dir="/tmp")
    try:
        addrs = []
        jails = str(args.jails)
        for _ in range(WORKERS):
            worker, addr = start_process(
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
                    jails,
                ]
            )
            procs.append(worker)
            addrs.append(addr)
        sandbox = ",".join(addrs)
        verification, vaddr = start_process(
            [
                "-m",
                "codegym_cli.cli",
                "serve",
                "verification",
                "--sandbox",
                sandbox,
                "--host",
                "127.0.0.1",
                "--port",
                "0",
            ]
        )
        procs.append(verification)
        pids = [p.pid for p in procs]

        async with grpc.aio.insecure_channel(vaddr) as vch:
            vstub = vf_grpc.VerificationServiceStub(vch)
            worker_channels = [grpc.aio.insecure_channel(a) for a in addrs]
            wstubs = [sb_grpc.SandboxServiceStub(ch) for ch in worker_channels]

            def solvability(candidates: list[str]) -> Callable[[], Awaitable[vf.CheckSolvabilityResponse]]:
                request = vf.CheckSolvabilityRequest(env_source=source, tasks=tasks, solve_sources=candidates)
                return lambda: vstub.CheckSolvability(request, timeout=300)

            def batch_ops(cases: list[tuple[int, int]]) -> list[sb.Operation]:
                ops = [
                    sb.Operation(
                        source=sb.SourceRef(sha256=sha),
                        limits=CASE_LIMITS,
                        solve=sb.SolveOp(
                            config_json=tasks[t].config_json, solve_source=full[c], max_steps=MAX_STEPS
                        ),
                    )
                    for c, t in cases
                ]
                ops[0].source.code = source  # the worker caches it before running the rest
                return ops

            # The matrix split over the workers (alternate cases), one ExecuteBatch each, at once.
            shares = [matrix[w::WORKERS] for w in range(WORKERS)]
            batch_requests = [sb.ExecuteBatchRequest(operations=batch_ops(share)) for share in shares]

            async def execute_matrix() -> dict[tuple[int, int], sb.OperationResult]:
                responses = await asyncio.gather(
                    *(
                        stub.ExecuteBatch(req, timeout=300)
                        for stub, req in zip(wstubs, batch_requests, strict=True)
                    )
                )
                return {
                    case: result
                    for share, response in zip(shares, responses, strict=True)
                    for case, result in zip(share, response.results, strict=True)
                }

            def validate() -> Awaitable[vf.ValidateUnitTestsResponse]:
                return vstub.ValidateUnitTests(
                    vf.ValidateUnitTestsRequest(env_source=source, tasks=tasks), timeout=120
                )

            allpass = await timed(solvability(all_pass), args.runs, pids)
            fullm = await timed(solvability(full), args.runs, pids)
            batch = await timed(execute_matrix, args.runs, pids)
            units = await timed(validate, args.runs, pids)
            cases = [
                vf.ShortcutCase(config_json=t.task.config_json, answer_json=t.answer_json)
                for t in units.last.tests
                if t.valid
            ]
            oracle = method_source(source, "solve")
            config_jsons = [c.config_json for c in cases]

            def controls() -> Awaitable[vf.CheckNegativeControlsResponse]:
                request = vf.CheckNegativeControlsRequest(env_source=source, cases=cases)
                return vstub.CheckNegativeControls(request, timeout=300)

            def determinism(tests: int) -> Callable[[], Awaitable[vf.CheckDeterminismResponse]]:
                request = vf.CheckDeterminismRequest(
                    env_source=source, solve_source=oracle, config_jsons=config_jsons, tests=tests
                )
                return lambda: vstub.CheckDeterminism(request, timeout=300)

            def guessability() -> Awaitable[vf.MeasureGuessabilityResponse]:
                return vstub.MeasureGuessability(vf.MeasureGuessabilityRequest(cases=cases), timeout=60)

            negative = await timed(controls, args.runs, pids)
            determ5 = await timed(determinism(5), args.runs, pids)
            determ30 = await timed(determinism(TESTS), args.runs, pids)
            guess = await timed(guessability, args.runs, pids)
            for ch in worker_channels:
                await ch.close()

        # The naive way: a sample of the same 300 cases, one fresh process each.
        runner = Path(tmp.name) / "naive_runner.py"
        runner.write_text(NAIVE_RUNNER)
        candidate_files = []
        for i, candidate in enumerate(full):
            path = Path(tmp.name) / f"candidate_{i}.py"
            path.write_text(candidate)
            candidate_files.append(path)
        sample = sorted(random.Random(0).sample(matrix, min(args.naive_sample, len(matrix))))
        await naive_cases(sample[:1], configs, candidate_files, runner)  # warm-up
        naive_wall, naive_cpu, naive_rewards = await naive_cases(sample, configs, candidate_files, runner)
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        tmp.cleanup()

    results: dict[tuple[int, int], sb.OperationResult] = batch.last
    needed = sum(1 for r in results.values() if r.status == sb.STATUS_SOURCE_NEEDED)
    batch_rewarded = sum(1 for r in results.values() if r.status == sb.STATUS_OK and r.reward == 1.0)
    agree = sum(
        1
        for case, reward in zip(sample, naive_rewards, strict=True)
        if reward is not None and results[case].status == sb.STATUS_OK and reward == results[case].reward
    )
    n = len(matrix)
    naive_per_case = naive_wall / len(sample)
    naive_all = naive_per_case * n
    naive_cpu_all = naive_cpu / len(sample) * n
    ap: vf.CheckSolvabilityResponse = allpass.last
    fm: vf.CheckSolvabilityResponse = fullm.last
    vu: vf.ValidateUnitTestsResponse = units.last
    batch_cpu = sum(r.usage.cpu_ms for r in results.values())

    def ms(seconds: float) -> float:
        return round(seconds * 1000, 1)

    def solvability_figures(t: Timed, r: vf.CheckSolvabilityResponse) -> dict[str, object]:
        return {
            "wall_ms_p50": ms(t.wall),
            "wall_ms_min_max": f"{ms(min(t.walls))} / {ms(max(t.walls))}",
            "verdict": f"{vf.Verdict.Name(r.verdict).removeprefix('VERDICT_')}, oracle {r.oracle_index}",
            "candidates": outcome_summary(r),
            "cases_run": r.cases_run,
            "sandbox_cpu_ms_from_response": r.cpu_ms,
            "servers_cpu_ms_per_call": ms(t.servers_cpu_s),
            "bench_cpu_ms_per_call": ms(t.bench_cpu_s),
            "ms_per_case": round(ms(t.wall) / max(1, r.cases_run), 2),
        }

    sections: list[tuple[str, dict[str, object]]] = [
        (
            "setup",
            {
                "environment": f"{ENV_CLASS}: {CANDIDATES} solve() candidates × {TESTS} tests",
                "servers": f"{WORKERS} × `serve sandbox --jails {args.jails}` + `serve verification`",
                "timing": f"wall = median of {args.runs} calls after 1 warm-up; CPU per call",
                "load_average_1m_start_end": f"{load_start:.2f} / {os.getloadavg()[0]:.2f}",
            },
        ),
        (
            "CheckSolvability, all 10 candidates = env's solve() (stops at candidate 0)",
            solvability_figures(allpass, ap),
        ),
        (
            "CheckSolvability, full matrix (candidates 0-8 wrong on the last test only)",
            solvability_figures(fullm, fm),
        ),
        (
            f"ExecuteBatch, {n} cases split over {WORKERS} workers (one call each, concurrent)",
            {
                "wall_ms_p50": ms(batch.wall),
                "wall_ms_min_max": f"{ms(min(batch.walls))} / {ms(max(batch.walls))}",
                "cases_per_s": round(n / batch.wall, 1),
                "ms_per_case": round(ms(batch.wall) / n, 2),
                "reward_1": f"{batch_rewarded}/{n} (expected {n - CANDIDATES + 1})",
                "source_needed": needed,
                "sandbox_cpu_ms_from_results": batch_cpu,
                "servers_cpu_ms_per_call": ms(batch.servers_cpu_s),
                "bench_cpu_ms_per_call": ms(batch.bench_cpu_s),
            },
        ),
        (
            f"ValidateUnitTests, {TESTS} configs",
            {
                "wall_ms_p50": ms(units.wall),
                "wall_ms_min_max": f"{ms(min(units.walls))} / {ms(max(units.walls))}",
                "verdict": f"{vf.Verdict.Name(vu.verdict).removeprefix('VERDICT_')}, valid {vu.valid}/{TESTS}",
                "servers_cpu_ms_per_call": ms(units.servers_cpu_s),
                "bench_cpu_ms_per_call": ms(units.bench_cpu_s),
            },
        ),
        *[
            (
                title,
                {
                    "wall_ms_p50": ms(t.wall),
                    "wall_ms_min_max": f"{ms(min(t.walls))} / {ms(max(t.walls))}",
                    "verdict": vf.Verdict.Name(t.last.verdict).removeprefix("VERDICT_"),
                    **extra,
                    "servers_cpu_ms_per_call": ms(t.servers_cpu_s),
                    "bench_cpu_ms_per_call": ms(t.bench_cpu_s),
                    "wall_vs_solvability_stop_at_oracle": round(t.wall / allpass.wall, 2),
                    "servers_cpu_vs_solvability_stop_at_oracle": round(
                        t.servers_cpu_s / max(1e-9, allpass.servers_cpu_s), 2
                    ),
                },
            )
            for title, t, extra in (
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
                    {
                        "sandbox_runs": determ30.last.runs,
                        "sandbox_cpu_ms_from_response": determ30.last.cpu_ms,
                    },
                ),
                (
                    f"MeasureGuessability, {TESTS} tests (no sandbox)",
                    guess,
                    {"guess_rate": round(guess.last.guess_rate, 3)},
                ),
            )
        ],
        (
            f"naive: one fresh `python` per case, {WORKERS} at a time; {len(sample)} of {n} cases timed,"
            f" extrapolated to {n}",
            {
                f"sample_wall_ms_{len(sample)}_cases": ms(naive_wall),
                "ms_per_case": round(ms(naive_per_case), 2),
                f"wall_ms_{n}_cases_extrapolated": ms(naive_all),
                f"cpu_ms_{n}_cases_extrapolated": ms(naive_cpu_all),
                "rewards_agree_with_sandbox": f"{agree}/{len(sample)}",
            },
        ),
        (
            "ratios (naive / verification, same cases; target ≥ 20× faster)",
            {
                f"wall_naive_over_executebatch_{n}": round(naive_all / batch.wall, 1),
                f"wall_naive_over_checksolvability_full_{fm.cases_run}": round(
                    naive_per_case * fm.cases_run / fullm.wall, 1
                ),
                f"wall_naive_over_checksolvability_allpass_{ap.cases_run}": round(
                    naive_per_case * ap.cases_run / allpass.wall, 1
                ),
                f"cpu_naive_over_executebatch_{n}_servers_plus_bench": round(
                    naive_cpu_all / (batch.servers_cpu_s + batch.bench_cpu_s), 1
                ),
                f"cpu_naive_over_checksolvability_full_{fm.cases_run}_servers_plus_bench": round(
                    naive_cpu / len(sample) * fm.cases_run / (fullm.servers_cpu_s + fullm.bench_cpu_s), 1
                ),
            },
        ),
    ]
    return sections


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
    args = parser.parse_args()
    sections = asyncio.run(run(args))
    width = max(len(k) for _, figures in sections for k in figures)
    for title, figures in sections:
        print(f"== {title}")
        for key, value in figures.items():
            print(f"  {key:<{width}}  {value}")


if __name__ == "__main__":
    main()

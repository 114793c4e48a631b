"""Sandbox worker benchmark: step latency and throughput, a verification batch, memory.

Starts one worker (`codegym serve sandbox --jails 2`) and a bare gRPC echo server as separate
processes, and prints every figure beside the echo baseline measured in the same run.

    .venv/bin/python bench/sandbox_bench.py [--steps 600] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import closed_loop, echo_callable, median, pct, start_process, tree_memory_kb  # noqa: E402
from codegym.contract.source import method_source  # noqa: E402
from codegym.sandbox.v1 import sandbox_service_pb2 as pb  # noqa: E402
from codegym.sandbox.v1 import sandbox_service_pb2_grpc as pb_grpc  # noqa: E402

ENV = ROOT / "codegym" / "samples" / "envs" / "Sample_0001_I__MaxSubarraySumEnv.py"
ACTION = '{"name": "GetElement", "parameters": {"index": 2}}'


def solve_candidates(source: str, count: int) -> list[str]:
    """The env's own solve() and near variants (every third one wrong), as a synthesis stage would give."""
    body = method_source(source, "solve")
    out = []
    for i in range(count):
        variant = body if i % 3 else body.replace("best=best", "best=0")
        out.append(f"# candidate {i}\n{variant}\n")
    return out


async def run(args: argparse.Namespace) -> dict[str, object]:
    worker = start_process(["-m", "codegym_cli.cli", "serve", "sandbox", "--port", "0", "--jails", "2"])
    echo = start_process([str(ROOT / "bench" / "common.py")])
    worker_addr, echo_addr = worker.address, echo.address
    source = ENV.read_text()
    try:
        async with grpc.aio.insecure_channel(worker_addr) as wch, grpc.aio.insecure_channel(echo_addr) as ech:
            stub = pb_grpc.SandboxServiceStub(wch)
            echo_call = echo_callable(ech)
            created = await stub.Execute(
                pb.ExecuteRequest(
                    operation=pb.Operation(
                        source=pb.SourceRef(code=source),
                        create=pb.CreateOp(config_json='{"nums": [3, -1, 4, -1, 5]}'),
                    )
                )
            )
            sha = created.result.source_sha256
            step_req = pb.ExecuteRequest(
                operation=pb.Operation(
                    source=pb.SourceRef(sha256=sha), step=pb.StepOp(state=created.result.state, action=ACTION)
                )
            )
            echo_payload = step_req.SerializeToString()

            async def step(_: int) -> None:
                result = (await stub.Execute(step_req, timeout=10)).result
                if result.status != pb.STATUS_OK:
                    raise RuntimeError(result.message)

            async def echo_once(_: int) -> None:
                await echo_call(echo_payload, timeout=10)

            for fn in (step, echo_once):  # warm up
                await closed_loop(fn, 2, 100, 10)
            _, step_lat = await closed_loop(step, 1, args.steps, 30)
            _, echo_lat = await closed_loop(echo_once, 1, args.steps, 30)
            step_rate, step_lat16 = await closed_loop(step, args.concurrency, args.steps * 4, 30)
            echo_rate, _ = await closed_loop(echo_once, args.concurrency, args.steps * 4, 30)

            rng = random.Random(1)
            configs = [json.dumps({"nums": [rng.randint(-20, 20) for _ in range(10)]}) for _ in range(30)]
            ops = [
                pb.Operation(
                    source=pb.SourceRef(sha256=sha), solve=pb.SolveOp(config_json=c, solve_source=cand)
                )
                for cand in solve_candidates(source, 10)
                for c in configs
            ]
            t = time.perf_counter()
            batch = await stub.ExecuteBatch(pb.ExecuteBatchRequest(operations=ops), timeout=120)
            batch_s = time.perf_counter() - t
            solved = sum(1 for r in batch.results if r.status == pb.STATUS_OK and r.reward == 1.0)
            rss_kb, pss_kb = tree_memory_kb(worker.pid)
    finally:
        for server in (worker, echo):
            server.stop()
    return {
        "step_p50_ms": round(median(step_lat) * 1000, 3),
        "step_p99_ms": round(pct(step_lat, 0.99) * 1000, 3),
        "echo_p50_ms": round(median(echo_lat) * 1000, 3),
        "step_p50_over_echo": round(median(step_lat) / median(echo_lat), 2),
        f"steps_per_s_at_{args.concurrency}": round(step_rate, 1),
        f"echo_calls_per_s_at_{args.concurrency}": round(echo_rate, 1),
        f"step_p50_ms_at_{args.concurrency}": round(median(step_lat16) * 1000, 3),
        "batch_10x30_solve_s": round(batch_s, 3),
        "batch_results_reward_1": f"{solved}/{len(ops)}",
        "worker_rss_mb_all_processes": round(rss_kb / 1024, 1),
        "worker_pss_mb_all_processes": round(pss_kb / 1024, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=600, help="sequential calls per latency measurement")
    parser.add_argument("--concurrency", type=int, default=16, help="concurrent callers for throughput")
    args = parser.parse_args()
    figures = asyncio.run(run(args))
    width = max(len(k) for k in figures)
    for key, value in figures.items():
        print(f"{key:<{width}}  {value}")


if __name__ == "__main__":
    main()

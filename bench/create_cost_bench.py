"""Create cost benchmark: what a create costs one jail as sources new to it pass through, a base
commit beside the tree.

A library at CodeGym's published size (13,000 environments, each its own code) sends most creates
an environment its jail has not compiled. The jail's zygote compiles each source once and keeps
it; what it keeps must not make the next fork dearer, or a library's creates slow each other down
as they go. Each tree's `codegym serve sandbox --jails 1` (started from that tree) serves, one at
a time (so what is timed is the jail, never a queue):

  known    creates of the 12 sample environments, compiled long ago
  fresh    creates of a source new to the jail each time: a sample's text plus a comment line
           naming a variant, as a library's variants are (bench/library_scale.py)

in rounds: known, then `--rounds` of fresh, then known again. Each round: the create's p50, the
jail's CPU per create (nsjail, zygote, every child, reaped ones included) and the zygote's
resident memory after it. What to read: whether the last known round costs what the first did.

    .venv/bin/python bench/create_cost_bench.py [--base main | --no-base] [--rounds 12] [--creates 200]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import pct, progress, start_process  # noqa: E402
from bench.stacks import add_tree_options, compared_trees  # noqa: E402
from bench.step_cost_bench import LIMITS, SOURCES, worker_cpu_s  # noqa: E402
from codegym import proctree  # noqa: E402
from codegym.sandbox.v1 import sandbox_service_pb2 as pb  # noqa: E402
from codegym.sandbox.v1 import sandbox_service_pb2_grpc as pb_grpc  # noqa: E402
from codegym_jobs.oracle import read_trajectories  # noqa: E402


def zygote_rss_mib(worker_pid: int) -> float:
    """The zygote: the jail's (nsjail's) child; its spare and residents are its children."""
    links = proctree.children_by_parent()
    for nsjail in links.get(worker_pid, []):
        for zygote in links.get(nsjail, []):
            memory = proctree.memory_kb(zygote)
            if memory:
                return memory.get("Rss", 0) / 1024
    return 0.0


async def one_round(
    stub: pb_grpc.SandboxServiceStub,
    worker_pid: int,
    kind: str,
    lines: list[Any],
    creates: int,
    round_no: int,
) -> dict[str, Any]:
    latencies = []
    _, cpu_before = worker_cpu_s(worker_pid)
    for i in range(creates):
        line = lines[i % len(lines)]
        source = SOURCES[line["env_id"]]
        if kind == "fresh":
            source += f"\n# variant {round_no:03d}-{i:05d}\n"
        key = f"{kind}-{round_no}-{i}"
        op = pb.Operation(
            source=pb.SourceRef(code=source),
            limits=LIMITS,
            seed=i,
            create=pb.CreateOp(config_json=json.dumps(line["config"]), session_key=key),
        )
        started = time.perf_counter()
        answer = await stub.Execute(pb.ExecuteRequest(operation=op), timeout=60)
        latencies.append(time.perf_counter() - started)
        if answer.result.status != pb.STATUS_OK:
            raise RuntimeError(f"create of {line['env_id']} failed: {answer.result.message}")
        release = pb.Operation(release=pb.ReleaseOp(session_key=key))
        await stub.Execute(pb.ExecuteRequest(operation=release), timeout=60)
    return {
        "kind": kind,
        "p50_ms": pct(latencies, 0.5) * 1000,
        "jail_ms": (worker_cpu_s(worker_pid)[1] - cpu_before) * 1000 / creates,
        "zygote_rss_mib": zygote_rss_mib(worker_pid),
    }


async def measure(tree: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    lines = [line for line in read_trajectories(args.trajectories) if line["env_id"] in SOURCES]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    worker = start_process(
        ["-m", "codegym_cli.cli", "serve", "sandbox", "--port", "0", "--jails", "1"], env=env, cwd=tree
    )
    rows = []
    try:
        async with grpc.aio.insecure_channel(worker.address) as channel:
            stub = pb_grpc.SandboxServiceStub(channel)
            kinds = ["known"] + ["fresh"] * args.rounds + ["known"]
            for round_no, kind in enumerate(kinds):
                rows.append(await one_round(stub, worker.pid, kind, lines, args.creates, round_no))
    finally:
        worker.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_tree_options(parser)
    parser.add_argument("--rounds", type=int, default=12, help="rounds of creates of new sources")
    parser.add_argument("--creates", type=int, default=200, help="creates per round")
    parser.add_argument(
        "--trajectories", type=Path, default=ROOT / "codegym" / "samples" / "trajectories.jsonl"
    )
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args()
    results: dict[str, list[dict[str, Any]]] = {}
    with contextlib.ExitStack() as cleanup:
        for name, tree in compared_trees(args, cleanup).items():
            progress(f"{name}: {args.rounds} rounds of {args.creates} new sources between two known rounds")
            results[name] = asyncio.run(measure(tree, args))
    width = max(len("stack"), *(len(name) for name in results))
    print(
        f"{'stack':{width}} {'round':>5} {'kind':6} {'create p50 ms':>13} {'jail CPU ms':>11} {'zygote RSS MiB':>14}"
    )
    for name, rows in results.items():
        for index, row in enumerate(rows):
            print(
                f"{name:{width}} {index:5d} {row['kind']:6} {row['p50_ms']:13.1f} {row['jail_ms']:11.2f} "
                f"{row['zygote_rss_mib']:14.0f}"
            )
    for name, rows in results.items():
        first, last = rows[0], rows[-1]
        print(
            f"{name}: a known create's jail CPU {first['jail_ms']:.2f} -> {last['jail_ms']:.2f} ms "
            f"({last['jail_ms'] / first['jail_ms']:.2f}x) after {args.rounds * args.creates} new sources"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

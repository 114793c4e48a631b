"""The OpenEnv gateway's cost: steps/s and p50/p99 per step at 1 and 32 concurrent clients, through
the gateway (a WebSocket per client, OpenEnv messages) beside direct gRPC to the same runtime, in the
same run, interleaved per level.

Starts a sandbox worker, a runtime on a library built from the sample environments, and
`codegym serve openenv`, all on loopback; every client replays recorded oracle episodes
(codegym/samples/trajectories.jsonl): open a session, step through the episode, close it. Only steps are
timed. Usage:

    .venv/bin/python -m bench.openenv_bench [--clients 1 32] [--seconds 10] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import median, pct, start_process
from codegym.library.store import Library
from codegym.procs import ServerProcess
from codegym_client.abilities import make_ability
from codegym_client.async_client import AsyncRuntimeClient
from codegym_jobs.oracle import read_trajectories

ROOT = Path(__file__).resolve().parent.parent


def episodes() -> list[tuple[str, list[dict[str, Any]]]]:
    out = []
    for t in read_trajectories(ROOT / "codegym" / "samples" / "trajectories.jsonl"):
        ability = make_ability(t["env_id"], t["config"])
        out.append((ability, [json.loads(action) for action, _ in t["steps"]]))
    return out


async def direct(runtime: str, clients: int, seconds: float) -> list[float]:
    plays = episodes()
    times: list[float] = []
    deadline = time.monotonic() + seconds
    async with AsyncRuntimeClient(runtime, timeout_s=60) as client:

        async def one(offset: int) -> None:
            i = offset
            while time.monotonic() < deadline:
                ability, actions = plays[i % len(plays)]
                i += clients
                created = await client.create_session(ability=ability)
                for action in actions:
                    start = time.perf_counter()
                    await client.step(created.session_id, action)
                    times.append(time.perf_counter() - start)
                await client.close_session(created.session_id)

        await asyncio.gather(*(one(k) for k in range(clients)))
    return times


async def gateway(url: str, clients: int, seconds: float) -> list[float]:
    from websockets.asyncio.client import connect

    plays = episodes()
    times: list[float] = []
    deadline = time.monotonic() + seconds

    async def one(offset: int) -> None:
        i = offset
        async with connect(url, max_size=None) as ws:
            while time.monotonic() < deadline:
                ability, actions = plays[i % len(plays)]
                i += clients
                await ws.send(json.dumps({"type": "reset", "data": {"ability": ability}}))
                assert json.loads(await ws.recv())["type"] == "observation"
                for action in actions:
                    message = json.dumps(
                        {
                            "type": "step",
                            "data": {
                                "type": "call_tool",
                                "tool_name": action["name"],
                                "arguments": action["parameters"],
                            },
                        }
                    )
                    start = time.perf_counter()
                    await ws.send(message)
                    answer = await ws.recv()
                    times.append(time.perf_counter() - start)
                    assert str(answer).startswith('{"type": "observation"'), str(answer)[:200]
            await ws.send(json.dumps({"type": "close"}))

    await asyncio.gather(*(one(k) for k in range(clients)))
    return times


def row(name: str, clients: int, times: list[float], seconds: float) -> dict[str, Any]:
    return {
        "path": name,
        "clients": clients,
        "steps": len(times),
        "steps_per_s": round(len(times) / seconds, 1),
        "p50_ms": round(pct(times, 0.5) * 1000, 3),
        "p99_ms": round(pct(times, 0.99) * 1000, 3),
    }


async def run(args: argparse.Namespace) -> None:
    folder = Path(tempfile.mkdtemp(prefix="openenv-bench-"))
    library = folder / "library.db"
    with Library(library) as lib:
        lib.import_paths(
            [ROOT / "codegym" / "samples" / "envs", ROOT / "codegym" / "samples" / "tasks.jsonl"]
        )
    servers: list[ServerProcess] = []

    def start(*argv: str) -> ServerProcess:
        server = start_process(
            ["-m", "codegym_cli.cli", *argv], name=" ".join(argv[:2]), stderr=subprocess.STDOUT
        )
        servers.append(server)
        return server

    try:
        worker = start("serve", "sandbox", "--port", "0", "--jails", str(args.jails))
        runtime = start(
            "serve", "runtime", "--port", "0", "--library", str(library), "--sandbox", worker.address
        )
        gw = start("serve", "openenv", "--runtime", runtime.address, "--port", "0", "--log-level", "WARNING")
        url = f"ws://{gw.address}/ws"
        await direct(runtime.address, 4, 2.0)  # warm up: jails, channels
        await gateway(url, 4, 2.0)
        results: dict[tuple[str, int], list[dict[str, Any]]] = {}
        for _ in range(args.rounds):
            for clients in args.clients:
                for name in ("direct gRPC", "OpenEnv gateway"):
                    started = time.monotonic()
                    if name == "direct gRPC":
                        times = await direct(runtime.address, clients, args.seconds)
                    else:
                        times = await gateway(url, clients, args.seconds)
                    took = time.monotonic() - started
                    results.setdefault((name, clients), []).append(row(name, clients, times, took))
        print(f"{'path':<18}{'clients':>8}{'steps/s':>10}{'p50 ms':>9}{'p99 ms':>9}   (median of rounds)")
        summary: list[dict[str, Any]] = []
        for (name, clients), rounds in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            entry = {
                "path": name,
                "clients": clients,
                "steps_per_s": median([r["steps_per_s"] for r in rounds]),
                "p50_ms": median([r["p50_ms"] for r in rounds]),
                "p99_ms": median([r["p99_ms"] for r in rounds]),
            }
            summary.append(entry)
            print(
                f"{name:<18}{clients:>8}{entry['steps_per_s']:>10.0f}{entry['p50_ms']:>9.3f}{entry['p99_ms']:>9.3f}"
            )
        for clients in args.clients:
            d = next(e for e in summary if e["path"] == "direct gRPC" and e["clients"] == clients)
            g = next(e for e in summary if e["path"] == "OpenEnv gateway" and e["clients"] == clients)
            print(
                f"{clients} client(s): gateway adds {g['p50_ms'] - d['p50_ms']:+.3f} ms p50, "
                f"throughput {g['steps_per_s'] / d['steps_per_s']:.2f}x of direct"
            )
        if args.json:
            print(json.dumps(summary))
    finally:
        for server in reversed(servers):
            server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--seconds", type=float, default=10.0, help="time per path and level, each round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--jails", type=int, default=4)
    parser.add_argument("--json", action="store_true", help="also print the summary as JSON")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()

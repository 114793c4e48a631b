"""SearchEnvs at the published library's size: what a search page costs the runtime.

Builds (or reuses) a library of N variant environments in the published layout (bench/library_data.py,
22,366 envs and ~80,000 tasks by default), imported as `codegym library import` does (which writes
the search index), then times SearchEnvs pages of several shapes: on the runtime's catalog in this
process (the server's time: the indexed queries and the answer's message), and through a real
runtime's gRPC port (the round trip). Prints medians and p99 per shape, and the index's build time.

    .venv/bin/python bench/search_bench.py [--envs 22366] [--folder /tmp/codegym-search-bench] [--runs 200]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.library_data import TRAJECTORIES, Variants, generate, load_samples  # noqa: E402
from codegym.library import search  # noqa: E402
from codegym.library.store import Library  # noqa: E402
from codegym_client.api.runtime.v1 import runtime_service_pb2 as rt  # noqa: E402

SHAPES: dict[str, dict[str, object]] = {
    "first page, no filter": {},
    "text (trigram)": {"text": "subarray"},
    "text, rare": {"text": "v01234"},
    "text, 2 letters": {"text": "ar"},
    "source": {"source": "Sample_0001_I_v00000"},
    "learnability": {"learnability": ["unlabelled"]},
    "pass rate 0.4..0.6": {"min_pass_rate": 0.4, "max_pass_rate": 0.6},
    "all filters": {
        "text": "Env",
        "learnability": ["unlabelled"],
        "min_pass_rate": 0.2,
        "max_pass_rate": 0.8,
    },
}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def build(folder: Path, envs: int) -> Path:
    library = folder / "library.db"
    if library.exists():
        print(f"library {library}: reused", file=sys.stderr)
        return library
    dataset, _ = generate(Variants(load_samples(TRAJECTORIES), envs), folder)
    started = time.monotonic()
    with Library(library) as lib:
        lib.import_paths([dataset])
    print(f"imported in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return library


def time_catalog(library: Path, runs: int) -> dict[str, dict[str, float]]:
    from services.runtime.catalog import Catalog

    catalog = Catalog(library)
    out = {}
    for name, filters in SHAPES.items():
        times, total = [], 0
        token = ""
        for i in range(runs):
            started = time.perf_counter()
            page = catalog.search(rt.SearchEnvsRequest(page_size=50, page_token=token, **filters))  # type: ignore[arg-type]
            times.append((time.perf_counter() - started) * 1000)
            total = page.total
            token = page.next_page_token if i % 10 else ""  # walk a few pages deep, then start over
        out[name] = {
            "median_ms": statistics.median(times),
            "p99_ms": percentile(times, 0.99),
            "matches": total,
        }
    catalog.close()
    return out


async def time_rpc(library: Path, runs: int) -> dict[str, dict[str, float]]:
    import grpc

    from codegym_client.api.runtime.v1 import runtime_service_pb2_grpc as rt_grpc
    from services.runtime.config import RuntimeConfig
    from services.runtime.server import RuntimeServer
    from services.runtime.settings import RuntimeSettings

    # No episode is played: the sandbox address is never dialled by a search.
    settings = RuntimeSettings(
        library=str(library), sandbox="127.0.0.1:9", port=0, config=RuntimeConfig(no_capture=True)
    )
    server = RuntimeServer(settings)
    await server.start()
    out = {}
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = rt_grpc.RuntimeServiceStub(channel)
            for name, filters in SHAPES.items():
                times = []
                for _ in range(runs):
                    started = time.perf_counter()
                    await stub.SearchEnvs(rt.SearchEnvsRequest(page_size=50, **filters), timeout=30)  # type: ignore[arg-type]
                    times.append((time.perf_counter() - started) * 1000)
                out[name] = {"median_ms": statistics.median(times), "p99_ms": percentile(times, 0.99)}
    finally:
        await server.stop(0)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--envs", type=int, default=22_366)
    parser.add_argument("--folder", type=Path, default=Path("/tmp/codegym-search-bench"))
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    args.folder.mkdir(parents=True, exist_ok=True)
    library = build(args.folder, args.envs)
    with Library(library) as lib:
        envs, tasks = lib.counts()
        started = time.monotonic()
        with lib.db:
            search.refresh(lib.db)
        rebuild_s = time.monotonic() - started
    print(f"library: {envs:,} envs, {tasks:,} tasks; search index rebuilt in {rebuild_s:.1f} s")
    catalog = time_catalog(library, args.runs)
    rpc = asyncio.run(time_rpc(library, args.runs))
    print(
        f"{'shape':28} {'matches':>8} {'server med':>11} {'server p99':>11} {'rpc med':>9} {'rpc p99':>9}  (ms)"
    )
    for name in SHAPES:
        c, r = catalog[name], rpc[name]
        print(
            f"{name:28} {int(c['matches']):>8,} {c['median_ms']:>11.2f} {c['p99_ms']:>11.2f}"
            f" {r['median_ms']:>9.2f} {r['p99_ms']:>9.2f}"
        )
    if args.json:
        args.json.write_text(
            json.dumps({"envs": envs, "tasks": tasks, "rebuild_s": rebuild_s, "server": catalog, "rpc": rpc})
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

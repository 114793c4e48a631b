"""`codegym serve sandbox`: the sandbox worker, which runs untrusted environment code in nsjail
jails."""

from __future__ import annotations

import argparse
import os

from codegym.inside.settings import JailSettings
from codegym_cli.serve_setup import configure_access, configure_logs, run_server, start_metrics
from sandbox_worker.limits import DEFAULT_LIMITS, MAX_LIMITS, JailLimits, RequestLimits, unreachable_by_jails


def _serve_sandbox(args: argparse.Namespace) -> int:
    unreachable = unreachable_by_jails()  # said in one line, not as nsjail's failed mount
    if unreachable:
        raise SystemExit(f"codegym serve sandbox: {unreachable}")
    configure_access(args)
    start_metrics(args)
    from codegym.server.serving import serve
    from sandbox_worker.server import SandboxWorker

    configure_logs(args.log_level, args.log_format)

    async def main() -> None:
        # grpc.aio objects bind to the running loop: build the worker inside it.
        worker = SandboxWorker(
            host=args.host,
            port=args.port,
            jails=args.jails,
            jail_limits=JailLimits(memory_mb=args.jail_memory_mb, pids=args.jail_pids, nice=args.jail_nice),
            defaults=RequestLimits(args.wall_ms, args.cpu_ms, args.memory_mb, args.output_bytes),
            maximum=MAX_LIMITS,
            max_pending=args.max_pending,
            resident_memory_mb=args.resident_memory_mb,
            resident_cap=args.resident_cap,
            resident_idle_s=args.resident_idle_s,
            admit_idle_s=args.admit_idle_s,
            resident_sample_s=args.resident_sample_s,
            code_cache_mb=args.code_cache_mb,
            source_cache_mb=args.source_cache_mb,
        )
        await serve(worker)

    run_server(main)
    return 0


def add_jail_nice(parser: argparse.ArgumentParser) -> None:
    """`--jail-nice`, on `serve sandbox` and on `up` (which passes it to its workers)."""
    parser.add_argument(
        "--jail-nice",
        type=int,
        choices=range(0, 20),
        default=JailLimits.nice,
        metavar="0..19",
        help="how much nicer than the worker its jails run (0: an even share of the CPU; 19: only "
        "what the trusted processes leave, and every step waits for them under load)",
    )


def add_parser(servers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """The worker's options: its pool of jails and the per-request limits."""
    sandbox = servers.add_parser(
        "sandbox",
        help="sandbox worker: runs untrusted environment code in nsjail jails",
        description="Stateless gRPC executor of untrusted environment code. Limits below are per request "
        f"defaults; a request may ask for more up to wall {MAX_LIMITS.wall_ms} ms, CPU {MAX_LIMITS.cpu_ms} ms, "
        f"memory {MAX_LIMITS.memory_mb} MiB, output {MAX_LIMITS.output_bytes} bytes.",
    )
    sandbox.add_argument("--host", default="127.0.0.1", help="address to bind")
    sandbox.add_argument("--port", type=int, default=50061, help="port (0 = any free port)")
    sandbox.add_argument(
        "--jails", type=int, default=os.cpu_count() or 2, help="long-lived jails in the pool"
    )
    sandbox.add_argument(
        "--wall-ms", type=int, default=DEFAULT_LIMITS.wall_ms, help="wall-clock limit per request"
    )
    sandbox.add_argument("--cpu-ms", type=int, default=DEFAULT_LIMITS.cpu_ms, help="CPU limit per request")
    sandbox.add_argument(
        "--memory-mb",
        type=int,
        default=DEFAULT_LIMITS.memory_mb,
        help="memory a request may add to the pre-loaded interpreter (RLIMIT_AS)",
    )
    sandbox.add_argument(
        "--output-bytes",
        type=int,
        default=DEFAULT_LIMITS.output_bytes,
        help="cap on captured stdout and stderr, each",
    )
    sandbox.add_argument(
        "--jail-memory-mb",
        type=int,
        default=JailLimits.memory_mb,
        help="cgroup memory limit of a whole jail (zygote + request)",
    )
    sandbox.add_argument(
        "--jail-pids",
        type=int,
        default=JailLimits.pids,
        help="process limit of a whole jail (cgroup pids and RLIMIT_NPROC)",
    )
    add_jail_nice(sandbox)
    sandbox.add_argument(
        "--max-pending",
        type=int,
        default=0,
        help="operations queued or running before RESOURCE_EXHAUSTED (0 = 256 per jail)",
    )
    sandbox.add_argument(
        "--resident-memory-mb",
        type=int,
        default=0,
        help="memory this worker spends on resident sessions (live envs kept between steps), shared by "
        "its jails; each jail holds its share divided by what a resident is measured to cost. Set it "
        "from the pod's memory limit; 0 = half the memory this worker may use (its cgroup limit, else "
        "the machine's)",
    )
    sandbox.add_argument(
        "--resident-cap",
        type=int,
        default=0,
        help="most resident sessions per jail (0 = 1,024, the jail's ceiling; the memory budget may hold fewer)",
    )
    sandbox.add_argument(
        "--resident-idle-s",
        type=float,
        default=JailSettings.resident_idle_s,
        help="idle time after which a resident session is evicted",
    )
    sandbox.add_argument(
        "--resident-sample-s",
        type=float,
        default=5.0,
        help="how often the memory of a resident session is measured again (until then it is taken as 3 MiB)",
    )
    sandbox.add_argument(
        "--source-cache-mb",
        type=int,
        default=64,
        help="environment sources this worker keeps (callers send a cached source by its sha256 alone)",
    )
    sandbox.add_argument(
        "--code-cache-mb",
        type=int,
        default=32,
        help="compiled environment code each jail keeps (a source new to a jail costs a compile)",
    )
    sandbox.add_argument(
        "--admit-idle-s",
        type=float,
        default=JailSettings.admit_idle_s,
        help="when a jail is full, a resident idle this long gives its place to a newcomer (which "
        "otherwise runs cold, one-shot); longer than an agent's turn, so playing episodes stay warm",
    )
    sandbox.add_argument("--log-level", default="INFO", help="logging level")
    sandbox.set_defaults(func=_serve_sandbox)
    return sandbox

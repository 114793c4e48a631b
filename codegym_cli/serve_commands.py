"""`codegym serve ...`: run one server in the foreground."""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from codegym.inside.settings import JailSettings
from sandbox_worker.limits import DEFAULT_LIMITS, MAX_LIMITS, JailLimits, RequestLimits, unreachable_by_jails

if TYPE_CHECKING:
    from services.runtime.episode_record import RecordStore


def run_server(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run a server's main coroutine on uvloop where installed (about a tenth less CPU per step
    for the runtime and the workers in bench/runtime_bench.py), else on asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main())
        return
    uvloop.run(main())


def configure_logs(level: str, fmt: str) -> None:
    from codegym.logs import configure

    configure(level, fmt)


def configure_access(args: argparse.Namespace) -> None:
    """The server's access settings (`--tokens`, `--token`, `--tls-cert`/`--tls-key`, `--insecure`,
    `--health-port`) for every server this process builds; refuses a non-loopback bind without
    tokens here, before anything starts."""
    from codegym.auth import ServerAuth, check_bind, configure

    try:
        auth = ServerAuth.from_settings(
            token=args.token,
            tokens_file=args.tokens,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            insecure=args.insecure,
            health_port=args.health_port,
        )
    except ValueError as exc:
        raise SystemExit(f"codegym serve: {exc}") from None
    check_bind(args.host, auth)
    configure(auth)


def add_access_arguments(parser: argparse.ArgumentParser) -> None:
    from codegym_cli.access import add_client_arguments

    add_client_arguments(parser)
    parser.add_argument(
        "--tokens",
        default=None,
        help='access tokens this server takes: a JSON file {"tokens": {TOKEN: {"tenant": NAME, "role": '
        "trainer|operator|service}}} ($CODEGYM_TOKENS_FILE when not given); --token adds one operator token. "
        "Without either, every caller is served",
    )
    parser.add_argument(
        "--tls-cert", default="", help="serve TLS with this certificate (PEM; with --tls-key)"
    )
    parser.add_argument("--tls-key", default="", help="the TLS certificate's private key (PEM)")
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="bind an address other than loopback without access tokens (refused otherwise)",
    )
    parser.add_argument(
        "--health-port",
        type=int,
        default=-1,
        help="also serve grpc.health.v1 alone, in plain text, on this port (Kubernetes probes cannot "
        "speak TLS; -1 = off)",
    )


def start_metrics(args: argparse.Namespace) -> None:
    """`--metrics-port`: Prometheus /metrics on the server's host (-1: off, 0: any free port)."""
    if args.metrics_port < 0:
        return
    from codegym.metrics import serve_metrics

    port = serve_metrics(args.metrics_port, args.host)
    print(f"metrics on {args.host}:{port}", flush=True)


def _serve_sandbox(args: argparse.Namespace) -> int:
    unreachable = unreachable_by_jails()  # said in one line, not as nsjail's failed mount
    if unreachable:
        raise SystemExit(f"codegym serve sandbox: {unreachable}")
    configure_access(args)
    start_metrics(args)
    from codegym.serving import serve
    from sandbox_worker.server import SandboxWorker

    configure_logs(args.log_level, args.log_format)

    async def main() -> None:
        # grpc.aio objects bind to the running loop: build the worker inside it.
        worker = SandboxWorker(
            host=args.host,
            port=args.port,
            jails=args.jails,
            jail_limits=JailLimits(memory_mb=args.jail_memory_mb, pids=args.jail_pids),
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


def record_store(args: argparse.Namespace) -> RecordStore | None:
    """Where the runtime keeps its episode record: `--record` as given; by default in Redis when the
    sessions are there (every replica writes one record), else in a file beside the library."""
    import sqlite3

    from services.runtime.record_store import RedisRecordStore, SqliteRecordStore, record_path_for

    place = "off" if args.no_record else args.record
    if place == "off":
        return None
    if place == "auto":
        place = args.sessions if args.sessions.startswith(("redis://", "rediss://", "unix://")) else ""
        place = place or str(record_path_for(args.library))
    if place.startswith(("redis://", "rediss://", "unix://")):
        return RedisRecordStore(place)
    try:
        return SqliteRecordStore(place)
    except (sqlite3.Error, OSError) as exc:
        raise SystemExit(
            f"codegym serve runtime: cannot keep the episode record in {place} ({exc}): give --record FILE "
            "(somewhere writable) or --no-record"
        ) from None


def _serve_runtime(args: argparse.Namespace) -> int:
    configure_access(args)
    start_metrics(args)
    from codegym.serving import serve
    from services.runtime.server import RuntimeServer
    from services.runtime.service import RuntimeConfig

    configure_logs(args.log_level, args.log_format)
    config = RuntimeConfig(
        max_sessions=args.max_sessions,
        session_ttl_s=args.session_ttl_s,
        default_max_steps=args.max_steps,
        step_timeout_ms=args.step_timeout_ms,
        max_steps_in_flight=args.max_steps_in_flight,
    )

    async def main() -> None:
        store = None
        if args.sessions:
            from services.runtime.redis_store import RedisSessionStore

            store = RedisSessionStore(args.sessions, args.session_ttl_s, lease_s=args.step_lease_s)
        server = RuntimeServer(
            args.library,
            args.sandbox,
            host=args.host,
            port=args.port,
            config=config,
            store=store,
            env_cache_mb=args.env_cache_mb,
            record=record_store(args),
        )
        await serve(server)

    run_server(main)
    return 0


def _serve_synthesis(args: argparse.Namespace) -> int:
    configure_access(args)
    start_metrics(args)
    from pathlib import Path

    from codegym.serving import serve
    from codegym_cli.synthesize_command import settings_from, stage_defaults
    from services.synthesis.service import SynthesisServer

    configure_logs(args.log_level, args.log_format)
    defaults = stage_defaults(args.stage)

    async def main() -> None:
        out = Path(args.out)
        server = SynthesisServer(
            settings_from(args),
            out,
            cache_path=Path(args.cache) if args.cache else None,
            defaults=defaults,
            host=args.host,
            port=args.port,
        )
        await serve(server)

    run_server(main)
    return 0


def _serve_verification(args: argparse.Namespace) -> int:
    configure_access(args)
    start_metrics(args)
    from codegym.serving import serve
    from services.verification.service import VerificationServer

    configure_logs(args.log_level, args.log_format)

    async def main() -> None:
        server = VerificationServer(args.sandbox, host=args.host, port=args.port)
        await serve(server)

    run_server(main)
    return 0


def _serve_openenv(args: argparse.Namespace) -> int:
    from codegym.auth import ServerAuth, check_bind

    try:  # the gRPC servers' tokens (--tokens, --token); the runtime is called with --token
        auth = ServerAuth.from_settings(token=args.token, tokens_file=args.tokens, insecure=args.insecure)
    except ValueError as exc:
        raise SystemExit(f"codegym serve: {exc}") from None
    check_bind(args.host, auth)
    start_metrics(args)
    from services.openenv.gateway import GatewayConfig
    from services.openenv.server import serve

    configure_logs(args.log_level, args.log_format)
    config = GatewayConfig(
        runtime=args.runtime,
        max_sessions=args.max_sessions,
        idle_timeout_s=args.idle_timeout_s,
        ping_interval_s=args.ping_interval_s if args.ping_interval_s > 0 else None,
        ping_timeout_s=args.ping_timeout_s if args.ping_timeout_s > 0 else None,
        max_message_bytes=args.max_message_bytes,
        env=args.env,
        grace_s=args.grace_s,
        tokens=auth.tokens,
    )
    run_server(lambda: serve(config, args.host, args.port))
    return 0


def add_sandbox_target(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--sandbox",
        required=True,
        help="sandbox workers: HOST:PORT[,HOST:PORT...] (IP literals) or one dns:///NAME:PORT",
    )


def register(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="run a server in the foreground")
    serve_sub = serve.add_subparsers(dest="serve_command", required=True, metavar="SERVER")
    sandbox = serve_sub.add_parser(
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
        help="most resident sessions per jail whatever the budget (0 = what the budget holds)",
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

    from codegym.library import default_library_path
    from services.runtime.service import RuntimeConfig

    defaults = RuntimeConfig()
    runtime = serve_sub.add_parser(
        "runtime",
        help="runtime: environment sessions for RL trainers over sandbox workers",
    )
    runtime.add_argument(
        "--library", default=str(default_library_path()), help="environment library (SQLite)"
    )
    add_sandbox_target(runtime)
    runtime.add_argument("--host", default="127.0.0.1", help="address to bind")
    runtime.add_argument("--port", type=int, default=50051, help="port (0 = any free port)")
    runtime.add_argument(
        "--max-sessions", type=int, default=defaults.max_sessions, help="open sessions at most"
    )
    runtime.add_argument(
        "--session-ttl-s",
        type=float,
        default=defaults.session_ttl_s,
        help="idle time before a session expires",
    )
    runtime.add_argument("--max-steps", type=int, default=defaults.default_max_steps, help="default step cap")
    runtime.add_argument(
        "--env-cache-mb",
        type=int,
        default=32,
        help="memory for the records of the environments in play (the library is read on demand)",
    )
    runtime.add_argument(
        "--max-steps-in-flight",
        type=int,
        default=defaults.max_steps_in_flight,
        help="steps running or waiting for a worker at once; past it a step is refused with CAPACITY "
        "and a retry-after hint instead of queueing behind work it would time out on",
    )
    runtime.add_argument(
        "--step-timeout-ms", type=int, default=defaults.step_timeout_ms, help="default deadline of one step"
    )
    runtime.add_argument("--log-level", default="INFO", help="logging level")
    runtime.add_argument(
        "--sessions",
        default="",
        help="session store: empty keeps sessions in this process; redis://HOST:PORT/N shares them between replicas",
    )
    runtime.add_argument(
        "--step-lease-s",
        type=float,
        default=5.0,
        help="with Redis: how long a dead replica's step can block its session (a live replica renews "
        "the lease every third of it while its step runs, however long the step)",
    )
    runtime.add_argument(
        "--record",
        default="auto",
        help="where the record of served episodes is kept (Stats, SampleTasks): auto (Redis when "
        "--sessions is, else LIBRARY.record.sqlite beside the library), a file, redis://..., or off",
    )
    runtime.add_argument(
        "--no-record", action="store_true", help="keep no record of served episodes (--record off)"
    )
    runtime.set_defaults(func=_serve_runtime)

    from codegym_cli.synthesize_command import add_llm_arguments

    synthesis = serve_sub.add_parser(
        "synthesis",
        help="synthesis: environments, unit tests and solve() candidates from an LLM",
    )
    synthesis.add_argument("--host", default="127.0.0.1", help="address to bind")
    synthesis.add_argument("--port", type=int, default=50071, help="port (0 = any free port)")
    synthesis.add_argument(
        "--out", default="synthesis-out", help="folder for SynthesizeStream runs and the cache"
    )
    synthesis.add_argument("--cache", default="", help="response cache (default OUT/llm_cache.db)")
    add_llm_arguments(synthesis)
    synthesis.add_argument("--log-level", default="INFO", help="logging level")
    synthesis.set_defaults(func=_serve_synthesis)

    verification = serve_sub.add_parser(
        "verification",
        help="verification: checks generated environments, unit tests and solve() candidates in sandboxes",
        description="Runs every piece of generated code in the sandbox workers given with --sandbox "
        "(CheckEnvironment, ValidateUnitTests, CheckSolvability, CheckShortcuts); thresholds are request "
        "fields. Example: codegym serve verification --sandbox 127.0.0.1:50061,127.0.0.1:50062",
    )
    add_sandbox_target(verification)
    verification.add_argument("--host", default="127.0.0.1", help="address to bind")
    verification.add_argument("--port", type=int, default=50081, help="port (0 = any free port)")
    verification.add_argument("--log-level", default="INFO", help="logging level")
    verification.set_defaults(func=_serve_verification)

    openenv = serve_sub.add_parser(
        "openenv",
        help="OpenEnv gateway: OpenEnv's WebSocket protocol (TRL, verifiers, SkyRL) in front of a runtime",
        description="Stateless gateway: each WebSocket (/ws) holds at most one runtime session, closed "
        "with the socket, on a second reset, or after --idle-timeout-s without a message. Example: "
        "codegym serve openenv --runtime 127.0.0.1:50051 --port 8000",
    )
    openenv.add_argument(
        "--runtime",
        required=True,
        help="runtime address HOST:PORT, several comma-separated (replicas sharing sessions in Redis), "
        "or a dns:/// name: the gateway balances over them and skips one that is down",
    )
    openenv.add_argument("--host", default="127.0.0.1", help="address to bind")
    openenv.add_argument("--port", type=int, default=8000, help="port (0 = any free port)")
    openenv.add_argument(
        "--max-sessions",
        type=int,
        default=0,
        help="sessions this gateway holds at once, then CAPACITY_REACHED (0 = no cap of its own: the "
        "runtime's session cap, its --max-sessions, is the limit; a session being closed never counts)",
    )
    openenv.add_argument(
        "--idle-timeout-s",
        type=float,
        default=900.0,
        help="close a socket and its session after this long without a message (0 = never)",
    )
    openenv.add_argument(
        "--ping-interval-s", type=float, default=30.0, help="WebSocket keep-alive ping interval (0 = off)"
    )
    openenv.add_argument(
        "--ping-timeout-s",
        type=float,
        default=120.0,
        help="close a socket whose pong is this late (0 = never); long generations keep answering pings",
    )
    openenv.add_argument(
        "--max-message-bytes",
        type=int,
        default=1 << 20,
        help="larger messages get a VALIDATION_ERROR (frames over 16 MiB close the socket)",
    )
    openenv.add_argument(
        "--env",
        default="",
        help="serve one environment (ENV_ID), as an OpenEnv server does: its tools are listed before any "
        "reset, and a reset naming no task plays its task config number seed %% count (verifiers' "
        "OpenEnvEnv); resets may still name any environment",
    )
    openenv.add_argument(
        "--grace-s",
        type=float,
        default=30.0,
        help="on SIGTERM (a rolling update): refuse new sockets and episodes (/health answers 503), "
        "let open episodes step to their end for this long, then close the rest and exit",
    )
    openenv.add_argument("--log-level", default="INFO", help="logging level")
    openenv.add_argument(
        "--tokens",
        default=None,
        help="access tokens this gateway takes as `Authorization: Bearer TOKEN` (a trainer's or an "
        "operator's), the gRPC servers' file ($CODEGYM_TOKENS_FILE when not given); --token adds one "
        "operator token and is what the gateway sends the runtime. Without either, every caller is served",
    )
    openenv.add_argument(
        "--insecure",
        action="store_true",
        help="bind an address other than loopback without access tokens (refused otherwise)",
    )
    openenv.set_defaults(func=_serve_openenv)
    for server in (sandbox, runtime, synthesis, verification):
        add_access_arguments(server)
    for server in (sandbox, runtime, synthesis, verification, openenv):
        server.add_argument(
            "--log-format",
            choices=("text", "json"),
            default="text",
            help="log lines for people or one JSON object each",
        )
        server.add_argument(
            "--metrics-port",
            type=int,
            default=-1,
            help="serve Prometheus /metrics on this port (-1 = off, 0 = any)",
        )

"""`codegym serve runtime`: environment sessions for RL trainers over sandbox workers, and where
the record of the episodes it serves is kept."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from codegym_cli.serve_setup import (
    add_sandbox_target,
    configure_access,
    configure_logs,
    run_server,
    start_metrics,
)

if TYPE_CHECKING:
    from services.runtime.captures import CaptureStore
    from services.runtime.checkpoints import Keyring
    from services.runtime.config import RuntimeConfig
    from services.runtime.episode_record import RecordStore


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


def capture_store(args: argparse.Namespace) -> CaptureStore | None:
    """Where captured episodes are kept: where the record is (its SQLite file or Redis); in memory
    when the record is off; None with `--no-capture`."""
    from services.runtime.capture_store import SqliteCaptureStore
    from services.runtime.record_store import record_path_for
    from services.runtime.redis_captures import RedisCaptureStore

    if args.no_capture:
        return None
    place = "off" if args.no_record else args.record
    if place == "auto":
        place = args.sessions if args.sessions.startswith(("redis://", "rediss://", "unix://")) else ""
        place = place or str(record_path_for(args.library))
    if place.startswith(("redis://", "rediss://", "unix://")):
        return RedisCaptureStore(place, args.capture_bytes)
    return SqliteCaptureStore(":memory:" if place == "off" else place, args.capture_bytes)


def checkpoint_keys(args: argparse.Namespace) -> Keyring | None:
    """The keys `--checkpoint-key` names (None without one: checkpoints are then refused)."""
    from services.runtime.checkpoints import Keyring

    try:
        return Keyring.load(args.checkpoint_key, args.checkpoint_primary)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"codegym serve runtime: --checkpoint-key: {exc}") from None


def _serve_runtime(args: argparse.Namespace) -> int:
    configure_access(args)
    start_metrics(args)
    from codegym.server.serving import serve
    from services.runtime.server import RuntimeServer
    from services.runtime.service import RuntimeConfig

    configure_logs(args.log_level, args.log_format)
    config = RuntimeConfig(
        max_sessions=args.max_sessions,
        session_ttl_s=args.session_ttl_s,
        default_max_steps=args.max_steps,
        step_timeout_ms=args.step_timeout_ms,
        max_steps_in_flight=args.max_steps_in_flight,
        max_forks=args.max_forks,
        history_steps=args.history_steps,
        history_entries=args.history_entries,
        capture_rate=-1.0 if args.no_capture else args.capture,
        capture_bytes=args.capture_bytes,
    )
    keyring = checkpoint_keys(args)

    async def main() -> None:
        store = None
        if args.sessions:
            from services.runtime.redis_store import RedisSessionStore
            from services.runtime.sessions import HistoryBounds

            store = RedisSessionStore(
                args.sessions,
                args.session_ttl_s,
                lease_s=args.step_lease_s,
                history=HistoryBounds(args.history_steps, args.history_entries),
            )
        server = RuntimeServer(
            args.library,
            args.sandbox,
            host=args.host,
            port=args.port,
            config=config,
            store=store,
            env_cache_mb=args.env_cache_mb,
            record=record_store(args),
            checkpoint_keys=keyring,
            captures=capture_store(args),
        )
        await serve(server)

    run_server(main)
    return 0


def add_parser(servers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """The runtime's options, their defaults RuntimeConfig's."""
    from codegym.library.store import default_library_path
    from services.runtime.service import RuntimeConfig

    defaults = RuntimeConfig()
    runtime = servers.add_parser(
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
    add_fork_options(runtime, defaults)
    add_capture_options(runtime, defaults)
    runtime.set_defaults(func=_serve_runtime)
    return runtime


def add_capture_options(parser: argparse.ArgumentParser, defaults: RuntimeConfig) -> None:
    """Captured episodes (ListEpisodes, GetEpisode; docs/limits.md)."""

    def rate(text: str) -> float:
        value = float(text)
        if not 0.0 <= value <= 1.0:
            raise argparse.ArgumentTypeError(f"{text} is not a fraction within 0..1")
        return value

    parser.add_argument(
        "--capture",
        type=rate,
        default=defaults.capture_rate,
        metavar="RATE",
        help="fraction of episodes captured whole, drawn per episode at create; every episode also "
        "logs its first ceil(solve_fc_round/4) steps, so each one the shortcut sentinel flags is "
        "captured whole. Captures are kept where the record is (its file or Redis; memory with "
        "--no-record)",
    )
    parser.add_argument(
        "--no-capture", action="store_true", help="capture nothing, not even flagged episodes"
    )
    parser.add_argument(
        "--capture-bytes",
        type=int,
        default=defaults.capture_bytes,
        help="bytes of captured episodes kept (with Redis: across every replica); past it the oldest "
        "captures go",
    )


def add_fork_options(parser: argparse.ArgumentParser, defaults: RuntimeConfig) -> None:
    """Forks, histories and checkpoints (docs/fork.md)."""
    parser.add_argument(
        "--max-forks",
        type=int,
        default=defaults.max_forks,
        help="sessions one ForkSession may make (its count: 1 to this)",
    )
    parser.add_argument(
        "--history-steps",
        type=int,
        default=defaults.history_steps,
        help="history entries kept per session created with keep_history (the oldest go first; a "
        "fork at_step needs its step's entry)",
    )
    parser.add_argument(
        "--history-entries",
        type=int,
        default=defaults.history_entries,
        help="history entries kept across the runtime (with Redis: across every replica); past it the "
        "oldest go, whichever session holds them; a step never fails for it",
    )
    parser.add_argument(
        "--checkpoint-key",
        action="append",
        default=[],
        metavar="[ID=]FILE",
        help="a file holding a checkpoint key (32 bytes, base64); repeat for several (a rotation): "
        "all of them open checkpoints, the first (or --checkpoint-primary) seals them. Without "
        "one, CheckpointSession and RestoreSession are refused",
    )
    parser.add_argument(
        "--checkpoint-primary",
        default="",
        metavar="ID",
        help="the id of the key that seals checkpoints (default: the first --checkpoint-key)",
    )

"""`codegym serve runtime`: environment sessions for RL trainers over sandbox workers, and where
the record of the episodes it serves is kept. Its options are `RuntimeSettings`'s
(`services/runtime/settings.py`)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from codegym.server.settings import from_args
from codegym_cli.serve_setup import add_server, run_server, start
from services.runtime.settings import RuntimeSettings

if TYPE_CHECKING:
    from services.runtime.captures import CaptureStore
    from services.runtime.checkpoints import Keyring
    from services.runtime.episode_record import RecordStore


def record_store(settings: RuntimeSettings) -> RecordStore | None:
    """Where the runtime keeps its episode record: `--record` as given; by default in Redis when the
    sessions are there (every replica writes one record), else in a file beside the library."""
    import sqlite3

    from services.runtime.record_store import RedisRecordStore, SqliteRecordStore, record_path_for

    place = "off" if settings.no_record else settings.record
    if place == "off":
        return None
    if place == "auto":
        place = settings.sessions if settings.shared_sessions else str(record_path_for(settings.library))
    if place.startswith(("redis://", "rediss://", "unix://")):
        return RedisRecordStore(place)
    try:
        return SqliteRecordStore(place)
    except (sqlite3.Error, OSError) as exc:
        raise SystemExit(
            f"codegym serve runtime: cannot keep the episode record in {place} ({exc}): give --record FILE "
            "(somewhere writable) or --no-record"
        ) from None


def capture_store(settings: RuntimeSettings) -> CaptureStore | None:
    """Where captured episodes are kept: where the record is (its SQLite file or Redis); in memory
    when the record is off; None with `--no-capture`."""
    import sqlite3

    from services.runtime.capture_store import SqliteCaptureStore
    from services.runtime.record_store import record_path_for
    from services.runtime.redis_captures import RedisCaptureStore

    config = settings.config
    if config.no_capture:
        return None
    if not 0.0 <= config.capture_rate <= 1.0:
        raise SystemExit(
            f"codegym serve runtime: --capture {config.capture_rate} is not a fraction within 0..1"
        )
    place = "off" if settings.no_record else settings.record
    if place == "auto":
        place = settings.sessions if settings.shared_sessions else str(record_path_for(settings.library))
    if place.startswith(("redis://", "rediss://", "unix://")):
        return RedisCaptureStore(place, config.capture_bytes)
    try:
        return SqliteCaptureStore(":memory:" if place == "off" else place, config.capture_bytes)
    except (sqlite3.Error, OSError) as exc:
        raise SystemExit(
            f"codegym serve runtime: cannot keep captured episodes in {place} ({exc}): give --record FILE "
            "(somewhere writable) or --no-capture"
        ) from None


def checkpoint_keys(settings: RuntimeSettings) -> Keyring | None:
    """The keys `--checkpoint-key` names (None without one: checkpoints are then refused), read
    before the server starts so a bad key file is one line, not a traceback."""
    from services.runtime.checkpoints import Keyring

    try:
        return Keyring.load(settings.checkpoint_key, settings.checkpoint_primary)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"codegym serve runtime: --checkpoint-key: {exc}") from None


def _serve_runtime(args: argparse.Namespace) -> int:
    settings = from_args(RuntimeSettings, args)
    auth = start(settings.access, settings.host, settings.log_level, settings.output, settings.calls)
    keys = checkpoint_keys(settings)
    from codegym.server.serving import serve
    from services.runtime.server import RuntimeServer

    async def main() -> None:
        record = record_store(settings)
        captures = capture_store(settings)  # where the record is: after its own check of the place
        await serve(
            RuntimeServer(settings, auth=auth, record=record, checkpoint_keys=keys, captures=captures)
        )

    run_server(main)
    return 0


def add_parser(servers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return add_server(
        servers,
        "runtime",
        RuntimeSettings,
        _serve_runtime,
        help="runtime: environment sessions for RL trainers over sandbox workers",
    )

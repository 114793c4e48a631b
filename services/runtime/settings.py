"""The runtime's settings (`RuntimeSettings`): its library, its workers, where sessions and the
episode record are kept, its limits (`RuntimeConfig`) and its access, each option declared once
(`codegym serve runtime --help`; `codegym up` writes them for its runtimes with `to_argv`).

Standard library only, for `codegym --help`."""

from __future__ import annotations

from dataclasses import dataclass

from codegym.library.location import default_library_path
from codegym.server.settings import (
    Calls,
    GrpcAccess,
    Output,
    host,
    log_level,
    nested,
    option,
    port,
    sandbox_target,
)
from codegym_client.defaults import DEFAULT_TARGET
from services.runtime.config import RuntimeConfig

RUNTIME_PORT = int(DEFAULT_TARGET.rsplit(":", 1)[1])
# Memory for the records of the environments in play (the library is read on demand).
ENV_CACHE_MB = 32
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


@dataclass(frozen=True)
class RuntimeSettings:
    """Everything `codegym serve runtime` is told; `RuntimeServer` takes it."""

    library: str = option(str(default_library_path()), "--library", "environment library (SQLite)")
    sandbox: str = sandbox_target()
    host: str = host()
    port: int = port(RUNTIME_PORT)
    config: RuntimeConfig = nested(RuntimeConfig)
    env_cache_mb: int = option(
        ENV_CACHE_MB,
        "--env-cache-mb",
        "memory for the records of the environments in play (the library is read on demand)",
    )
    sessions: str = option(
        "",
        "--sessions",
        "session store: empty keeps sessions in this process; redis://HOST:PORT/N shares them between replicas",
    )
    step_lease_s: float = option(
        5.0,
        "--step-lease-s",
        "with Redis: how long a dead replica's step can block its session (a live replica renews the "
        "lease every third of it while its step runs, however long the step)",
    )
    record: str = option(
        "auto",
        "--record",
        "where the record of served episodes is kept (Stats, SampleTasks): auto (Redis when --sessions "
        "is, else LIBRARY.record.sqlite beside the library), a file, redis://..., or off",
    )
    no_record: bool = option(False, "--no-record", "keep no record of served episodes (--record off)")
    checkpoint_key: tuple[str, ...] = option(
        (),
        "--checkpoint-key",
        "a file holding a checkpoint key (32 bytes, base64); repeat for several (a rotation): all of "
        "them open checkpoints, the first (or --checkpoint-primary) seals them. Without one, "
        "CheckpointSession and RestoreSession are refused",
        metavar="[ID=]FILE",
    )
    checkpoint_primary: str = option(
        "",
        "--checkpoint-primary",
        "the id of the key that seals checkpoints (default: the first --checkpoint-key)",
        metavar="ID",
    )
    log_level: str = log_level()
    output: Output = nested(Output)
    access: GrpcAccess = nested(GrpcAccess)
    calls: Calls = nested(Calls)

    @property
    def shared_sessions(self) -> bool:
        return self.sessions.startswith(REDIS_SCHEMES)

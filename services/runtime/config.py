"""The runtime's limits and defaults (`RuntimeConfig`), and the seed a session gets by default.

Each bound is either derived from capacity or a deliberate bound; `docs` list them with the reason
(README, "Limits, and where each comes from")."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True)
class RuntimeConfig:
    max_sessions: int = 50_000
    session_ttl_s: float = 30 * 60
    default_max_steps: int = 256
    max_max_steps: int = 4096
    step_timeout_ms: int = 5_000
    max_step_timeout_ms: int = 60_000
    create_timeout_ms: int = 10_000
    max_action_bytes: int = 64 * 1024
    max_batch: int = 1024
    retry_after_ms: int = 1_000
    # Steps admitted (running or waiting for a worker) at once; past it a step is refused with
    # CAPACITY and `step_retry_after_ms` instead of queueing behind work it would time out on.
    max_steps_in_flight: int = 8192
    step_retry_after_ms: int = 100
    # Longest run id a create may name (it keys the episode record).
    max_run_id: int = 256
    # Forks one ForkSession call may make (`--max-forks`): a tree's fan-out, never a flood.
    max_forks: int = 64
    # History (`keep_history`): entries kept per session (`--history-steps`) and across the runtime
    # (`--history-entries`); at either bound the oldest entries go, a step never fails for it.
    history_steps: int = 256
    history_entries: int = 1_000_000
    # Idempotency entries of ForkSession, CheckpointSession and RestoreSession: how long a resend
    # finds the first answer, and how many are kept (the oldest go first).
    idempotency_ttl_s: float = 15 * 60
    idempotency_entries: int = 100_000
    # Longest request id (it keys the idempotency entry).
    max_request_id: int = 128
    # Largest checkpoint blob RestoreSession reads (a state the sandbox made, sealed).
    max_checkpoint_bytes: int = 2 * 1024 * 1024
    # Captured episodes (captures.py): the fraction of episodes logged whole (`--capture RATE`; below
    # 0, `--no-capture`: nothing is logged, not even what a flagged episode needs), and the bytes
    # the capture store keeps (`--capture-bytes`; past it the oldest captures go).
    capture_rate: float = 0.05
    capture_bytes: int = 64 * 1024 * 1024


def session_seed(session_id: str) -> int:
    """A session's seed when the create names none: fixed by its id, so a replay of the session
    (another replica, a restarted worker) draws the same."""
    return int.from_bytes(hashlib.sha256(session_id.encode()).digest()[:8], "big") >> 1

"""The runtime's limits and defaults (`RuntimeConfig`), and the seed a session gets by default.

Each bound is either derived from capacity or a deliberate bound; `docs` list them with the reason
(README, "Limits, and where each comes from")."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from codegym.server.settings import option


@dataclass(frozen=True)
class RuntimeConfig:
    """The runtime's limits; those an operator sets are options of `codegym serve runtime`."""

    max_sessions: int = option(50_000, "--max-sessions", "open sessions at most")
    session_ttl_s: float = option(30 * 60, "--session-ttl-s", "idle time before a session expires")
    default_max_steps: int = option(256, "--max-steps", "default step cap")
    max_max_steps: int = 4096
    step_timeout_ms: int = option(5_000, "--step-timeout-ms", "default deadline of one step")
    max_step_timeout_ms: int = 60_000
    create_timeout_ms: int = 10_000
    # Initial states of seed-independent configurations, copied by later creates (initial_states.py).
    initial_states_mb: int = option(
        16,
        "--initial-states-mb",
        "memory for the initial states of recently built task configurations: a configuration whose "
        "first two builds (different seeds) give the same state and observation is copied by its "
        "later creates instead of built in a sandbox; 0 builds every create",
    )
    max_action_bytes: int = 64 * 1024
    max_batch: int = 1024
    retry_after_ms: int = 1_000
    # Steps admitted (running or waiting for a worker) at once; past it a step is refused with
    # CAPACITY and `step_retry_after_ms` instead of queueing behind work it would time out on.
    max_steps_in_flight: int = option(
        8192,
        "--max-steps-in-flight",
        "steps running or waiting for a worker at once; past it a step is refused with CAPACITY and a "
        "retry-after hint instead of queueing behind work it would time out on",
    )
    step_retry_after_ms: int = 100
    # Longest run id a create may name (it keys the episode record).
    max_run_id: int = 256
    # Forks one ForkSession call may make: a tree's fan-out, never a flood.
    max_forks: int = option(64, "--max-forks", "sessions one ForkSession may make (its count: 1 to this)")
    # History (`keep_history`): at either bound the oldest entries go, a step never fails for it.
    history_steps: int = option(
        256,
        "--history-steps",
        "history entries kept per session created with keep_history (the oldest go first; a fork "
        "at_step needs its step's entry)",
    )
    history_entries: int = option(
        1_000_000,
        "--history-entries",
        "history entries kept across the runtime (with Redis: across every replica); past it the "
        "oldest go, whichever session holds them; a step never fails for it",
    )
    # Idempotency entries of ForkSession, CheckpointSession and RestoreSession: how long a resend
    # finds the first answer, and how many are kept (the oldest go first).
    idempotency_ttl_s: float = 15 * 60
    idempotency_entries: int = 100_000
    # Longest request id (it keys the idempotency entry).
    max_request_id: int = 128
    # Largest checkpoint blob RestoreSession reads (a state the sandbox made, sealed).
    max_checkpoint_bytes: int = 2 * 1024 * 1024
    # Captured episodes (captures.py, docs/limits.md): the fraction logged whole, whether anything is
    # logged for them at all, and the bytes the capture store keeps.
    capture_rate: float = option(
        0.05,
        "--capture",
        "fraction of episodes captured whole (0..1), drawn per episode at create; every episode also "
        "logs its first ceil(solve_fc_round/4) steps, so each one the shortcut sentinel flags is "
        "captured whole. Captures are kept where the record is (its file or Redis; memory with "
        "--no-record)",
        metavar="RATE",
    )
    no_capture: bool = option(False, "--no-capture", "capture nothing, not even flagged episodes")
    capture_bytes: int = option(
        64 * 1024 * 1024,
        "--capture-bytes",
        "bytes of captured episodes kept (with Redis: across every replica); past it the oldest captures go",
    )


def session_seed(session_id: str) -> int:
    """A session's seed when the create names none: fixed by its id, so a replay of the session
    (another replica, a restarted worker) draws the same."""
    return int.from_bytes(hashlib.sha256(session_id.encode()).digest()[:8], "big") >> 1

"""What every verification check shares: the default thresholds (DESIGN §7) and the small pieces
of a plan of sandbox operations (sources sent once by sha256, limits, reading results)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from codegym.contract import sha256_text
from codegym.sandbox.v1 import sandbox_service_pb2 as sb

# The defaults of every threshold (DESIGN §7); a zero request field means these.
MAIN_TIMEOUT_MS = 5_000
REF_TIME_MS = 3_000
REF_MEMORY_MB = 100
MAX_ANSWER_CHARS = 100
MIN_VALID = 10
MIN_VALID_RATIO = 0.8
CASE_TIME_MS = 10_000
CASE_MEMORY_MB = 256
MAX_STEPS = 1_024
BUDGET_MS = 300_000
SMOKE_TESTS = 1
SHORTCUT_FRACTION = 0.5
PROBE_TIME_MS = 5_000
DETERMINISM_TESTS = 5
# Steps of the one oracle trajectory per environment replayed resident and cold (determinism).
RESIDENT_STEPS = 256
MAX_PAID_REPORTED = 20
NEGATIVE_MARK = "NEGCTL:"
# Module-level code of the second determinism run's solve_source: it runs in the fork before the
# environment is built, so every later allocation lands elsewhere than in the first run (as in
# another worker), and `random` is seeded differently.
HEAP_SHIFT = "_codegym_heap_shift = [object() for _ in range(4099)] + [bytearray(97) for _ in range(211)]\n"
# Tests one candidate runs per round in the solvability check: enough to keep two workers busy,
# few enough that a candidate failing early wastes little.
WAVE = 16
OUTPUT_TAIL = 600


def status_name(status: int) -> str:
    return sb.Status.Name(status).removeprefix("STATUS_").lower()  # type: ignore[arg-type]


def tail(text: str, limit: int = OUTPUT_TAIL) -> str:
    text = text.strip()
    return text if len(text) <= limit else "…" + text[-limit:]


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip()[:200] if lines else ""


def failure(result: sb.OperationResult, prefix: str) -> str:
    """A reason for an operation that did not complete: `{prefix}_{status}: detail`."""
    detail = result.message or last_line(result.stderr) or status_name(result.status)
    return f"{prefix}_{status_name(result.status)}: {detail[:300]}"


class Sources:
    """Sources by sha256: operations reference them, the dispatcher sends code only when asked."""

    def __init__(self) -> None:
        self.by_sha: dict[str, str] = {}

    def ref(self, code: str) -> sb.SourceRef:
        sha = sha256_text(code)
        self.by_sha[sha] = code
        return sb.SourceRef(sha256=sha)


# How a check runs its plan: independent operations, results in order (the verifier's dispatcher
# batch). Checks take it as an argument, so each reads alone and a test can hand in a fake.
RunOps = Callable[[Sequence[sb.Operation], Sources], Awaitable[list[sb.OperationResult]]]


def limits(time_ms: int, memory_mb: int = 0) -> sb.Limits:
    return sb.Limits(wall_ms=time_ms, cpu_ms=time_ms, memory_mb=memory_mb)


def config_key(config_json: str) -> tuple[dict[str, Any] | None, str]:
    """(config, canonical text) or (None, reason) for a config that is not a JSON object."""
    try:
        config = json.loads(config_json)
    except ValueError as exc:
        return None, f"bad_config: not JSON: {exc}"
    if not isinstance(config, dict):
        return None, f"bad_config: a config is a JSON object, not {type(config).__name__}"
    return config, json.dumps(config, sort_keys=True, separators=(",", ":"))


def json_value(text: str) -> tuple[bool, Any]:
    if not text:
        return False, None
    try:
        return True, json.loads(text)
    except ValueError:
        return False, None

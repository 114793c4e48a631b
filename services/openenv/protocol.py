"""OpenEnv's wire protocol as the gateway speaks it: error codes, message shapes, what a socket holds.

Kept apart from the gateway's routes and episode handling (gateway.py) so both read one
definition of every message the gateway can send.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from starlette.websockets import WebSocket

from codegym.server.auth import Identity
from codegym_client.channels import Access
from codegym_client.errors import (
    CapacityExceeded,
    CodeGymError,
    EnvFailed,
    EnvNotFound,
    InvalidRequest,
    SessionDone,
    SessionNotFound,
)
from services.openenv.settings import GatewaySettings

# OpenEnv's WSErrorCode values (openenv.core.env_server.types).
INVALID_JSON = "INVALID_JSON"
UNKNOWN_TYPE = "UNKNOWN_TYPE"
VALIDATION_ERROR = "VALIDATION_ERROR"
EXECUTION_ERROR = "EXECUTION_ERROR"
CAPACITY_REACHED = "CAPACITY_REACHED"
FACTORY_ERROR = "FACTORY_ERROR"
SESSION_ERROR = "SESSION_ERROR"

# The runtime's step error codes (StepErrorCode) as OpenEnv's ToolErrorType. An environment's own
# failure (ENV_ERROR) is the tool's answer: it stays in `result` only, as OpenEnv asks.
TOOL_ERRORS = {1: "invalid_args", 2: "tool_not_found", 4: "timeout", 5: "execution_error"}
STEP_ERROR_NAMES = {
    1: "INVALID_ACTION",
    2: "UNKNOWN_TOOL",
    3: "ENV_ERROR",
    4: "STEP_TIMEOUT",
    5: "SANDBOX_LIMIT",
}

USE_WEBSOCKET = (
    "this gateway serves OpenEnv sessions over the WebSocket at /ws only (every session lives in the "
    "CodeGym runtime; single-shot HTTP reset/step would leak one): use openenv's GenericEnvClient or "
    'MCPToolClient, or send {"type": "reset", "data": {"ability": ...}} on ws://HOST:PORT/ws'
)


# A gateway with no `--max-sessions` of its own keeps at most this many MCP session tokens without a
# socket (each opens at most one runtime session): a deliberate bound on memory against a flood of
# `openenv/session/create`, twice the runtime's default session cap (its `--max-sessions`, 50,000).
# Tokens idle past `--idle-timeout-s` are dropped. With `--max-sessions N`: 2 N.
MCP_TOKENS_WITHOUT_CAP = 100_000


# The gateway's options at their defaults (`codegym serve openenv`): `GatewayConfig`'s are read from it.
_OPTIONS = GatewaySettings(runtime="")


@dataclass
class GatewayConfig:
    runtime: str
    # Sessions this gateway holds at once (0: no cap of its own). By default the limit is the
    # runtime's: its session cap (`codegym serve runtime --max-sessions`, 50,000 by default, per
    # replica) and the tenants' quotas, which it answers with CAPACITY and a retry-after, passed on as
    # CAPACITY_REACHED. A copy of that number here would be wrong as soon as the runtime is set
    # otherwise or several gateways share it; a gateway's own cap is a choice (`--max-sessions`).
    max_sessions: int = _OPTIONS.max_sessions
    idle_timeout_s: float = _OPTIONS.idle_timeout_s  # <= 0: no idle reaper
    ping_interval_s: float | None = _OPTIONS.ping_interval_s
    ping_timeout_s: float | None = _OPTIONS.ping_timeout_s
    max_message_bytes: int = _OPTIONS.max_message_bytes  # larger messages get a VALIDATION_ERROR
    transport_max_bytes: int = 16 << 20  # larger frames close the socket (1009)
    runtime_timeout_s: float = 120.0
    name: str = "codegym"
    # One environment per gateway (`--env`), as an OpenEnv server is one environment: its tools are
    # listed before any reset, and a reset naming no task plays one of its task configs, chosen by
    # `seed` (verifiers' OpenEnvEnv lists the tools before each reset, then resets with the
    # arguments of its `resets` config, e.g. {"seed": 3}).
    env: str = ""
    # SIGTERM: how long open episodes may go on stepping before their sockets are closed.
    grace_s: float = _OPTIONS.grace_s
    # Access tokens the gateway takes (`codegym.server.auth.ServerAuth.tokens`; empty: every caller served).
    tokens: Mapping[str, Identity] = field(default_factory=dict)
    # How the gateway calls the runtime (its token and CA; None: the environment's).
    access: Access | None = None

    @property
    def max_mcp_tokens(self) -> int:
        return 2 * self.max_sessions if self.max_sessions > 0 else MCP_TOKENS_WITHOUT_CAP


@dataclass
class FixedEnv:
    """The gateway's one environment (`GatewayConfig.env`): its tools and task configs."""

    tools: list[dict[str, Any]]
    configs: list[str]


class GatewayError(Exception):
    """An OpenEnv error answer: `code` is one of OpenEnv's WSErrorCode values."""

    def __init__(self, code: str, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.code = code
        self.extra = extra

    def data(self) -> dict[str, Any]:
        return {"message": str(self), "code": self.code, **self.extra}


# The OpenEnv code of each typed runtime error; any other is an execution error.
RUNTIME_ERROR_CODES: tuple[tuple[type[CodeGymError], str], ...] = (
    (CapacityExceeded, CAPACITY_REACHED),
    (EnvFailed, FACTORY_ERROR),
    (EnvNotFound, VALIDATION_ERROR),
    (InvalidRequest, VALIDATION_ERROR),
    (SessionNotFound, SESSION_ERROR),
    (SessionDone, SESSION_ERROR),
)


def from_runtime(error: CodeGymError) -> GatewayError:
    """Our typed runtime errors as OpenEnv codes (`reason`, `retryable` and the runtime's
    `retry_after_s` kept for callers)."""
    extra: dict[str, Any] = {"reason": error.reason, "retryable": error.retryable}
    if error.retry_after_s is not None:
        extra["retry_after_s"] = error.retry_after_s
    code = next((code for kind, code in RUNTIME_ERROR_CODES if isinstance(error, kind)), EXECUTION_ERROR)
    return GatewayError(code, f"{error.reason}: {error.details()}", **extra)


@dataclass
class HeldSession:
    """The runtime session a socket holds."""

    session_id: str
    episode_id: str
    env_id: str
    max_steps: int
    tools: list[dict[str, Any]]
    step_count: int = 0
    done: bool = False
    truncated: bool = False
    reward: float = 0.0


@dataclass(eq=False)
class Connection:
    websocket: WebSocket | None
    episode: HeldSession | None = None
    last_active: float = field(default_factory=time.monotonic)
    busy: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    closed: bool = False
    token: str = ""  # the HTTP MCP session token this socket attached to, if any
    tenant: str = ""  # whose it is (with access tokens): an MCP token serves its own tenant only


def tool_entry(spec: Any) -> dict[str, Any]:
    """A runtime ToolSpec as an MCP tool: name, description, input_schema (JSON schema)."""
    try:
        openai = json.loads(spec.json_schema) if spec.json_schema else {}
    except ValueError:
        openai = {}
    function = openai.get("function", openai) if isinstance(openai, dict) else {}
    schema = function.get("parameters") or {"type": "object", "properties": {}}
    description = function.get("description") or spec.text or spec.signature
    return {"name": spec.name, "description": description, "input_schema": schema}


def optional_int(data: dict[str, Any], key: str) -> int:
    value = data.get(key)
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise GatewayError(VALIDATION_ERROR, f"{key} must be a non-negative integer, got {value!r}")
    return value


def reply(kind: str, data: dict[str, Any]) -> str:
    return json.dumps({"type": kind, "data": data}, ensure_ascii=False)


def error_text(code: str, message: str) -> str:
    return json.dumps({"type": "error", "data": {"message": message, "code": code}})


def rpc_result(rid: Any, result: Any) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": rid, "result": result}


def rpc_error(rid: Any, code: int, message: str) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": rid, "error": {"code": code, "message": message, "data": None}}


_TOOL_ERROR = {
    "type": "object",
    "properties": {
        "error_type": {
            "type": "string",
            "enum": ["execution_error", "invalid_args", "transport_error", "tool_not_found", "timeout"],
        },
        "message": {"type": "string"},
    },
    "required": ["error_type", "message"],
}

SCHEMAS: dict[str, Any] = {
    # Titled as OpenEnv's tool-call action (mcp_types.CallToolAction), so clients that read the
    # schema switch to tool calling.
    "action": {
        "title": "CallToolAction",
        "description": 'Call one of the environment\'s tools (list them with {"type": "list_tools"}); '
        'CodeGym\'s own {"name": TOOL, "parameters": {...}} is accepted too.',
        "type": "object",
        "properties": {
            "type": {"const": "call_tool", "default": "call_tool", "type": "string"},
            "tool_name": {"type": "string", "description": "Name of the tool to call"},
            "arguments": {"type": "object", "description": "Arguments to pass to the tool"},
            "metadata": {"type": "object"},
        },
        "required": ["tool_name"],
    },
    "observation": {
        "title": "CallToolObservation",
        "type": "object",
        "properties": {
            "tool_name": {"type": "string"},
            "result": {"type": "string", "description": "The environment's observation, unchanged"},
            "error": {"anyOf": [_TOOL_ERROR, {"type": "null"}]},
            "done": {"type": "boolean"},
            "reward": {"anyOf": [{"type": "number"}, {"type": "null"}]},
            "metadata": {"type": "object"},
        },
        "required": ["tool_name"],
    },
    "reset_observation": {
        "title": "CodeGymResetObservation",
        "type": "object",
        "properties": {
            "task": {"type": "string"},
            "observation": {"type": "string"},
            "tools_text": {"type": "string"},
            "tools": {"type": "array", "items": {"type": "object"}},
            "metadata": {"type": "object"},
        },
    },
    "state": {
        "title": "State",
        "type": "object",
        "properties": {
            "episode_id": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            "step_count": {"type": "integer", "minimum": 0},
        },
        "additionalProperties": True,
    },
}

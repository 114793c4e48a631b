"""The OpenEnv gateway: OpenEnv's WebSocket protocol (the `openenv` package's `EnvClient`,
`GenericEnvClient`, `MCPToolClient`) in front of the runtime's gRPC API.

Stateless: every session lives in the runtime; a socket holds at most one runtime session at a
time (a second `reset` closes the first), and a closed, dropped or idle socket closes it. The only
thing kept here is routing: which socket holds which runtime session, and the HTTP MCP session
tokens OpenEnv's production-mode MCP client opens before it attaches a socket (`/mcp`,
`openenv/session/create`); both die with the socket or the idle limit.

Wire format (as `openenv.core.env_server.http_server` serves it): a client sends
`{"type": "reset"|"step"|"state"|"close"|"mcp", "data": ...}`; the server answers
`{"type": "observation", "data": {"observation": {...}, "reward", "done", "metadata"}}`,
`{"type": "state", "data": {...}}`, `{"type": "mcp", "data": <JSON-RPC response>}` or
`{"type": "error", "data": {"message", "code"}}` with OpenEnv's codes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from codegym_client.async_client import AsyncRuntimeClient
from codegym_client.errors import (
    CapacityExceeded,
    CodeGymError,
    EnvFailed,
    EnvNotFound,
    InvalidRequest,
    SessionDone,
    SessionNotFound,
)
from services.openenv import metrics

log = logging.getLogger("codegym.openenv")

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


@dataclass
class GatewayConfig:
    runtime: str
    max_sessions: int = 1024
    idle_timeout_s: float = 900.0  # <= 0: no idle reaper
    ping_interval_s: float | None = 30.0
    ping_timeout_s: float | None = 120.0
    max_message_bytes: int = 1 << 20  # larger messages get a VALIDATION_ERROR
    transport_max_bytes: int = 16 << 20  # larger frames close the socket (1009)
    runtime_timeout_s: float = 120.0
    name: str = "codegym"


class GatewayError(Exception):
    """An OpenEnv error answer: `code` is one of OpenEnv's WSErrorCode values."""

    def __init__(self, code: str, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.code = code
        self.extra = extra

    def data(self) -> dict[str, Any]:
        return {"message": str(self), "code": self.code, **self.extra}


def from_runtime(error: CodeGymError) -> GatewayError:
    """Our typed runtime errors as OpenEnv codes (`reason` and `retryable` kept for callers)."""
    extra = {"reason": error.reason, "retryable": bool(getattr(error, "retryable", False))}
    detail = error.details() if callable(getattr(error, "details", None)) else str(error)
    message = f"{error.reason}: {detail}"
    if isinstance(error, CapacityExceeded):
        return GatewayError(CAPACITY_REACHED, message, **extra)
    if isinstance(error, EnvFailed):
        return GatewayError(FACTORY_ERROR, message, **extra)
    if isinstance(error, EnvNotFound | InvalidRequest):
        return GatewayError(VALIDATION_ERROR, message, **extra)
    if isinstance(error, SessionNotFound | SessionDone):
        return GatewayError(SESSION_ERROR, message, **extra)
    return GatewayError(EXECUTION_ERROR, message, **extra)


@dataclass
class Episode:
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
    episode: Episode | None = None
    last_active: float = field(default_factory=time.monotonic)
    busy: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    closed: bool = False
    token: str = ""  # the HTTP MCP session token this socket attached to, if any


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


class Gateway:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.client: AsyncRuntimeClient | None = None
        self.connections: set[Connection] = set()
        self.sessions = 0  # runtime sessions held (or being created) by sockets
        self.tokens: dict[str, Connection] = {}  # HTTP MCP session tokens
        self._reaper: asyncio.Task[None] | None = None
        self.app = Starlette(
            routes=[
                Route("/health", self.health),
                Route("/metadata", self.metadata),
                Route("/schema", self.schema),
                Route("/state", self.http_state),
                Route("/reset", self.use_websocket, methods=["GET", "POST"]),
                Route("/step", self.use_websocket, methods=["GET", "POST"]),
                Route("/mcp", self.http_mcp, methods=["POST"]),
                WebSocketRoute("/ws", self.websocket),
            ],
            lifespan=self._lifespan,
        )

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        await self.start()
        try:
            yield
        finally:
            await self.stop()

    # lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        self.client = AsyncRuntimeClient(self.config.runtime, timeout_s=self.config.runtime_timeout_s)
        if self.config.idle_timeout_s > 0:
            self._reaper = asyncio.create_task(self._reap_idle())

    async def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        for conn in list(self.connections):
            await self._release(conn)
        if self.client is not None:
            await self.client.close()

    @property
    def runtime(self) -> AsyncRuntimeClient:
        assert self.client is not None, "the gateway has not started"
        return self.client

    async def _reap_idle(self) -> None:
        limit = self.config.idle_timeout_s
        period = min(1.0, limit / 4)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for conn in list(self.connections):
                if conn.busy or now - conn.last_active <= limit:
                    continue
                metrics.REAPED.inc()
                log.info("closing a socket idle for %.0f s", now - conn.last_active)
                await self._release(conn)
                ws = conn.websocket
                if ws is not None and ws.application_state == WebSocketState.CONNECTED:
                    with contextlib.suppress(Exception):
                        await ws.send_text(
                            error_text(SESSION_ERROR, f"idle for more than {limit:g} s: session closed")
                        )
                        await ws.close(code=1001, reason="idle")
            for token, conn in list(self.tokens.items()):
                if conn.websocket is None and now - conn.last_active > limit:
                    self.tokens.pop(token, None)
                    await self._release(conn)

    async def _release(self, conn: Connection) -> None:
        """Close the socket's runtime session (idempotent; never raises)."""
        conn.closed = True
        self.connections.discard(conn)
        await self._close_episode(conn)

    async def _close_episode(self, conn: Connection) -> None:
        episode, conn.episode = conn.episode, None
        if episode is None:
            return
        self.sessions -= 1
        metrics.SESSIONS.set(self.sessions)
        try:
            await asyncio.wait_for(self.runtime.close_session(episode.session_id), 30)
        except (CodeGymError, TimeoutError) as exc:
            log.warning("closing session %s: %s", episode.session_id, exc)

    # HTTP routes ------------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "healthy"})

    async def metadata(self, request: Request) -> Response:
        return JSONResponse(
            {
                "name": self.config.name,
                "description": "CodeGym tool-use environments served by a CodeGym runtime; reset with a "
                "training instance's ability (codegym_v1@Env@{config}) or env + config, then call tools.",
                "readme_content": None,
                "version": "0.1.0",
                "author": None,
                "documentation_url": None,
            }
        )

    async def schema(self, request: Request) -> Response:
        return JSONResponse(SCHEMAS)

    async def http_state(self, request: Request) -> Response:
        return JSONResponse({"error": USE_WEBSOCKET, "code": SESSION_ERROR}, status_code=409)

    async def use_websocket(self, request: Request) -> Response:
        return JSONResponse({"error": USE_WEBSOCKET, "code": SESSION_ERROR}, status_code=409)

    async def http_mcp(self, request: Request) -> Response:
        body = await request.body()
        if len(body) > self.config.max_message_bytes:
            return JSONResponse(rpc_error(None, -32600, "request too large"))
        try:
            rpc = json.loads(body)
        except ValueError:
            return JSONResponse(rpc_error(None, -32700, "Parse error"))
        return JSONResponse(await self.mcp(rpc, None))

    # JSON-RPC (tools/list, tools/call, openenv/session/create|close) ---------------------------

    async def mcp(self, rpc: Any, conn: Connection | None) -> dict[str, Any]:
        if not isinstance(rpc, dict) or not isinstance(rpc.get("method"), str):
            return rpc_error(None, -32600, "Invalid Request: expected a JSON-RPC 2.0 object with a method")
        rid = rpc.get("id")
        params = rpc.get("params") or {}
        if not isinstance(params, dict):
            return rpc_error(rid, -32602, "Params must be an object")
        method = rpc["method"]
        if method == "openenv/session/create":
            if conn is not None:
                return rpc_result(rid, {"session_id": conn.token or "ws"})
            if len(self.tokens) >= 2 * self.config.max_sessions:
                return rpc_error(rid, -32000, "CAPACITY_REACHED: too many open MCP sessions")
            token = uuid.uuid4().hex
            self.tokens[token] = Connection(websocket=None, token=token)
            return rpc_result(rid, {"session_id": token})
        if conn is None:
            conn = self.tokens.get(str(params.get("session_id", "")))
            if conn is None:
                return rpc_error(rid, -32602, f"Unknown session_id: {params.get('session_id')!r}")
        conn.last_active = time.monotonic()
        if method == "openenv/session/close":
            token = str(params.get("session_id", ""))
            self.tokens.pop(token, None)
            if conn.websocket is None:
                await self._release(conn)
            return rpc_result(rid, {"session_id": token, "closed": True})
        if method == "tools/list":
            tools = conn.episode.tools if conn.episode else []
            listed = [{**t, "inputSchema": t["input_schema"]} for t in tools]
            return rpc_result(rid, {"tools": listed})
        if method == "tools/call":
            name, arguments = params.get("name"), params.get("arguments") or {}
            if not isinstance(name, str) or not isinstance(arguments, dict):
                return rpc_error(rid, -32602, "tools/call needs a name (string) and arguments (object)")
            try:
                async with conn.lock:
                    data = await self._step(conn, {"name": name, "parameters": arguments}, name)
            except GatewayError as exc:
                return rpc_error(rid, -32000, f"{exc.code}: {exc}")
            obs = data["observation"]
            text = obs["result"]
            return rpc_result(
                rid,
                {
                    "content": [{"type": "text", "text": text}],
                    "data": text,
                    "isError": obs["error"] is not None,
                    "reward": data["reward"],
                    "done": data["done"],
                },
            )
        return rpc_error(rid, -32601, f"Method not found: {method}")

    # WebSocket ----------------------------------------------------------------------------------

    async def websocket(self, ws: WebSocket) -> None:
        await ws.accept()
        token = ws.query_params.get("session_id", "")
        if token:
            conn = self.tokens.get(token)
            if conn is None or conn.websocket is not None:
                why = "unknown" if conn is None else "already attached"
                await ws.send_text(error_text(SESSION_ERROR, f"session_id {token!r} is {why}"))
                await ws.close()
                return
            conn.websocket = ws
        else:
            conn = Connection(websocket=ws)
        self.connections.add(conn)
        metrics.SOCKETS.inc()
        try:
            while not conn.closed:
                message = await ws.receive()
                if message["type"] == "websocket.disconnect":
                    break
                conn.last_active = time.monotonic()
                text = message.get("text")
                if text is None:
                    raw = message.get("bytes") or b""
                    text = raw.decode("utf-8", "replace")
                conn.busy += 1
                try:
                    async with conn.lock:
                        reply = await self.handle(conn, text)
                finally:
                    conn.busy -= 1
                    conn.last_active = time.monotonic()
                if reply is None:
                    break
                await ws.send_text(reply)
        except (WebSocketDisconnect, RuntimeError):
            pass
        finally:
            metrics.SOCKETS.dec()
            if conn.token:
                self.tokens.pop(conn.token, None)
            await self._release(conn)
            if ws.application_state == WebSocketState.CONNECTED:
                with contextlib.suppress(Exception):
                    await ws.close()

    async def handle(self, conn: Connection, text: str) -> str | None:
        """One client message to its answer (None: the client closed)."""
        kind = "invalid"
        try:
            if len(text) > self.config.max_message_bytes:
                raise GatewayError(
                    VALIDATION_ERROR,
                    f"message of {len(text)} characters is over the limit of {self.config.max_message_bytes}",
                )
            try:
                message = json.loads(text)
            except ValueError as exc:
                raise GatewayError(INVALID_JSON, f"Invalid JSON: {exc}") from None
            if not isinstance(message, dict):
                raise GatewayError(VALIDATION_ERROR, "a message is a JSON object with a type")
            kind = str(message.get("type")) if isinstance(message.get("type"), str) else "invalid"
            metrics.MESSAGES.labels(kind if kind in KNOWN_TYPES else "other").inc()
            data = message.get("data", {})
            match kind:
                case "reset":
                    if data is None:
                        data = {}
                    if not isinstance(data, dict):
                        raise GatewayError(VALIDATION_ERROR, "reset data must be an object")
                    return reply("observation", await self._reset(conn, data))
                case "step":
                    if not isinstance(data, dict):
                        raise GatewayError(VALIDATION_ERROR, "step data must be an action object")
                    return reply("observation", await self._act(conn, data))
                case "state":
                    return reply("state", self._state(conn))
                case "close":
                    return None
                case "mcp":
                    return reply("mcp", await self.mcp(data, conn))
                case _:
                    raise GatewayError(UNKNOWN_TYPE, f"Unknown message type: {message.get('type')!r}")
        except GatewayError as exc:
            metrics.ERRORS.labels(exc.code).inc()
            return json.dumps({"type": "error", "data": exc.data()})
        except Exception as exc:  # a bug here must not drop the socket
            log.exception("handling a %s message", kind)
            metrics.ERRORS.labels(EXECUTION_ERROR).inc()
            return error_text(EXECUTION_ERROR, f"internal error: {type(exc).__name__}")

    async def _reset(self, conn: Connection, data: dict[str, Any]) -> dict[str, Any]:
        ability = data.get("ability") or ""
        env_id = data.get("env") or data.get("env_id") or ""
        config = data.get("config")
        if not isinstance(ability, str) or not isinstance(env_id, str):
            raise GatewayError(VALIDATION_ERROR, "ability and env are strings")
        if not ability and not env_id:
            raise GatewayError(
                VALIDATION_ERROR,
                "reset needs an environment: ability ('codegym_v1@{code_id}__{Env}@{config json}', a "
                "training instance's column) or env ('{code_id}__{Env}') with config",
            )
        if config is not None and not isinstance(config, dict | str):
            raise GatewayError(VALIDATION_ERROR, "config is an object or its JSON text")
        seed = optional_int(data, "seed")
        max_steps = optional_int(data, "max_steps")
        episode_id = data.get("episode_id")
        if episode_id is not None and (not isinstance(episode_id, str) or len(episode_id) > 255):
            raise GatewayError(VALIDATION_ERROR, "episode_id is a string of at most 255 characters")
        # A second reset on one socket ends the first episode (TRL reuses clients).
        await self._close_episode(conn)
        if self.sessions >= self.config.max_sessions:
            raise GatewayError(
                CAPACITY_REACHED,
                f"the gateway holds {self.sessions} sessions, its limit (--max-sessions): retry later",
                active_sessions=self.sessions,
                max_sessions=self.config.max_sessions,
            )
        self.sessions += 1
        metrics.SESSIONS.set(self.sessions)
        try:
            if ability:
                created = await self.runtime.create_session(ability=ability, seed=seed, max_steps=max_steps)
            else:
                created = await self.runtime.create_session(
                    env_id=env_id, config=config, seed=seed, max_steps=max_steps
                )
        except CodeGymError as exc:
            self.sessions -= 1
            metrics.SESSIONS.set(self.sessions)
            raise from_runtime(exc) from None
        except BaseException:
            self.sessions -= 1
            metrics.SESSIONS.set(self.sessions)
            raise
        episode = Episode(
            session_id=created.session_id,
            episode_id=episode_id or uuid.uuid4().hex,
            env_id=created.env_id,
            max_steps=created.max_steps,
            tools=[tool_entry(t) for t in created.tools],
        )
        if conn.closed:  # the socket went away while the runtime created the session
            conn.episode = episode
            await self._close_episode(conn)
            raise GatewayError(SESSION_ERROR, "the socket closed")
        conn.episode = episode
        metadata = {
            "env_id": episode.env_id,
            "episode_id": episode.episode_id,
            "session_id": episode.session_id,
            "max_steps": episode.max_steps,
            "task": created.task_text,
            "truncated": False,
        }
        observation = {
            "task": created.task_text,
            "observation": created.observation,
            "tools_text": created.tools_text,
            "tools": episode.tools,
            "metadata": metadata,
        }
        return {"observation": observation, "reward": None, "done": False, "metadata": metadata}

    async def _act(self, conn: Connection, action: dict[str, Any]) -> dict[str, Any]:
        kind = action.get("type")
        if kind == "list_tools":
            tools = conn.episode.tools if conn.episode else []
            metadata: dict[str, Any] = {}
            if conn.episode is None:
                metadata["hint"] = "the tools depend on the environment: reset first"
            return {
                "observation": {"tools": tools, "metadata": metadata},
                "reward": None,
                "done": False,
                "metadata": metadata,
            }
        if kind == "call_tool":
            name, arguments = action.get("tool_name"), action.get("arguments", {})
            if not isinstance(name, str) or not name:
                raise GatewayError(VALIDATION_ERROR, "call_tool needs tool_name (a string)")
            if not isinstance(arguments, dict):
                raise GatewayError(VALIDATION_ERROR, "call_tool arguments must be an object")
            return await self._step(conn, {"name": name, "parameters": arguments}, name)
        if kind is not None:
            raise GatewayError(
                VALIDATION_ERROR,
                f"unknown action type {kind!r}: call_tool, list_tools, or a CodeGym action "
                '{"name": TOOL, "parameters": {...}}',
            )
        name = action.get("name")
        if not isinstance(name, str):
            raise GatewayError(
                VALIDATION_ERROR,
                'an action is {"type": "call_tool", "tool_name": ..., "arguments": {...}}, '
                '{"type": "list_tools"} or CodeGym\'s {"name": ..., "parameters": {...}}',
            )
        return await self._step(conn, action, name)

    async def _step(self, conn: Connection, action: dict[str, Any], name: str) -> dict[str, Any]:
        episode = conn.episode
        if episode is None:
            raise GatewayError(SESSION_ERROR, "no episode on this socket: send reset first")
        try:
            response = await self.runtime.step(episode.session_id, action)
        except CodeGymError as exc:
            metrics.STEPS.labels(exc.reason).inc()
            if isinstance(exc, SessionNotFound):  # expired in the runtime: forget it
                conn.episode = None
                self.sessions -= 1
                metrics.SESSIONS.set(self.sessions)
            raise from_runtime(exc) from None
        code = response.error.code if response.HasField("error") else 0
        metrics.STEPS.labels(STEP_ERROR_NAMES.get(code, "ok")).inc()
        episode.step_count = response.step_index
        episode.done = response.done
        episode.truncated = response.truncated
        episode.reward = response.reward
        tool_error = None
        if code in TOOL_ERRORS:
            tool_error = {"error_type": TOOL_ERRORS[code], "message": response.error.message}
        metadata: dict[str, Any] = {"truncated": response.truncated, "step_count": response.step_index}
        if code:
            metadata["step_error"] = STEP_ERROR_NAMES.get(code, str(code))
        observation = {
            "tool_name": name,
            "result": response.observation,
            "error": tool_error,
            "metadata": metadata,
        }
        reward = float(response.reward) if response.done else None
        return {"observation": observation, "reward": reward, "done": response.done, "metadata": metadata}

    def _state(self, conn: Connection) -> dict[str, Any]:
        episode = conn.episode
        if episode is None:
            return {"episode_id": None, "step_count": 0}
        return {
            "episode_id": episode.episode_id,
            "step_count": episode.step_count,
            "env_id": episode.env_id,
            "max_steps": episode.max_steps,
            "done": episode.done,
            "truncated": episode.truncated,
            "reward": episode.reward,
        }


KNOWN_TYPES = frozenset({"reset", "step", "state", "close", "mcp"})


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

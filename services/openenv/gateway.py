"""The OpenEnv gateway: OpenEnv's WebSocket protocol (the `openenv` package's `EnvClient`,
`GenericEnvClient`, `MCPToolClient`) in front of the runtime's gRPC API.

Stateless: every session lives in the runtime; a socket holds at most one runtime session at a
time (a second `reset` closes the first), and a closed, dropped or idle socket closes it. The only
thing kept here is routing: which socket holds which runtime session, and the HTTP MCP session
tokens OpenEnv's production-mode MCP client opens before it attaches a socket (`/mcp`,
`openenv/session/create`); both die with the socket or the idle limit. The session count (for
`--max-sessions` and the `codegym_openenv_sessions_open` gauge) is the size of the set of
connections holding one, not a counter kept by hand (a session being closed is no longer held); a
connection's episode changes only under its lock (steps, resets and every close alike). Without
`--max-sessions` the runtime's own session cap is the limit.

Access (access.py): with tokens configured, every request but the probes shows
`Authorization: Bearer <token>` (401 without a known one, 403 for a role that may not play), the
WebSocket handshake included; an MCP session token serves only the tenant that opened it.

Stopping (SIGTERM, a rolling update: `drain`): the gateway stops taking new sockets, MCP sessions
and episodes (`/health` answers 503 "draining", so readiness takes it out of the Service), lets the
sockets it holds step their episodes to the end for up to `--grace-s`, then closes what is left
with an error message and close code 1012 (service restart), and exits.

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
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from codegym.server.auth import Identity
from codegym_client.abilities import ABILITY_FORMAT
from services.openenv import metrics
from services.openenv.access import RequireToken, caller
from services.openenv.episodes import Episodes
from services.openenv.protocol import (
    CAPACITY_REACHED,
    EXECUTION_ERROR,
    INVALID_JSON,
    SCHEMAS,
    SESSION_ERROR,
    UNKNOWN_TYPE,
    USE_WEBSOCKET,
    VALIDATION_ERROR,
    Connection,
    GatewayConfig,
    GatewayError,
    error_text,
    reply,
    rpc_error,
    rpc_result,
)

log = logging.getLogger("codegym.openenv")


class Gateway:
    """The routes and the sockets; each connection's episode is `self.episodes`' (episodes.py),
    changed only under the connection's lock, which the gateway takes."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.episodes = Episodes(config)
        self.connections: set[Connection] = set()
        self.tokens: dict[str, Connection] = {}  # HTTP MCP session tokens
        metrics.SESSIONS.set_function(lambda: self.episodes.sessions)
        self._reaper: asyncio.Task[None] | None = None
        self.app = Starlette(
            routes=[
                Route("/health", self.health),
                Route("/live", self.live),
                Route("/metadata", self.metadata),
                Route("/schema", self.schema),
                Route("/state", self.http_state),
                Route("/reset", self.use_websocket, methods=["GET", "POST"]),
                Route("/step", self.use_websocket, methods=["GET", "POST"]),
                Route("/mcp", self.http_mcp, methods=["POST"]),
                WebSocketRoute("/ws", self.websocket),
            ],
            middleware=[Middleware(RequireToken, tokens=config.tokens)],
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
        self.episodes.start()
        if self.config.idle_timeout_s > 0:
            self._reaper = asyncio.create_task(self._reap_idle())

    async def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        for conn in [*self.connections, *self.tokens.values()]:
            await self._release(conn)
        self.tokens.clear()
        await self.episodes.stop()

    @property
    def sessions(self) -> int:
        """Runtime sessions held (or being created) by this gateway's connections."""
        return self.episodes.sessions

    @property
    def draining(self) -> bool:
        """Stopping (SIGTERM): set on the episodes, which then refuse new ones; the routes refuse
        new sockets and MCP sessions."""
        return self.episodes.draining

    def in_play(self) -> int:
        """Connections with an episode not over (or being created), or a request in flight."""
        playing = {c for c in self.episodes.held if c.episode is None or not c.episode.done}
        playing.update(c for c in self.connections if c.busy or c.lock.locked())
        return len(playing)

    async def drain(self, grace_s: float) -> None:
        """Stop as a rolling update wants: take no new socket, MCP session or episode, let the
        episodes in play step to their end for up to `grace_s` seconds, then close what is left
        (each socket told why, close code 1012). The caller then stops the server."""
        self.episodes.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        log.info(
            "draining: %d sockets, %d episodes in play; no new sessions; up to %g s",
            len(self.connections),
            self.in_play(),
            grace_s,
        )
        while self.in_play() and loop.time() < deadline:
            await asyncio.sleep(0.05)
        left = self.in_play()
        if left:
            log.warning("grace of %g s over: closing %d episodes still in play", grace_s, left)
        message = f"the gateway is shutting down (grace of {grace_s:g} s over): session closed; reconnect"
        ends = [self._end_socket(c, message, 1012, "shutting down") for c in list(self.connections)]
        ends += [self._release(c) for c in list(self.tokens.values())]
        self.tokens.clear()
        if ends:
            # A step still in flight (up to the runtime timeout) must not hold the exit for long.
            _, pending = await asyncio.wait([asyncio.ensure_future(e) for e in ends], timeout=10)
            for task in pending:
                task.cancel()
        log.info("drained: %d sessions left", self.episodes.sessions)

    async def _reap_idle(self) -> None:
        limit = self.config.idle_timeout_s
        period = min(1.0, limit / 4)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for conn in list(self.connections):
                if conn.busy or conn.lock.locked() or now - conn.last_active <= limit:
                    continue
                metrics.REAPED.inc()
                log.info("closing a socket idle for %.0f s", now - conn.last_active)
                await self._end_socket(conn, f"idle for more than {limit:g} s: session closed", 1001, "idle")
            for token, conn in list(self.tokens.items()):
                if conn.websocket is None and not conn.lock.locked() and now - conn.last_active > limit:
                    self.tokens.pop(token, None)
                    await self._release(conn)

    async def _end_socket(self, conn: Connection, message: str, code: int, reason: str) -> None:
        """Close a socket's session, then tell the client why and close the socket."""
        await self._release(conn)
        ws = conn.websocket
        if ws is not None and ws.application_state == WebSocketState.CONNECTED:
            with contextlib.suppress(Exception):
                await ws.send_text(error_text(SESSION_ERROR, message))
                await ws.close(code=code, reason=reason)

    async def _release(self, conn: Connection) -> None:
        """Close the connection's runtime session (idempotent; never raises). Under the
        connection's lock, as a step or a reset: a step in flight finishes first, and no path
        closes an episode another is using."""
        conn.closed = True
        self.connections.discard(conn)
        async with conn.lock:
            await self.episodes.close(conn)

    # HTTP routes ------------------------------------------------------------------------------

    async def live(self, request: Request) -> Response:
        """Liveness: the process answers, draining or not (a drain must not look like a hang)."""
        return JSONResponse({"status": "draining" if self.draining else "healthy"})

    async def health(self, request: Request) -> Response:
        if self.draining:  # readiness: out of the Service while open episodes finish
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "healthy"})

    async def metadata(self, request: Request) -> Response:
        return JSONResponse(
            {
                "name": self.config.name,
                "description": "CodeGym tool-use environments served by a CodeGym runtime; reset with a "
                f"training instance's ability ({ABILITY_FORMAT}) or env + config, then call tools.",
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
        return JSONResponse(await self.mcp(rpc, None, tenant_of(caller(request.scope))))

    # JSON-RPC (tools/list, tools/call, openenv/session/create|close) ---------------------------

    async def mcp(self, rpc: Any, conn: Connection | None, tenant: str = "") -> dict[str, Any]:
        """One JSON-RPC call, on a socket (`conn`) or over HTTP by `tenant`, whose MCP session
        tokens are the only ones it can name (another tenant's is unknown to it)."""
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
            if self.draining:
                return rpc_error(rid, -32000, "CAPACITY_REACHED: DRAINING: the gateway is shutting down")
            if len(self.tokens) >= self.config.max_mcp_tokens:
                return rpc_error(rid, -32000, "CAPACITY_REACHED: too many open MCP sessions")
            token = uuid.uuid4().hex
            self.tokens[token] = Connection(websocket=None, token=token, tenant=tenant)
            return rpc_result(rid, {"session_id": token})
        if method == "openenv/session/close":
            return await self._close_token(rid, str(params.get("session_id", "")), conn, tenant)
        if conn is None:
            conn = self.tokens.get(str(params.get("session_id", "")))
            if conn is None or conn.tenant != tenant:
                return rpc_error(rid, -32602, f"Unknown session_id: {params.get('session_id')!r}")
        conn.last_active = time.monotonic()
        if method == "tools/list":
            try:
                tools = await self.episodes.listed_tools(conn)
            except GatewayError as exc:
                return rpc_error(rid, -32000, f"{exc.code}: {exc}")
            listed = [{**t, "inputSchema": t["input_schema"]} for t in tools]
            return rpc_result(rid, {"tools": listed})
        if method == "tools/call":
            name, arguments = params.get("name"), params.get("arguments") or {}
            if not isinstance(name, str) or not isinstance(arguments, dict):
                return rpc_error(rid, -32602, "tools/call needs a name (string) and arguments (object)")
            try:
                async with conn.lock:
                    data = await self.episodes.step(conn, {"name": name, "parameters": arguments}, name)
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

    async def _close_token(
        self, rid: Any, token: str, caller: Connection | None, tenant: str
    ) -> dict[str, Any]:
        """`openenv/session/close`, as OpenEnv's server answers it: a session attached to a socket
        closes with that socket (its token is gone at once); a detached one closes now, under its
        lock, so a `tools/call` in flight on it finishes first."""
        target = self.tokens.get(token)
        if target is None or target.tenant != (caller.tenant if caller is not None else tenant):
            return rpc_error(rid, -32602, f"Unknown session_id: {token!r}")
        if target is caller:
            return rpc_error(rid, -32600, "Cannot close active WebSocket-managed session via MCP method")
        self.tokens.pop(token, None)
        if target.websocket is not None:
            return rpc_result(rid, {"session_id": token, "closed": False, "closing": True})
        await self._release(target)
        return rpc_result(rid, {"session_id": token, "closed": True})

    # WebSocket ----------------------------------------------------------------------------------

    async def websocket(self, ws: WebSocket) -> None:
        if self.draining:  # refused at the handshake: the client connects to another replica
            metrics.ERRORS.labels(CAPACITY_REACHED).inc()
            try:
                await ws.send_denial_response(
                    JSONResponse(
                        {"error": "the gateway is shutting down: connect again", "code": CAPACITY_REACHED},
                        status_code=503,
                    )
                )
            except RuntimeError:  # a server without the denial-response extension: 403
                await ws.close(code=1013)
            return
        await ws.accept()
        tenant = tenant_of(caller(ws.scope))
        token = ws.query_params.get("session_id", "")
        if token:
            conn = self.tokens.get(token)
            if conn is None or conn.websocket is not None or conn.closed or conn.tenant != tenant:
                owned = conn is not None and not conn.closed and conn.tenant == tenant
                why = "already attached" if owned else "unknown"
                await ws.send_text(error_text(SESSION_ERROR, f"session_id {token!r} is {why}"))
                await ws.close()
                return
            conn.websocket = ws
        else:
            conn = Connection(websocket=ws, tenant=tenant)
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
                    return reply("observation", await self.episodes.reset(conn, data))
                case "step":
                    if not isinstance(data, dict):
                        raise GatewayError(VALIDATION_ERROR, "step data must be an action object")
                    return reply("observation", await self.episodes.act(conn, data))
                case "state":
                    return reply("state", self.episodes.state(conn))
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


KNOWN_TYPES = frozenset({"reset", "step", "state", "close", "mcp"})


def tenant_of(identity: Identity | None) -> str:
    """The tenant a request speaks for ("" when the gateway takes no tokens)."""
    return identity.tenant if identity is not None else ""

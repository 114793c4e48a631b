"""Access tokens at the OpenEnv gateway (issue #31): `Authorization: Bearer <token>` on every HTTP
request and on the WebSocket handshake, which is what OpenEnv's clients send when built with
`headers={"Authorization": f"Bearer {token}"}` (`EnvClient`, `GenericEnvClient`, `MCPToolClient`).

The tokens are the gRPC servers' (`codegym.server.auth.ServerAuth`: `--tokens FILE`/`CODEGYM_TOKENS_FILE`
and `--token`/`CODEGYM_TOKEN`), checked the same way:

- no token, or one the gateway does not know: HTTP 401 (a WebSocket handshake is refused with 401,
  or, where the server cannot send a denial response, closed with 1008 and the reason);
- a known token whose role may not play episodes (`GATEWAY_ROLES`: a server's own `service` token
  is not a trainer's): HTTP 403;
- otherwise the request goes on, its `Identity` in the scope (`caller`), so an MCP session token
  serves only the tenant that opened it.

The probes (`/health`, `/live`) stay open: Kubernetes sends no token. With no tokens configured,
nothing is checked (`codegym.server.auth.check_bind` refuses that beyond loopback unless `--insecure`).
The gateway's own calls to the runtime carry its token through the one channel factory
(`codegym_client.channels`: `CODEGYM_TOKEN`, the service token under `codegym up --auth` and in k8s),
and name the caller's tenant (`services/fronting.py`), so the runtime's quotas and session ownership hold
per trainer behind the gateway.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocket

from codegym.server.auth import OPERATOR, TRAINER, Identity, bearer

# Who may play episodes through the gateway: it fronts the runtime for trainers (and operators).
GATEWAY_ROLES = frozenset({TRAINER, OPERATOR})
# The probes: answered without a token.
OPEN_PATHS = frozenset({"/health", "/live"})
# Where the middleware leaves the caller for the routes.
CALLER_KEY = "codegym.caller"
HOW = (
    "send the header `Authorization: Bearer TOKEN` (OpenEnv: EnvClient(base_url, headers={'Authorization': "
    "'Bearer ' + token})); `codegym up --auth` prints a trainer's token"
)


class Refused(Exception):
    """A request the gateway does not serve: `status` is 401 (who are you?) or 403 (not you)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def identify(tokens: Mapping[str, Identity], authorization: str) -> Identity | None:
    """The caller named by an `Authorization` header (None: the gateway takes no tokens)."""
    if not tokens:
        return None
    token = bearer((("authorization", authorization),))
    identity = tokens.get(token) if token else None
    if identity is None:
        what = (
            "carries no access token" if not token else "carries an access token this gateway does not know"
        )
        raise Refused(401, f"the request {what}: {HOW}")
    if identity.role not in GATEWAY_ROLES:
        raise Refused(
            403,
            f"the OpenEnv gateway does not take a {identity.role}'s access token (tenant {identity.tenant}); "
            f"it takes {' or '.join(sorted(GATEWAY_ROLES))} tokens",
        )
    return identity


def caller(scope: Scope) -> Identity | None:
    """The identity the middleware found for this request (None: auth off)."""
    found: Identity | None = scope.get(CALLER_KEY)
    return found


class RequireToken:
    """ASGI middleware: every HTTP request and WebSocket handshake but the probes' shows a token."""

    def __init__(self, app: ASGIApp, tokens: Mapping[str, Identity]) -> None:
        self.app = app
        self.tokens = dict(tokens)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or not self.tokens or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or ())
        try:
            scope[CALLER_KEY] = identify(self.tokens, headers.get(b"authorization", b"").decode("latin-1"))
        except Refused as refused:
            await refuse(scope, receive, send, refused)
            return
        await self.app(scope, receive, send)


async def refuse(scope: Scope, receive: Receive, send: Send, refused: Refused) -> None:
    code = "UNAUTHENTICATED" if refused.status == 401 else "PERMISSION_DENIED"
    extra: dict[str, Any] = {"WWW-Authenticate": "Bearer"} if refused.status == 401 else {}
    answer = JSONResponse({"error": str(refused), "code": code}, status_code=refused.status, headers=extra)
    if scope["type"] == "http":
        await answer(scope, receive, send)
        return
    ws = WebSocket(scope, receive, send)
    try:
        await ws.send_denial_response(answer)
    except RuntimeError:  # a server without the denial-response extension: a close with the reason
        await ws.close(code=1008, reason=f"{code}: {refused}"[:120])

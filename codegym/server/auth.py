"""Access tokens and TLS for every gRPC server (runtime, sandbox worker, synthesis, verification).

A server given tokens checks each call's `authorization: Bearer <token>` metadata (what a client's
call credentials send, `codegym_client.channels.Access`) before its handler runs:

- no token, or one the server does not know: UNAUTHENTICATED, saying which setting is missing;
- a known token whose role may not call this service: PERMISSION_DENIED (`ROLES_BY_SERVICE`: a
  trainer's token never reaches a sandbox worker, whatever the network lets through);
- otherwise the handler runs with the caller's `Identity` in `CALLER` (a tenant, for quotas). A
  front end on a service or operator token (the OpenEnv gateway) names the tenant it plays for in
  `codegym-tenant` metadata, and the call runs as that tenant's trainer (`forwarded`).

Health checks and reflection stay open: Kubernetes probes carry no token.

Tokens come from a JSON file, `{"tokens": {"<token>": {"tenant": "team-a", "role": "trainer"}}}`
(`--tokens FILE`, `CODEGYM_TOKENS_FILE`), and a single `CODEGYM_SERVER_TOKEN`, which is an
operator's (every role's calls; tenant `default`) unless the file says otherwise: one shared token
is the simple setup, a file the one with roles. `CODEGYM_TOKEN` is what a process sends; a server
still takes it too, with a warning, when it has no token of its own (`deprecated_token`). Roles:
`trainer` (the runtime), `operator` (everything: the pipeline, `sandbox run --target`, `library
oracle --sandbox`, a library replay) and `service` (the runtime's and verification's identity at the
workers).

Off by default; a server asked to bind an address other than loopback with no tokens refuses to
start unless told `--insecure` (`check_bind`).
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import json
import logging
import os
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from codegym.errors import REASON_TRAILER, Reason
from codegym.server import settings
from codegym.server.settings import SERVER_TOKEN_ENV, TOKENS_FILE_ENV
from codegym_client.channels import is_loopback
from codegym_client.defaults import TOKEN_ENV

log = logging.getLogger(__name__)
TRAINER, OPERATOR, SERVICE = "trainer", "operator", "service"
ROLES = (TRAINER, OPERATOR, SERVICE)
# Who may call which service. A service missing here takes operators only.
ROLES_BY_SERVICE: dict[str, frozenset[str]] = {
    "codegym.runtime.v1.RuntimeService": frozenset({TRAINER, OPERATOR, SERVICE}),
    # Workers run the code a caller sends: only the services that send library code, and operators.
    "codegym.sandbox.v1.SandboxService": frozenset({SERVICE, OPERATOR}),
    # Verification runs the code it is given in the workers; synthesis spends LLM calls.
    "codegym.verification.v1.VerificationService": frozenset({SERVICE, OPERATOR}),
    "codegym.synthesis.v1.SynthesisService": frozenset({SERVICE, OPERATOR}),
}
# Probes and tooling read these without a token.
OPEN_SERVICES = (
    "grpc.health.v1.Health",
    "grpc.reflection.v1alpha.ServerReflection",
    "grpc.reflection.v1.ServerReflection",
)
# A single token's identity when the tokens file does not name it.
SINGLE_TOKEN = ("default", OPERATOR)
# The metadata key a front end (the OpenEnv gateway) names its own caller's tenant with. A server
# honours it only from the roles in `FORWARDERS`: the call then runs as that tenant's trainer, so its
# quotas, its session ownership and the roles it may call are the trainer's, not the front end's. A
# trainer who sends it is still itself.
TENANT_METADATA = "codegym-tenant"
FORWARDERS = frozenset({SERVICE, OPERATOR})


@dataclass(frozen=True)
class Identity:
    """Who a token speaks for: a tenant (whose limits apply) and a role (what it may call)."""

    tenant: str
    role: str


@dataclass(frozen=True)
class TenantLimits:
    """What one tenant may hold and start, per runtime replica (0 = no limit): sessions open, steps
    per second and creates per second. Past one, its calls get CAPACITY with a retry-after; other
    tenants are not touched."""

    sessions: int = 0
    steps_per_s: float = 0.0
    creates_per_s: float = 0.0


# The caller of the RPC being served (None: the server takes no tokens).
CALLER: contextvars.ContextVar[Identity | None] = contextvars.ContextVar("codegym_caller", default=None)


@dataclass(frozen=True)
class ServerAuth:
    """What a server checks: tokens (none: auth off), its TLS certificate and key, and `insecure`
    (bind a non-loopback address without tokens anyway). `health_port`: a plain-text port serving
    `grpc.health.v1` only, for Kubernetes probes, which cannot speak TLS (-1: none)."""

    tokens: Mapping[str, Identity] = field(default_factory=dict)
    # Limits by tenant, from the tokens file's `tenants` (a tenant it does not name has none).
    limits: Mapping[str, TenantLimits] = field(default_factory=dict)
    tls_cert: bytes | None = None
    tls_key: bytes | None = None
    insecure: bool = False
    health_port: int = -1

    @property
    def enabled(self) -> bool:
        return bool(self.tokens)

    @classmethod
    def load(cls, access: settings.ServerAccess) -> ServerAuth:
        """From a server's access settings: its tokens file and its one token (`CODEGYM_SERVER_TOKEN`,
        else the deprecated `CODEGYM_TOKEN`), its TLS pair, a gRPC server's probes' port; a file or a
        key that cannot be read is a ValueError naming it."""
        tokens: dict[str, Identity] = {}
        limits: dict[str, TenantLimits] = {}
        if access.tokens:
            tokens.update(read_tokens(Path(access.tokens)))
            limits = read_limits(Path(access.tokens))
        token = (access.server_token or deprecated_token(tokens)).strip()
        if token and token not in tokens:
            tokens[token] = Identity(*SINGLE_TOKEN)
        if bool(access.tls_cert) != bool(access.tls_key):
            raise ValueError("TLS needs both --tls-cert and --tls-key")
        cert = read_file(access.tls_cert, "--tls-cert") if access.tls_cert else None
        key = read_file(access.tls_key, "--tls-key") if access.tls_key else None
        health_port = access.health_port if isinstance(access, settings.GrpcAccess) else -1
        return cls(tokens, limits, cert, key, access.insecure, health_port)


def deprecated_token(known: Mapping[str, Identity]) -> str:
    """`CODEGYM_TOKEN` as a token this server takes, as before `CODEGYM_SERVER_TOKEN` existed: taken,
    with a one-line warning, unless the tokens file names it already (then it is only what this
    server sends, as `CODEGYM_TOKEN` is meant)."""
    token = os.environ.get(TOKEN_ENV, "").strip()
    if not token or token in known:
        return ""
    log.warning(
        "%s as a token this server takes is deprecated: it is what a process sends; set %s (or --tokens FILE)",
        TOKEN_ENV,
        SERVER_TOKEN_ENV,
    )
    return token


def read_file(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read {what} {path}: {exc.strerror or exc}") from None


def read_tokens(path: Path) -> dict[str, Identity]:
    """The tokens file: `{"tokens": {"<token>": {"tenant": "...", "role": "trainer|operator|service"}}}`."""
    try:
        data = json.loads(path.read_text())
        entries = data["tokens"]
        if not isinstance(entries, dict):
            raise TypeError("`tokens` is not an object")
        tokens = {}
        for token, entry in entries.items():
            role = entry.get("role", TRAINER)
            if role not in ROLES:
                raise ValueError(f"role {role!r} is not one of {', '.join(ROLES)}")
            if not str(token).strip():
                raise ValueError("an empty token")
            tokens[str(token).strip()] = Identity(str(entry.get("tenant") or "default"), role)
    except OSError as exc:
        raise ValueError(f"cannot read the tokens file {path}: {exc.strerror or exc}") from None
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise ValueError(
            f'the tokens file {path} is not {{"tokens": {{TOKEN: {{"tenant": ..., "role": ...}}}}}}: {exc}'
        ) from None
    return tokens


def read_limits(path: Path) -> dict[str, TenantLimits]:
    """The tokens file's optional `tenants`: `{"team-a": {"sessions": 512, "steps_per_s": 200,
    "creates_per_s": 20}}` (a field left out, or 0, is no limit)."""
    try:
        entries = json.loads(path.read_text()).get("tenants") or {}
        if not isinstance(entries, dict):
            raise TypeError("`tenants` is not an object")
        limits = {}
        for tenant, entry in entries.items():
            unknown = set(entry) - {"sessions", "steps_per_s", "creates_per_s"}
            if unknown:
                raise ValueError(f"tenant {tenant!r}: unknown limits {sorted(unknown)}")
            limit = TenantLimits(
                int(entry.get("sessions", 0)),
                float(entry.get("steps_per_s", 0)),
                float(entry.get("creates_per_s", 0)),
            )
            if min(limit.sessions, limit.steps_per_s, limit.creates_per_s) < 0:
                raise ValueError(f"tenant {tenant!r}: a negative limit")
            limits[str(tenant)] = limit
    except OSError as exc:
        raise ValueError(f"cannot read the tokens file {path}: {exc.strerror or exc}") from None
    except (ValueError, TypeError, AttributeError) as exc:
        raise ValueError(
            f'the tokens file\'s "tenants" in {path} is not {{TENANT: {{"sessions": N, "steps_per_s": X, '
            f'"creates_per_s": Y}}}}: {exc}'
        ) from None
    return limits


def write_tokens(path: Path, tokens: Mapping[str, Identity]) -> None:
    """Write a tokens file readable by its owner only (0600, created so: never briefly wider)."""
    body = {"tokens": {t: {"tenant": i.tenant, "role": i.role} for t, i in tokens.items()}}
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(json.dumps(body, indent=2) + "\n")
    os.chmod(path, 0o600)


def new_token() -> str:
    return "cg_" + secrets.token_urlsafe(24)


def local_tokens(path: Path) -> dict[str, str]:
    """`codegym up --auth`'s tokens, by role: the file at `path` when it holds one of each (so a
    token a trainer exported keeps working across restarts), else new ones written there."""
    with contextlib.suppress(ValueError):
        found = {identity.role: token for token, identity in read_tokens(path).items()}
        if set(found) == set(ROLES):
            return found
    made = {role: new_token() for role in ROLES}
    write_tokens(path, {token: Identity("local", role) for role, token in made.items()})
    return made


class InsecureBind(OSError):
    """A server asked to listen beyond this machine with nothing checking its callers."""


def check_bind(host: str, auth: ServerAuth) -> None:
    if auth.enabled or auth.insecure or is_loopback(host):
        return
    raise InsecureBind(
        f"refusing to serve on {host} without access tokens: give --tokens FILE (or {TOKENS_FILE_ENV}) "
        f"or {SERVER_TOKEN_ENV}, or --insecure to serve every caller that can reach the port"
    )


def metadata_value(metadata: Any, key: str) -> str:
    """The first value of `key` in a call's metadata ("" when it has none)."""
    for name, value in metadata or ():
        if name == key:
            return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    return ""


def forwarded(identity: Identity, metadata: Any) -> Identity:
    """The identity a call runs as: the tenant a forwarding front end names for its caller (as that
    tenant's trainer), else the token's own."""
    tenant = metadata_value(metadata, TENANT_METADATA).strip()
    if tenant and identity.role in FORWARDERS:
        return Identity(tenant[:128], TRAINER)
    return identity


def bearer(metadata: Any) -> str:
    """The token of an `authorization: Bearer <token>` entry ("" when there is none)."""
    for key, value in metadata or ():
        if key == "authorization":
            text = value.decode("ascii", "replace") if isinstance(value, bytes) else str(value)
            scheme, _, token = text.partition(" ")
            if scheme.lower() == "bearer":
                return token.strip()
    return ""


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Checks every call's access token against `tokens` and its role against the service's."""

    def __init__(self, tokens: Mapping[str, Identity]) -> None:
        self.tokens = dict(tokens)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method
        service = method.lstrip("/").split("/", 1)[0]
        if handler is None or service in OPEN_SERVICES:
            return handler
        token = bearer(handler_call_details.invocation_metadata)
        identity = self.tokens.get(token) if token else None
        if identity is None:
            what = (
                "carries no access token"
                if not token
                else "carries an access token this server does not know"
            )
            return refusing(
                handler,
                Reason.UNAUTHENTICATED,
                f"{method} {what}: set {TOKEN_ENV} or --token (codegym up --auth prints one)",
            )
        identity = forwarded(identity, handler_call_details.invocation_metadata)
        allowed = ROLES_BY_SERVICE.get(service, frozenset({OPERATOR}))
        if identity.role not in allowed:
            return refusing(
                handler,
                Reason.PERMISSION_DENIED,
                f"{service} does not take a {identity.role}'s access token (tenant {identity.tenant}); "
                f"it takes {' or '.join(sorted(allowed))} tokens",
            )
        return as_caller(handler, identity)


def refusing(handler: grpc.RpcMethodHandler, reason: Reason, message: str) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s shape that answers `reason` with `message` and runs nothing."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> Any:
        context.set_trailing_metadata(((REASON_TRAILER, reason.name),))
        await context.abort(reason.code, message)

    async def refuse_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await refuse(request, context)
        yield  # pragma: no cover - abort raised

    return shaped(handler, refuse, refuse_stream)


def as_caller(handler: grpc.RpcMethodHandler, identity: Identity) -> grpc.RpcMethodHandler:
    """`handler` with `CALLER` set to `identity` while it runs."""

    def unary(behavior: Callable[..., Any]) -> Callable[..., Any]:
        async def run(request: Any, context: grpc.aio.ServicerContext) -> Any:
            CALLER.set(identity)
            return await behavior(request, context)

        return run

    def stream(behavior: Callable[..., Any]) -> Callable[..., Any]:
        async def run(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            CALLER.set(identity)
            async for item in behavior(request, context):
                yield item

        return run

    return shaped(handler, None, None, unary, stream)


def shaped(
    handler: grpc.RpcMethodHandler,
    fixed: Callable[..., Any] | None,
    fixed_stream: Callable[..., Any] | None,
    unary: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None,
    stream: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None,
) -> grpc.RpcMethodHandler:
    """A handler like `handler` whose behavior is `fixed` (or `unary`/`stream` of its own)."""
    kinds = (
        ("unary_unary", grpc.unary_unary_rpc_method_handler, False),
        ("unary_stream", grpc.unary_stream_rpc_method_handler, True),
        ("stream_unary", grpc.stream_unary_rpc_method_handler, False),
        ("stream_stream", grpc.stream_stream_rpc_method_handler, True),
    )
    for name, make, streams in kinds:
        behavior = getattr(handler, name)
        if behavior is None:
            continue
        if fixed is not None:
            new = fixed_stream if streams else fixed
        elif streams and inspect.isasyncgenfunction(behavior):
            assert stream is not None
            new = stream(behavior)
        else:
            # A streaming handler may be a coroutine that writes with context.write.
            assert unary is not None
            new = unary(behavior)
        return make(
            new,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
    return handler

"""Server settings declared once: a settings dataclass says which of its fields are command-line
options (`option(...)`), and that one declaration adds the flags to a parser (`add_arguments`),
reads them back from the parsed arguments (`from_args`) and writes them as argv for a child process
(`to_argv`: `codegym up` and `codegym pipeline run` start their servers so).

A settings class may nest others (a field whose type is a settings dataclass): their options are
the parent's, flat on its command line. An option marked `secret` (an access token, an API key) is
never written to argv, which any local user can read: a child gets it through its own environment
(`env=`), where `from_args` finds it under the option's `env` name.

This module imports the standard library only: `codegym --help` builds every server's parser from
these declarations without loading gRPC.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from collections.abc import Callable, Collection
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any

from codegym_client.defaults import TLS_CA_ENV, TOKEN_ENV

# What a server takes: a tokens file, and one operator token. `CODEGYM_TOKEN` is what a process
# sends; a server took it too before these had names of their own (`auth.deprecated_token`).
TOKENS_FILE_ENV = "CODEGYM_TOKENS_FILE"
SERVER_TOKEN_ENV = "CODEGYM_SERVER_TOKEN"
LOOPBACK = "127.0.0.1"
OPTION = "codegym.option"


@dataclass(frozen=True)
class Option:
    """How one field is given: its flag ("" = only through `env`), help, and where else it is read."""

    flag: str
    help: str
    env: str = ""  # read when the flag is not given
    secret: bool = False  # never written to argv
    required: bool = False
    choices: tuple[Any, ...] | None = None
    metavar: str | None = None

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


def option(
    default: Any,
    flag: str,
    help: str,
    *,
    env: str = "",
    secret: bool = False,
    required: bool = False,
    choices: tuple[Any, ...] | None = None,
    metavar: str | None = None,
) -> Any:
    """A settings field that is a command-line option (see the module's docstring)."""
    meta = {OPTION: Option(flag, help, env, secret, required, choices, metavar)}
    if isinstance(default, list | dict):
        raise TypeError("option defaults are immutable (a tuple for a repeated option)")
    return field(default=default, metadata=meta)


def nested[S](cls: type[S]) -> Any:
    """A field holding a nested settings object (its options are the parent's)."""
    return field(default_factory=cls)


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _options(cls: type) -> list[tuple[dataclasses.Field[Any], Any, Option | None]]:
    hints = _hints(cls)
    return [(f, hints[f.name], f.metadata.get(OPTION)) for f in fields(cls)]


def _convert(kind: Any) -> Callable[[str], Any]:
    return kind if kind in (int, float) else str


def add_arguments(cls: type, parser: argparse.ArgumentParser, only: Collection[str] | None = None) -> None:
    """Add every option of `cls` (and of the settings it nests) to `parser`, or those whose dest
    is in `only` (a command that sets some of a server's options, as `codegym up` does)."""
    taken = {o for a in parser._actions for o in a.option_strings}
    for f, kind, opt in _options(cls):
        if is_dataclass(kind):
            add_arguments(typing.cast(type, kind), parser, only)
            continue
        if opt is None or not opt.flag or opt.flag in taken or (only is not None and opt.dest not in only):
            continue
        help = opt.help + (f" (${opt.env} when not given)" if opt.env else "")
        if kind is bool:
            parser.add_argument(opt.flag, dest=opt.dest, action="store_true", help=help)
            continue
        repeated = typing.get_origin(kind) is tuple
        item = typing.get_args(kind)[0] if repeated else kind
        parser.add_argument(
            opt.flag,
            dest=opt.dest,
            type=_convert(item),
            action="append" if repeated else "store",
            default=None if (opt.env or repeated) else f.default,
            required=opt.required,
            choices=opt.choices,
            metavar=opt.metavar,
            help=help,
        )


def from_args[S](cls: type[S], args: argparse.Namespace) -> S:
    """The settings `args` (parsed by a parser `add_arguments(cls, ...)` built) give, an option left
    out read from its environment variable, else its default."""
    values: dict[str, Any] = {}
    for f, kind, opt in _options(cls):
        if is_dataclass(kind):
            values[f.name] = from_args(typing.cast(type, kind), args)
            continue
        if opt is None:
            continue
        given = getattr(args, opt.dest, None) if opt.flag else None
        if given is None and opt.env and os.environ.get(opt.env):
            given = os.environ[opt.env] if kind is str else _convert(kind)(os.environ[opt.env])
        if given is None:
            continue
        values[f.name] = tuple(given) if typing.get_origin(kind) is tuple else given
    return cls(**values)


def to_argv(settings: object) -> list[str]:
    """The flags that make `from_args` give back `settings` (secrets left out: see the module's
    docstring); an option at its default is not written."""
    argv: list[str] = []
    assert is_dataclass(settings)
    for f, kind, opt in _options(type(settings)):
        value = getattr(settings, f.name)
        if is_dataclass(kind):
            argv += to_argv(value)
            continue
        if opt is None or not opt.flag or opt.secret:
            continue
        if f.default is not MISSING and value == f.default:
            continue
        if kind is bool:
            argv += [opt.flag] if value else []
        elif typing.get_origin(kind) is tuple:
            for item in value:
                argv += [opt.flag, str(item)]
        else:
            argv += [opt.flag, str(value)]
    return argv


def secrets_env(settings: object) -> dict[str, str]:
    """The environment a child needs for the secrets `to_argv` leaves out (by each option's `env`)."""
    env: dict[str, str] = {}
    assert is_dataclass(settings)
    for f, kind, opt in _options(type(settings)):
        value = getattr(settings, f.name)
        if is_dataclass(kind):
            env.update(secrets_env(value))
        elif opt is not None and opt.secret and opt.env and value:
            env[opt.env] = str(value)
    return env


def flags(cls: type) -> dict[str, str]:
    """Every option of `cls` (nested ones included), by argparse dest: its flag."""
    found: dict[str, str] = {}
    for _, kind, opt in _options(cls):
        if is_dataclass(kind):
            found.update(flags(typing.cast(type, kind)))
        elif opt is not None and opt.flag:
            found[opt.dest] = opt.flag
    return found


# ---- parts every server has ------------------------------------------------------------------------


def host() -> Any:
    return option(LOOPBACK, "--host", "address to bind")


def port(default: int) -> Any:
    return option(default, "--port", "port (0 = any free port)")


def log_level() -> Any:
    return option("INFO", "--log-level", "logging level")


@dataclass(frozen=True)
class Output:
    """Logs and metrics, which every server takes, the gateway included."""

    log_format: str = option(
        "text", "--log-format", "log lines for people or one JSON object each", choices=("text", "json")
    )
    metrics_port: int = option(
        -1, "--metrics-port", "serve Prometheus /metrics on this port (-1 = off, 0 = any)"
    )


@dataclass(frozen=True)
class Calls:
    """How a server calls the others (the runtime and verification the workers, the gateway the
    runtime): the token it sends and the CA it checks their certificates against."""

    token: str = option("", "--token", "access token sent to the servers called", env=TOKEN_ENV, secret=True)
    tls_ca: str = option(
        "",
        "--tls-ca",
        "CA certificate (PEM) the called servers' TLS certificates are checked against; turns TLS on "
        "(a grpcs:// target uses the system's CAs)",
        env=TLS_CA_ENV,
    )

    def access(self) -> Any:
        """The `codegym_client.channels.Access` of this server's channels."""
        from codegym_client.channels import Access

        return Access.from_values(self.token, self.tls_ca)


@dataclass(frozen=True)
class ServerAccess:
    """What a server takes: the tokens it accepts (a file, and one token from its environment), its
    TLS certificate, and whether it may serve a non-loopback address without tokens. Loaded (files
    read) by `codegym.server.auth.ServerAuth.load`."""

    tokens: str = option(
        "",
        "--tokens",
        'access tokens this server takes: a JSON file {"tokens": {TOKEN: {"tenant": NAME, "role": '
        'trainer|operator|service}}, "tenants": {...}}; without it (and without '
        f"${SERVER_TOKEN_ENV}, one operator token) every caller is served",
        env=TOKENS_FILE_ENV,
    )
    server_token: str = option(
        "", "", "one operator token this server takes", env=SERVER_TOKEN_ENV, secret=True
    )
    tls_cert: str = option("", "--tls-cert", "serve TLS with this certificate (PEM; with --tls-key)")
    tls_key: str = option("", "--tls-key", "the TLS certificate's private key (PEM)")
    insecure: bool = option(
        False, "--insecure", "bind an address other than loopback without access tokens (refused otherwise)"
    )


@dataclass(frozen=True)
class GrpcAccess(ServerAccess):
    """A gRPC server's access, with the plain-text port Kubernetes probes use (they cannot speak TLS)."""

    health_port: int = option(
        -1,
        "--health-port",
        "also serve grpc.health.v1 alone, in plain text, on this port (Kubernetes probes cannot speak TLS; -1 = off)",
    )


def sandbox_target(required: bool = True) -> Any:
    return option(
        "",
        "--sandbox",
        "sandbox workers: HOST:PORT[,HOST:PORT...] (IP literals) or one dns:///NAME:PORT",
        required=required,
    )

"""`--token` and `--tls-ca` for every command that calls a server, in one place.

Every command with a target option (`--target`, `--sandbox`, `--runtime`, ...) takes them; they
stand for `CODEGYM_TOKEN` and `CODEGYM_TLS_CA`, which the one channel factory
(`codegym_client.channels`) reads, so a flag reaches every channel the command opens, the servers'
own channels to the workers included.
"""

from __future__ import annotations

import argparse
import os

import grpc

from codegym_client.channels import TLS_CA_ENV, TOKEN_ENV
from codegym_client.errors import access_refused

TARGET_OPTIONS = ("--target", "--sandbox", "--runtime", "--synthesis", "--verification")


def refused(exc: BaseException) -> bool:
    """Whether `exc` is a server's refusal of the access token (typed by the client or raw)."""
    return access_refused(exc)


def refusal_line(exc: BaseException) -> str:
    assert isinstance(exc, grpc.RpcError)
    return f"{exc.code().name}: {exc.details()}"


def takes_target(parser: argparse.ArgumentParser) -> bool:
    return any(o in TARGET_OPTIONS for a in parser._actions for o in a.option_strings)


def add_client_arguments(parser: argparse.ArgumentParser) -> None:
    """`--token` and `--tls-ca`, unless the command already defines them."""
    taken = {o for a in parser._actions for o in a.option_strings}
    if "--token" not in taken:
        parser.add_argument(
            "--token",
            default=None,
            help=f"access token sent to the servers (${TOKEN_ENV} when not given); a server takes it too",
        )
    if "--tls-ca" not in taken:
        parser.add_argument(
            "--tls-ca",
            default=None,
            help=f"CA certificate (PEM) the servers' TLS certificates are checked against; turns TLS on "
            f"(${TLS_CA_ENV} when not given; a grpcs:// target uses the system's CAs)",
        )


def apply(args: argparse.Namespace) -> None:
    """Make the flags the process's settings (and its children's)."""
    token = getattr(args, "token", None)
    if token:
        os.environ[TOKEN_ENV] = token
    tls_ca = getattr(args, "tls_ca", None)
    if tls_ca:
        if not os.path.isfile(tls_ca):
            raise SystemExit(f"codegym: --tls-ca {tls_ca}: no such file")
        os.environ[TLS_CA_ENV] = tls_ca

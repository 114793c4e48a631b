"""`--token` and `--tls-ca` for every command that calls a server, in one place.

Every command with a target option (`--target`, `--sandbox`, `--runtime`, ...) takes them (a server
declares them on its settings, `codegym.server.settings.Calls`); they stand for `CODEGYM_TOKEN` and
`CODEGYM_TLS_CA`. A command reads them into one `codegym_client.channels.Access` (`client_access`),
which it hands to every channel it opens: nothing is written to the process's environment.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from codegym.server.settings import Calls, add_arguments, from_args

if TYPE_CHECKING:
    from codegym_client.channels import Access

TARGET_OPTIONS = ("--target", "--sandbox", "--runtime", "--synthesis", "--verification")


def refused(exc: BaseException) -> bool:
    """Whether `exc` is a server's refusal of the access token (typed by the client or raw)."""
    from codegym_client.errors import access_refused

    return access_refused(exc)


def refusal_line(exc: BaseException) -> str:
    import grpc

    assert isinstance(exc, grpc.RpcError)
    return f"{exc.code().name}: {exc.details()}"


def takes_target(parser: argparse.ArgumentParser) -> bool:
    return any(o in TARGET_OPTIONS for a in parser._actions for o in a.option_strings)


def add_client_arguments(parser: argparse.ArgumentParser) -> None:
    """`--token` and `--tls-ca` (`Calls`'s), unless the command already defines them."""
    add_arguments(Calls, parser)


def client_access(args: argparse.Namespace) -> Access:
    """The access every channel of this command uses: its flags, else the environment's."""
    calls = from_args(Calls, args)
    try:
        access: Access = calls.access()
    except ValueError as exc:
        raise SystemExit(f"codegym: {exc}") from None
    return access

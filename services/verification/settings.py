"""The verification server's settings (`VerificationSettings`), each option declared once; its
thresholds are request fields, not settings. Standard library only, for `codegym --help`."""

from __future__ import annotations

from dataclasses import dataclass

from codegym.server.settings import Calls, GrpcAccess, Output, host, log_level, nested, port, sandbox_target

VERIFICATION_PORT = 50081


@dataclass(frozen=True)
class VerificationSettings:
    """Everything `codegym serve verification` is told; `VerificationServer` takes it."""

    sandbox: str = sandbox_target()
    host: str = host()
    port: int = port(VERIFICATION_PORT)
    log_level: str = log_level()
    output: Output = nested(Output)
    access: GrpcAccess = nested(GrpcAccess)
    calls: Calls = nested(Calls)

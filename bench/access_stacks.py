"""The access bench's stacks (bench/access_bench.py): a client's token and CA in the environment,
a self-signed certificate, and the servers `up` would start, served over TLS with `up --auth`'s
tokens, started here (`up` has no TLS option).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from bench.common import start_process
from bench.stacks import Stack, StackSpec, make_sure_gone, tree_pids
from codegym.library.location import tokens_path
from codegym.procs import ServerProcess
from codegym.server.auth import SERVICE, TRAINER, local_tokens
from codegym.server.settings import TOKENS_FILE_ENV
from codegym_cli.up import build_default_library
from codegym_client.channels import TLS_CA_ENV, TOKEN_ENV
from sandbox_worker.residency import default_budget_mb


@contextlib.contextmanager
def client_env(token: str, tls_ca: str = "") -> Iterator[None]:
    """`CODEGYM_TOKEN` (and `CODEGYM_TLS_CA`) for the clients made inside the block, as a trainer
    exports them; never set while a stack starts (`up` would take them as its own)."""
    saved = {key: os.environ.get(key) for key in (TOKEN_ENV, TLS_CA_ENV)}
    os.environ[TOKEN_ENV] = token
    if tls_ca:
        os.environ[TLS_CA_ENV] = tls_ca
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def self_signed(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key (the certificate is its own CA), by `openssl`."""
    cert, key = folder / "tls-cert.pem", folder / "tls-key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


@contextlib.contextmanager
def tls_stack(spec: StackSpec, cert: Path, key: Path) -> Iterator[tuple[Stack, str]]:
    """2 workers and a runtime serving TLS with `up --auth`'s tokens: (the stack, a trainer token)."""
    with contextlib.redirect_stdout(sys.stderr):
        build_default_library(spec.library)
    tokens = local_tokens(tokens_path(spec.library))
    env = dict(spec.env)
    env.update(
        {TOKENS_FILE_ENV: str(tokens_path(spec.library)), TOKEN_ENV: tokens[SERVICE], TLS_CA_ENV: str(cert)}
    )
    serve = ["-m", "codegym_cli.cli", "serve"]
    flags = ["--host", "127.0.0.1", "--port", "0", "--tls-cert", str(cert), "--tls-key", str(key)]
    servers: list[ServerProcess] = []
    try:
        with open(spec.log, "ab") as log:

            def start(name: str, args: list[str]) -> ServerProcess:
                server = start_process([*serve, *args, *flags], name=name, env=env, cwd=spec.tree,
                                       stderr=log.fileno(), keep=200, timeout_s=120)  # fmt: skip
                servers.append(server)
                return server

            for i in range(2):  # as `up --workers 2`: each its share of the resident budget
                budget = str(default_budget_mb(2))
                start(f"tls worker {i + 1}", ["sandbox", "--jails", "2", "--resident-memory-mb", budget])
            sandbox = ",".join(s.address for s in servers)
            runtime = start("tls runtime", ["runtime", "--library", str(spec.library), "--sandbox", sandbox])
            # Servers this process started itself: `cpu_by_role` finds them among its own children.
            yield Stack(runtime, root_pid=os.getpid()), tokens[TRAINER]
    finally:
        pids = set().union(*(tree_pids(s.pid) for s in servers))
        for server in reversed(servers):
            server.stop()
        make_sure_gone(pids, "tls stack")

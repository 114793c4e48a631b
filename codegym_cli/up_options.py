"""`codegym up`: sandbox workers and a runtime on loopback, as child processes, until Ctrl-C.

Each server runs as its own process (as it would in a cluster) under a small supervisor: a server
that dies is started again on the same port, after a back-off, while the others keep serving
(the runtime's channel finds a restarted worker by itself, and re-runs a lost step on another
worker). The private `redis-server` that `--runtimes 2` starts is supervised the same way: it keeps
an append-only file in a folder beside the library (`library.redis/`, or `--redis-dir`), and starts
again on its port and folder with every session and the episode record as they were (the runtimes
answer UNAVAILABLE meanwhile, which the clients send again). The set stops on Ctrl-C/SIGTERM, or
when a server dies too often to be kept up. However this command ends (SIGKILL and OOM kills
included), every process it started ends with it: each child has `PR_SET_PDEATHSIG`, and a
worker's jails die with the worker (see `codegym.procs`).

OpenEnv gateways (`codegym serve openenv`) in front of the first runtime: `--openenv-port` starts
the multi-environment one (resets name their environment), and each `--openenv-env ENV_ID[=PORT]`
a one-environment gateway (`--env ENV_ID`, what verifiers' OpenEnvEnv needs: its tools are listed
before any reset), each on its own port and printed with its address.
"""

from __future__ import annotations

import argparse

from codegym.server.settings import (
    Calls,
    ServerAccess,
    add_arguments,
)
from codegym_cli.later import later
from sandbox_worker.settings import SandboxSettings
from services.runtime.settings import RuntimeSettings

# Which server options `up` passes through to its servers, by server (the rest are up's own).
# The resident idle time and mortal preloads too: what a step's CPU and a resident's memory are
# traded on, so a stack of `up` can be measured with either changed (rollout_bench --alternate).
# And the caches of sources and compiled code: what a library larger than them pays in compiles.
SANDBOX_OPTIONS = (
    "jails",
    "jail_nice",
    "resident_memory_mb",
    "resident_idle_s",
    "mortal_preloads",
    "source_cache_mb",
    "code_cache_mb",
)
# The capture options too: what the runtimes capture and keep (docs/console.md), so a stack of `up`
# can run with captures off or bounded small (bench/rollout_bench.py --alternate, bench/soak.py).
RUNTIME_OPTIONS = (
    "library",
    "host",
    "port",
    "sessions",
    "no_record",
    "checkpoint_key",
    "capture",
    "no_capture",
    "capture_bytes",
)
ACCESS_OPTIONS = ("insecure", "tls_cert", "tls_key")
CALLS_OPTIONS = ("tls_ca",)


def register(sub: argparse._SubParsersAction) -> None:
    up = sub.add_parser(
        "up",
        help="run sandbox workers and the runtime on loopback until Ctrl-C",
        description=__doc__,
    )
    # The servers' own options, declared on their settings (help as `codegym serve ... --help` says).
    add_arguments(RuntimeSettings, up, RUNTIME_OPTIONS)
    add_arguments(SandboxSettings, up, SANDBOX_OPTIONS)
    add_arguments(ServerAccess, up, ACCESS_OPTIONS)
    add_arguments(Calls, up, CALLS_OPTIONS)
    # up's own.
    up.add_argument("--workers", type=int, default=2, help="sandbox worker processes")
    up.add_argument(
        "--runtimes", type=int, default=1, help="runtime replicas (more than one share sessions in Redis)"
    )
    up.add_argument(
        "--redis-dir",
        default="",
        help="where the private redis-server of --runtimes > 1 keeps its append-only file "
        "(default: beside the library, LIBRARY.redis/)",
    )
    up.add_argument(
        "--auth",
        action="store_true",
        help="access tokens on every server: a trainer's token is printed (export CODEGYM_TOKEN=...), the "
        "operator's and the services' are kept in LIBRARY.tokens.json (0600) beside the library",
    )
    up.add_argument(
        "--sandbox-port", type=int, default=0, help="first sandbox worker port (0 = any free ports)"
    )
    up.add_argument(
        "--openenv-port",
        type=int,
        default=-1,
        help="also start the OpenEnv gateway (codegym serve openenv) on this port (-1 = off, 0 = any free port)",
    )
    up.add_argument(
        "--openenv-env",
        action="append",
        default=[],
        metavar="ENV_ID[=PORT]",
        help="also start a one-environment OpenEnv gateway (codegym serve openenv --env ENV_ID) on PORT "
        "(default: any free port), as verifiers' OpenEnvEnv needs; repeat for more environments",
    )
    up.add_argument(
        "--console-port",
        type=int,
        default=-1,
        help="also start the web console (codegym console) on this port (-1 = off, 0 = any free port); "
        "with --auth people sign in with a trainer's or the operator's token (docs/console.md)",
    )
    up.set_defaults(func=later("codegym_cli.up", "cmd_up"))

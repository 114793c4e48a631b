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
import fcntl
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TextIO

from codegym.library.store import Library, default_library_path
from codegym.procs import RedisServer, ServerProcess, codegym_command
from codegym.samples import ENVS, TASKS
from codegym.server.auth import SERVICE, TOKENS_FILE_ENV, TRAINER, ServerAuth, check_bind, local_tokens
from codegym.server.grpcutil import wait_serving
from codegym_cli.serve_sandbox import add_jail_nice
from codegym_client.channels import TLS_CA_ENV, TOKEN_ENV
from sandbox_worker.limits import unreachable_by_jails
from sandbox_worker.residency import default_budget_mb

GATEWAY_STOP_S = 45.0  # a gateway's default --grace-s (30 s) and its closing, before SIGKILL
CHILD_STOP_S = 20.0  # a runtime's or worker's drain (5 s) and close, before SIGKILL


def build_default_library(path: Path) -> None:
    """The sample environments and their task configs, imported on first run.

    An install without them (package data dropped by a broken build) must not leave an empty
    library behind: that file would be taken as built on every later run."""
    if not ENVS.is_dir() or not TASKS.is_file():
        raise SystemExit(
            f"codegym up: no library at {path}, and this install has no sample environments ({ENVS})"
        )
    with Library(path) as library:
        report = library.import_paths([ENVS, TASKS])
        envs, tasks = library.counts()
    if not envs:
        path.unlink(missing_ok=True)
        raise SystemExit(f"codegym up: no sample environment could be imported from {ENVS}: {report.skipped}")
    print(f"built library {path}: {envs} environments, {tasks} task configs", flush=True)
    for where, reason in report.skipped:
        print(f"  skipped {where}: {reason}", flush=True)


class Child(ServerProcess):
    """One server process (`codegym ARGS...`), started again by the supervisor with the same args.

    Its stderr is this command's (the servers' logs and their one-line reasons for not starting
    reach the operator as they are); its stdout after the ready line is copied to ours.
    """

    def __init__(self, name: str, args: list[str], timeout_s: float = 60.0) -> None:
        self.args = args
        super().__init__(
            codegym_command(args),
            name=name,
            timeout_s=timeout_s,
            stderr=None,
            echo=sys.stdout,
            keep=200,
            stacks=True,
        )

    def again(self) -> Child:
        """The same server started again on the port it had (the others know it by that port)."""
        argv = list(self.args)
        argv[argv.index("--port") + 1] = self.address.rsplit(":", 1)[1]
        return Child(self.name, argv)


class Supervised(Protocol):
    """What the supervisor keeps up: a `Child` or the private `RedisServer`."""

    name: str
    address: str
    proc: subprocess.Popen[str]
    killed: bool

    def again(self) -> Supervised: ...

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 20.0) -> int | None: ...


# The one redis-server starter (the tests use it too); `bench/scale_bench.py` imports this name.
PrivateRedis = RedisServer


def lock_redis_folder(folder: Path) -> TextIO:
    """Hold `folder`, where the private redis-server keeps its append-only file, for this `codegym
    up` until the returned file is closed: two servers writing one file would corrupt it."""
    folder.mkdir(parents=True, exist_ok=True)
    lock = (folder / "codegym-up.lock").open("w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise SystemExit(
            f"codegym up: another codegym up keeps its Redis in {folder}; give this one --redis-dir"
        ) from None
    return lock


def env_gateways(specs: list[str], library: Path) -> list[tuple[str, int]]:
    """`--openenv-env ENV_ID[=PORT]` values as (environment, port; 0 = any free port), each
    environment checked against the library so a typo fails here, not at a trainer's first reset."""
    gateways: list[tuple[str, int]] = []
    with Library(library) as lib:
        for spec in specs:
            env_id, _, port = spec.partition("=")
            if not port.isdigit() and port:
                raise SystemExit(f"codegym up: --openenv-env {spec!r}: expected ENV_ID or ENV_ID=PORT")
            if lib.get(env_id) is None:
                raise SystemExit(f"codegym up: --openenv-env {env_id!r} is not in the library {library}")
            if any(env_id == seen for seen, _ in gateways):
                raise SystemExit(f"codegym up: --openenv-env {env_id!r} is given twice")
            gateways.append((env_id, int(port or 0)))
    return gateways


class Supervisor:
    """Restarts dead servers on their own port, with back-off; gives up past a restart budget.

    The back-off and the budget count a server's restarts in the last `window_s` while it keeps
    dying within `settled_s` of its start (a crash loop); one that served that long and then died
    (killed, OOM) is started again at once, its history forgotten.
    """

    def __init__(
        self,
        children: list[Supervised],
        *,
        max_restarts: int = 5,
        window_s: float = 60.0,
        settled_s: float = 10.0,
    ) -> None:
        self.children = children
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.settled_s = settled_s
        self.restarts: dict[str, list[float]] = {}
        self.since = time.monotonic()  # the servers were started just before
        self.started: dict[str, float] = {}

    def check(self) -> str:
        """Restart what died; return why the set must stop ("" to go on)."""
        for i, child in enumerate(self.children):
            code = child.proc.poll()
            if code is None:
                continue
            now = time.monotonic()
            if now - self.started.get(child.name, self.since) >= self.settled_s:
                self.restarts.pop(child.name, None)
            recent = [t for t in self.restarts.get(child.name, []) if now - t < self.window_s]
            if len(recent) >= self.max_restarts:
                return f"{child.name} exited with {code} {len(recent) + 1} times in {self.window_s:.0f} s"
            # At once the first time (an outage as short as a start: Redis's is about what the
            # clients' own resends cover), then 0.5 s doubling up to 8 s.
            delay = min(0.25 * 2 ** len(recent), 8.0) if recent else 0.0
            when = f"in {delay:.1f} s" if delay else "now"
            print(f"codegym up: {child.name} exited with {code}; restarting {when}", flush=True)
            time.sleep(delay)
            self.started[child.name] = time.monotonic()
            try:
                self.children[i] = child.again()
            except RuntimeError as exc:
                print(f"codegym up: {exc}", flush=True)
                self.restarts[child.name] = [*recent, now]
                return self.check()
            self.restarts[child.name] = [*recent, now]
            print(
                f"codegym up: {child.name} back at {self.children[i].address} (pid {self.children[i].proc.pid})",
                flush=True,
            )
        return ""


def configure_access(args: argparse.Namespace, library: Path) -> list[str]:
    """`--auth`: every server takes the tokens of a 0600 file beside the library (made on first use,
    then kept, so an exported trainer token stays good), and calls the others with the service
    token; both reach the children through their environment, never their command line (which any
    user can read). Without it, no server takes or sends a token, whatever this shell exported.

    `--tls-cert`/`--tls-key`: every server (the gateways included) serves TLS with them, and calls
    the others trusting `--tls-ca` (default: the certificate itself, as a self-signed one is its own
    CA). The flags every server gets are returned (`--insecure`, the TLS pair)."""
    os.environ.pop(TOKEN_ENV, None)
    os.environ.pop(TOKENS_FILE_ENV, None)
    os.environ.pop(TLS_CA_ENV, None)
    if args.auth:
        path = library.with_name(f"{library.stem}.tokens.json")
        tokens = local_tokens(path)
        os.environ[TOKENS_FILE_ENV] = str(path)
        os.environ[TOKEN_ENV] = tokens[SERVICE]
        print(
            f"access tokens on: a trainer's token (use it with every client and codegym command):\n"
            f"  export {TOKEN_ENV}={tokens[TRAINER]}\n"
            f"  the operator's token (sandbox run --target, library oracle --sandbox, library replay) "
            f"and the services' are in {path} (mode 0600)",
            flush=True,
        )
    elif not args.insecure:
        check_bind(args.host, ServerAuth())
    flags = ["--insecure"] if args.insecure else []
    if bool(args.tls_cert) != bool(args.tls_key):
        raise SystemExit("codegym up: TLS needs both --tls-cert and --tls-key")
    if args.tls_cert:
        cert, key = Path(args.tls_cert).resolve(), Path(args.tls_key).resolve()
        ca = Path(args.tls_ca).resolve() if args.tls_ca else cert
        for what, path in (("--tls-cert", cert), ("--tls-key", key), ("--tls-ca", ca)):
            if not path.is_file():
                raise SystemExit(f"codegym up: {what} {path} is not a readable file")
        os.environ[TLS_CA_ENV] = str(ca)
        flags += ["--tls-cert", str(cert), "--tls-key", str(key)]
        print(
            f"TLS on every server: clients trust the servers' CA with\n  export {TLS_CA_ENV}={ca}",
            flush=True,
        )
    return flags


def cmd_up(args: argparse.Namespace) -> int:
    unreachable = unreachable_by_jails() if args.workers else ""  # the workers run this interpreter
    if unreachable:
        raise SystemExit(f"codegym up: {unreachable}")
    library = Path(args.library)
    if not library.exists():
        build_default_library(library)
    one_env = env_gateways(args.openenv_env, library)
    children: list[Supervised] = []
    cleanup: list[Callable[[], object]] = []
    stopping = []

    def on_signal(signum: int, frame: object) -> None:
        stopping.append(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server_flags = configure_access(args, library)
    try:
        private_redis = args.runtimes > 1 and not args.sessions
        redis_dir = Path(args.redis_dir) if args.redis_dir else library.with_name(f"{library.stem}.redis")
        if private_redis:  # before any server starts
            cleanup.append(lock_redis_folder(redis_dir).close)
        for i in range(args.workers):
            port = args.sandbox_port + i if args.sandbox_port else 0
            worker_args = [
                "serve",
                "sandbox",
                "--host",
                args.host,
                "--port",
                str(port),
                "--jails",
                str(args.jails),
                "--jail-nice",
                str(args.jail_nice),
                # The workers share this machine: each gets its part of the resident budget.
                "--resident-memory-mb",
                str(args.resident_memory_mb or default_budget_mb(args.workers)),
                *server_flags,
            ]
            children.append(Child(f"sandbox worker {i + 1}", worker_args))
        workers = [c.address for c in children]
        sessions = args.sessions
        if private_redis:
            # Stopped after the runtimes (children stop in reverse), which write their record last.
            redis = RedisServer(args.host, folder=redis_dir, name="redis")
            children.append(redis)
            sessions = redis.url
            print(
                f"redis at {redis.url} (pid {redis.pid}; sessions shared by the runtimes, "
                f"append-only file in {redis_dir})",
                flush=True,
            )
        runtimes = []
        # One checkpoint key beside the library (0600, made once, reused by every start), passed by
        # its path: a checkpoint made before a restart restores after it (docs/fork.md).
        from services.runtime.checkpoints import write_key_file

        key_file = write_key_file(library.with_name(f"{library.stem}.checkpoint.key"))
        for i in range(args.runtimes):
            runtime_args = [
                "serve", "runtime", "--host", args.host, "--port", str(args.port if i == 0 else 0),
                "--library", str(library), "--sandbox", ",".join(workers), *server_flags,
                "--checkpoint-key", str(key_file),
            ]  # fmt: skip
            if sessions:
                runtime_args += ["--sessions", sessions]
            if args.no_record:
                runtime_args.append("--no-record")
            name = "runtime" if args.runtimes == 1 else f"runtime {i + 1}"
            runtimes.append(Child(name, runtime_args))
            children.append(runtimes[-1])
        for child in children:
            if isinstance(child, Child):
                wait_serving(child.address)
        # The OpenEnv gateways (WebSocket, not gRPC) in front of every runtime replica: their client
        # balances over them, so a replica restarting (sessions in Redis) costs the gateway nothing.
        gateways: list[Child] = []
        every_runtime = ",".join(r.address for r in runtimes)
        # With --auth they take the trainers' tokens (the file in their environment) and call the
        # runtime with the service token, as every server here does.
        openenv_args = ["serve", "openenv", "--host", args.host, "--runtime", every_runtime, *server_flags]
        if args.openenv_port >= 0:
            gateways.append(Child("openenv gateway", [*openenv_args, "--port", str(args.openenv_port)]))
        for env_id, port in one_env:
            argv = [*openenv_args, "--env", env_id, "--port", str(port)]
            gateways.append(Child(f"openenv gateway {env_id}", argv))
        children += gateways
        print(f"runtime listening on {','.join(r.address for r in runtimes)}", flush=True)
        for child in children:
            if isinstance(child, Child) and (child not in runtimes or len(runtimes) > 1):
                print(f"{child.name} at {child.address} (pid {child.proc.pid})", flush=True)
        for child in gateways:
            scheme = "https" if args.tls_cert else "http"
            print(f"  {child.name}: OpenEnv base_url {scheme}://{child.address}", flush=True)
        if gateways and args.auth:
            print(
                f"  OpenEnv clients send the trainer's token: EnvClient(base_url, headers="
                f'{{"Authorization": "Bearer " + os.environ["{TOKEN_ENV}"]}})',
                flush=True,
            )
        print(f"library {library}; Ctrl-C stops everything", flush=True)
        supervisor = Supervisor(children)
        while not stopping:
            problem = supervisor.check()
            if problem:
                print(f"codegym up: {problem}; stopping", flush=True)
                return 1
            time.sleep(0.2)
        return 0
    except (RuntimeError, TimeoutError) as exc:
        # The server printed its own one-line reason (a port in use, a jail that cannot start) above.
        print(f"codegym up: {exc}; its reason is printed above", file=sys.stderr, flush=True)
        return 1
    finally:
        # The gateways drain first, all at once (each lets open episodes end, up to its --grace-s),
        # while the runtime and workers behind them still serve.
        for child in children:
            if child.name.startswith("openenv gateway") and child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        for child in reversed(children):
            budget = GATEWAY_STOP_S if child.name.startswith("openenv gateway") else CHILD_STOP_S
            child.stop(timeout_s=budget)
            if child.killed:
                print(
                    f"codegym up: {child.name} did not stop within {budget:.0f} s: killed "
                    "(its threads' stacks, where it answered for them, are above)",
                    flush=True,
                )
        for stop in cleanup:
            stop()
        if children:
            print("codegym up: stopped", flush=True)


def register(sub: argparse._SubParsersAction) -> None:
    up = sub.add_parser(
        "up",
        help="run sandbox workers and the runtime on loopback until Ctrl-C",
        description=__doc__,
    )
    up.add_argument(
        "--library",
        default=str(default_library_path()),
        help="environment library; built from the sample environments when missing",
    )
    up.add_argument("--workers", type=int, default=2, help="sandbox worker processes")
    up.add_argument(
        "--no-record",
        action="store_true",
        help="the runtime keeps no record of served episodes (by default it keeps one beside the "
        "library, or in Redis with --sessions / --runtimes > 1: Stats, SampleTasks)",
    )
    up.add_argument(
        "--runtimes", type=int, default=1, help="runtime replicas (more than one share sessions in Redis)"
    )
    up.add_argument(
        "--sessions",
        default="",
        help="redis://HOST:PORT/N for the sessions (default: in memory; a private redis-server for --runtimes > 1)",
    )
    up.add_argument(
        "--redis-dir",
        default="",
        help="where the private redis-server of --runtimes > 1 keeps its append-only file "
        "(default: beside the library, LIBRARY.redis/)",
    )
    up.add_argument("--jails", type=int, default=os.cpu_count() or 2, help="jails per worker")
    add_jail_nice(up)
    up.add_argument(
        "--resident-memory-mb",
        type=int,
        default=0,
        help="memory each worker spends on resident sessions (0 = half of this machine's, shared by the workers)",
    )
    up.add_argument("--host", default="127.0.0.1", help="address every server binds")
    up.add_argument(
        "--auth",
        action="store_true",
        help="access tokens on every server: a trainer's token is printed (export CODEGYM_TOKEN=...), the "
        "operator's and the services' are kept in LIBRARY.tokens.json (0600) beside the library",
    )
    up.add_argument(
        "--insecure",
        action="store_true",
        help="with a --host other than loopback and no --auth: serve every caller that reaches the ports",
    )
    up.add_argument(
        "--tls-cert",
        default="",
        help="every server (gateways included) serves TLS with this certificate (PEM; with --tls-key); "
        "it must name --host",
    )
    up.add_argument("--tls-key", default="", help="the TLS certificate's private key (PEM)")
    up.add_argument(
        "--tls-ca",
        default="",
        help="the CA the servers trust when they call each other (default: --tls-cert, self-signed)",
    )
    up.add_argument("--port", type=int, default=50051, help="runtime port (0 = any free port)")
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
    up.set_defaults(func=cmd_up)

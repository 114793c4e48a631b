"""What `codegym up` does; its options and description are in up_options.py."""

from __future__ import annotations

import argparse
import fcntl
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Protocol, TextIO

from codegym.library.location import tokens_path
from codegym.procs import RedisServer, ServerProcess, codegym_command
from codegym.samples import ENVS, TASKS
from codegym.server.settings import (
    SERVER_TOKEN_ENV,
    TOKENS_FILE_ENV,
    Calls,
    GrpcAccess,
    ServerAccess,
    from_args,
    secrets_env,
    to_argv,
)
from codegym_client.defaults import TLS_CA_ENV, TOKEN_ENV
from sandbox_worker.settings import SandboxSettings
from services.console.settings import ConsoleSettings
from services.openenv.settings import GatewaySettings
from services.runtime.settings import RuntimeSettings

GATEWAY_STOP_S = 45.0  # a gateway's default --grace-s (30 s) and its closing, before SIGKILL
CHILD_STOP_S = 20.0  # a runtime's or worker's drain (5 s) and close, before SIGKILL


def build_default_library(path: Path) -> None:
    """The sample environments and their task configs, imported on first run.

    An install without them (package data dropped by a broken build) must not leave an empty
    library behind: that file would be taken as built on every later run."""
    from codegym.library.store import Library

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


# Access settings a child reads from its environment: up decides each of them for its children,
# whatever the shell that started it exported.
ACCESS_ENV = (TOKEN_ENV, TLS_CA_ENV, TOKENS_FILE_ENV, SERVER_TOKEN_ENV)
Settings = SandboxSettings | RuntimeSettings | GatewaySettings | ConsoleSettings


def child_env(settings: Settings) -> dict[str, str]:
    """A child's environment: this one's without the access variables, plus the secrets its
    settings hold (a token), which never go on its command line (any local user can read it)."""
    env = {k: v for k, v in os.environ.items() if k not in ACCESS_ENV}
    return {**env, **secrets_env(settings)}


class Child(ServerProcess):
    """One server process (`codegym COMMAND` with its settings' flags and secrets), started again
    by the supervisor with the same settings.

    Its stderr is this command's (the servers' logs and their one-line reasons for not starting
    reach the operator as they are); its stdout after the ready line is copied to ours.
    """

    def __init__(self, name: str, command: list[str], settings: Settings, timeout_s: float = 60.0) -> None:
        self.command = command
        self.settings = settings
        super().__init__(
            codegym_command([*command, *to_argv(settings)]),
            name=name,
            timeout_s=timeout_s,
            stderr=None,
            echo=sys.stdout,
            keep=200,
            stacks=True,
            env=child_env(settings),
        )

    def again(self) -> Child:
        """The same server started again on the port it had (the others know it by that port)."""
        port = int(self.address.rsplit(":", 1)[1])
        return Child(self.name, self.command, replace(self.settings, port=port))


class Supervised(Protocol):
    """What the supervisor keeps up: a `Child` or the private `RedisServer`."""

    name: str
    address: str
    proc: subprocess.Popen[str]
    killed: bool

    def again(self) -> Supervised: ...

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 20.0) -> int | None: ...


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
    from codegym.library.store import Library

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


@dataclass(frozen=True)
class Servers:
    """What every server `up` starts is told about access: what it takes (`access`, its gRPC form;
    the gateways' without the probes' port) and what it sends (`calls`)."""

    access: GrpcAccess = field(default_factory=GrpcAccess)
    calls: Calls = field(default_factory=Calls)

    @property
    def gateway_access(self) -> ServerAccess:
        fields_ = asdict(self.access)
        fields_.pop("health_port")
        return ServerAccess(**fields_)


def access_settings(args: argparse.Namespace, library: Path) -> Servers:
    """`--auth`: every server takes the tokens of a 0600 file beside the library (made on first use,
    then kept, so an exported trainer token stays good), and calls the others with the service
    token; the token reaches the children through their environment, never their command line
    (which any user can read). Without it, no server takes or sends a token, whatever this shell
    exported (`child_env`).

    `--tls-cert`/`--tls-key`: every server (the gateways included) serves TLS with them, and calls
    the others trusting `--tls-ca` (default: the certificate itself, as a self-signed one is its own
    CA)."""
    from codegym.server.auth import SERVICE, TRAINER, ServerAuth, check_bind, local_tokens

    given = from_args(ServerAccess, args)
    tokens_file, token, ca = "", "", ""
    if args.auth:
        path = tokens_path(library)
        tokens = local_tokens(path)
        tokens_file, token = str(path), tokens[SERVICE]
        print(
            f"access tokens on: a trainer's token (use it with every client and codegym command):\n"
            f"  export {TOKEN_ENV}={tokens[TRAINER]}\n"
            f"  the operator's token (sandbox run --target, library oracle --sandbox, library replay) "
            f"and the services' are in {path} (mode 0600)",
            flush=True,
        )
    elif not given.insecure:
        check_bind(args.host, ServerAuth())
    if bool(given.tls_cert) != bool(given.tls_key):
        raise SystemExit("codegym up: TLS needs both --tls-cert and --tls-key")
    cert = key = ""
    if given.tls_cert:
        cert, key = str(Path(given.tls_cert).resolve()), str(Path(given.tls_key).resolve())
        ca = str(Path(args.tls_ca).resolve()) if args.tls_ca else cert
        for what, file in (("--tls-cert", cert), ("--tls-key", key), ("--tls-ca", ca)):
            if not Path(file).is_file():
                raise SystemExit(f"codegym up: {what} {file} is not a readable file")
        print(
            f"TLS on every server: clients trust the servers' CA with\n  export {TLS_CA_ENV}={ca}", flush=True
        )
    access = GrpcAccess(tokens=tokens_file, tls_cert=cert, tls_key=key, insecure=given.insecure)
    return Servers(access, Calls(token=token, tls_ca=ca))


def start_workers(args: argparse.Namespace, servers: Servers) -> list[Child]:
    from sandbox_worker.residency import default_budget_mb

    given = from_args(SandboxSettings, args)
    # The workers share this machine: each gets its part of the resident budget.
    budget = given.resident_memory_mb or default_budget_mb(args.workers)
    workers = []
    for i in range(args.workers):
        port = args.sandbox_port + i if args.sandbox_port else 0
        settings = replace(given, host=args.host, port=port, resident_memory_mb=budget, access=servers.access)
        workers.append(Child(f"sandbox worker {i + 1}", ["serve", "sandbox"], settings))
    return workers


def start_runtimes(
    args: argparse.Namespace, servers: Servers, workers: list[str], sessions: str
) -> list[Child]:
    from services.runtime.checkpoints import write_key_file

    given = from_args(RuntimeSettings, args)
    # Without --checkpoint-key: one key beside the library (0600, made once, reused by every start),
    # passed by its path, so a checkpoint made before a restart restores after it (docs/fork.md).
    library = Path(given.library)
    keys = given.checkpoint_key or (str(write_key_file(library.with_name(f"{library.stem}.checkpoint.key"))),)
    runtimes = []
    for i in range(args.runtimes):
        settings = replace(
            given,
            port=given.port if i == 0 else 0,
            sandbox=",".join(workers),
            sessions=sessions,
            checkpoint_key=keys,
            access=servers.access,
            calls=servers.calls,
        )
        name = "runtime" if args.runtimes == 1 else f"runtime {i + 1}"
        runtimes.append(Child(name, ["serve", "runtime"], settings))
    return runtimes


def start_gateways(
    args: argparse.Namespace, servers: Servers, runtimes: list[Child], one_env: list[tuple[str, int]]
) -> list[Child]:
    """The OpenEnv gateways (WebSocket, not gRPC), and the web console with `--console-port`, in
    front of every runtime replica: their client balances over them, so a replica restarting
    (sessions in Redis) costs them nothing. With --auth they take the trainers' tokens (the console
    the operator's too) and call the runtime with the service token, as every server here does."""
    base = GatewaySettings(
        runtime=",".join(r.address for r in runtimes),
        host=args.host,
        access=servers.gateway_access,
        calls=servers.calls,
    )
    gateways: list[Child] = []
    if args.openenv_port >= 0:
        gateways.append(Child("openenv gateway", ["serve", "openenv"], replace(base, port=args.openenv_port)))
    for env_id, port in one_env:
        settings = replace(base, env=env_id, port=port)
        gateways.append(Child(f"openenv gateway {env_id}", ["serve", "openenv"], settings))
    if args.console_port >= 0:  # the web console: people's pages over the same runtimes and tokens
        console = ConsoleSettings(
            target=base.runtime, host=args.host, port=args.console_port, access=base.access, calls=base.calls
        )
        gateways.append(Child("console", ["console"], console))
    return gateways


def print_addresses(args: argparse.Namespace, children: list[Supervised], runtimes: list[Child]) -> None:
    print(f"runtime listening on {','.join(r.address for r in runtimes)}", flush=True)
    gateways = [c for c in children if c.name.startswith("openenv gateway")]
    for child in children:
        if isinstance(child, Child) and (child not in runtimes or len(runtimes) > 1):
            print(f"{child.name} at {child.address} (pid {child.proc.pid})", flush=True)
    scheme = "https" if args.tls_cert else "http"
    for child in gateways:
        print(f"  {child.name}: OpenEnv base_url {scheme}://{child.address}", flush=True)
    for child in children:
        if child.name == "console":
            print(f"  console: {scheme}://{child.address}/", flush=True)
    if gateways and args.auth:
        print(
            f"  OpenEnv clients send the trainer's token: EnvClient(base_url, headers="
            f'{{"Authorization": "Bearer " + os.environ["{TOKEN_ENV}"]}})',
            flush=True,
        )
    print(f"library {args.library}; Ctrl-C stops everything", flush=True)


def stop_all(children: list[Supervised]) -> None:
    """The gateways drain first, all at once (each lets open episodes end, up to its --grace-s),
    while the runtime and workers behind them still serve; then the rest, last started first."""
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
    if children:
        print("codegym up: stopped", flush=True)


@contextmanager
def stopping_signals() -> Iterator[list[int]]:
    """SIGTERM and SIGINT noted (in the list yielded), not raised: the loop stops the set."""
    stopping: list[int] = []

    def on_signal(signum: int, frame: object) -> None:
        stopping.append(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    yield stopping


def cmd_up(args: argparse.Namespace) -> int:
    from codegym.server.grpcutil import wait_serving
    from sandbox_worker.limits import unreachable_by_jails

    unreachable = unreachable_by_jails() if args.workers else ""  # the workers run this interpreter
    if unreachable:
        raise SystemExit(f"codegym up: {unreachable}")
    library = Path(args.library)
    if not library.exists():
        build_default_library(library)
    one_env = env_gateways(args.openenv_env, library)
    children: list[Supervised] = []
    with ExitStack() as cleanup, stopping_signals() as stopping:
        servers = access_settings(args, library)
        probe = Calls(tls_ca=servers.calls.tls_ca).access()
        try:
            private_redis = args.runtimes > 1 and not args.sessions
            redis_dir = Path(args.redis_dir) if args.redis_dir else library.with_name(f"{library.stem}.redis")
            if private_redis:  # before any server starts
                cleanup.callback(lock_redis_folder(redis_dir).close)
            workers = start_workers(args, servers)
            children += workers
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
            runtimes = start_runtimes(args, servers, [w.address for w in workers], sessions)
            children += runtimes
            for server in [*workers, *runtimes]:
                wait_serving(server.address, access=probe)
            children += start_gateways(args, servers, runtimes, one_env)
            print_addresses(args, children, runtimes)
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
            stop_all(children)  # the supervisor keeps this list: restarted servers included
    return 1

"""Start our servers as real processes on loopback port 0, and stop them by pid.

The lifecycle itself (pdeathsig, the ready line, draining, stopping) is `codegym.procs`, shared
with `codegym up` and the benchmarks; this only spells a `codegym` subcommand and merges its
stderr into the text tests inspect.

Two environment variables change what the tests run against:

- `CODEGYM_TEST_RUNTIME=HOST:PORT` points the runtime-facing tests at a deployed runtime instead
  of the runtime they would start: the tests marked `deployable` (those that need only a runtime
  serving the sample library, `codegym/samples/envs` with `codegym/samples/tasks.jsonl`, as `codegym up`
  builds it), e.g. `CODEGYM_TEST_RUNTIME=127.0.0.1:50051 .venv/bin/pytest -m deployable`. The
  other tests start their own servers as usual (they kill workers, read /proc, need fixture envs).
- `CODEGYM_TESTS_WITHOUT_REDIS=1` skips the tests that need `redis-server`. Without it, a machine
  with no `redis-server` fails them: a missing dependency must not pass as a green run.

A test module's sandbox workers come from `workers_fixture` / `worker_fixture` (one line each,
with the module's count, jails, flags and scope), or `sandbox_workers` inside a fixture whose
workers need another fixture's value (a tokens file).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import pytest
import redis as redis_py

from codegym import procs

RUNTIME_SWITCH = "CODEGYM_TEST_RUNTIME"
WITHOUT_REDIS = "CODEGYM_TESTS_WITHOUT_REDIS"
Scope = Literal["session", "package", "module", "class", "function"]


def deployed_runtime() -> str | None:
    """The address `CODEGYM_TEST_RUNTIME` names, or None: the tests start their own runtime."""
    return os.environ.get(RUNTIME_SWITCH, "").strip() or None


class CodegymServer(procs.ServerProcess):
    """`codegym ARGS...` (e.g. `serve sandbox --port 0`) until its `listening on` line; `env`
    replaces the environment it starts with.

    `stop` gives it the time it may take: `codegym up` stops its servers one after another, each
    within its own budget (`up.GATEWAY_STOP_S`, `CHILD_STOP_S`), so a test must not kill
    it sooner; a server that has not stopped in time is asked for its stacks before the kill."""

    def __init__(
        self,
        args: list[str],
        timeout: float = 60.0,
        python: str = sys.executable,
        env: dict[str, str] | None = None,
    ) -> None:
        super().__init__(
            procs.codegym_command(args, python),
            name=" ".join(args[:2]),
            timeout_s=timeout,
            env=env,
            stacks=True,
        )
        self.stop_s = UP_STOP_S if args[:1] == ["up"] else SERVER_STOP_S

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float | None = None) -> int | None:
        return super().stop(sig, self.stop_s if timeout_s is None else timeout_s)


SERVER_STOP_S = 20.0
UP_STOP_S = 120.0  # its gateway's 45 s, then its runtimes' and workers' 20 s each


def worker_args(jails: int = 1, *extra: str) -> list[str]:
    """`codegym serve sandbox` on a free loopback port with `jails` jails, `extra` appended."""
    return ["serve", "sandbox", "--port", "0", "--jails", str(jails), *extra]


def start_workers(count: int = 2, jails: int = 1) -> list[CodegymServer]:
    return [CodegymServer(worker_args(jails)) for _ in range(count)]


@contextmanager
def sandbox_workers(
    count: int = 2,
    *extra: str,
    jails: int = 1,
    env: dict[str, str] | None = None,
    clean_stop: bool = True,
) -> Iterator[list[CodegymServer]]:
    """`count` sandbox workers (`extra` on each command line, `env` their environment), all stopped
    on the way out. With `clean_stop` each must then have exited 0: a worker that crashed, or
    needed SIGKILL to stop, fails the fixture that used it. Every worker is stopped before that
    check, so one bad exit leaves no other worker running."""
    started: list[CodegymServer] = []
    try:
        for _ in range(count):
            started.append(CodegymServer(worker_args(jails, *extra), env=env))
        yield started
    finally:
        codes = [worker.stop() for worker in started]
    unclean = [(worker, code) for worker, code in zip(started, codes, strict=True) if code != 0]
    if clean_stop and unclean:
        worker, code = unclean[0]
        raise AssertionError(
            f"sandbox worker {worker.address} exited with {code}, not 0:\n{worker.text[-3000:]}"
        )


def workers_fixture(
    count: int = 2,
    *extra: str,
    jails: int = 1,
    add_env: Mapping[str, str] | None = None,
    clean_stop: bool = True,
    addresses: bool = False,
    scope: Scope = "module",
) -> Callable[..., Any]:
    """A pytest fixture of `count` sandbox workers (see `sandbox_workers`), for a module to bind
    to its fixture's name (`workers = workers_fixture(1, jails=2)`): the processes, or with
    `addresses` the comma-separated addresses `--sandbox` takes. `add_env` is added to this
    process's environment as it is when the workers start."""

    def workers() -> Iterator[list[CodegymServer] | str]:
        env = None if add_env is None else {**os.environ, **add_env}
        with sandbox_workers(count, *extra, jails=jails, env=env, clean_stop=clean_stop) as started:
            yield ",".join(w.address for w in started) if addresses else started

    return pytest.fixture(scope=scope)(workers)


def worker_fixture(
    *extra: str,
    jails: int = 1,
    add_env: Mapping[str, str] | None = None,
    clean_stop: bool = True,
    scope: Scope = "module",
) -> Callable[..., Any]:
    """A pytest fixture of one sandbox worker process, as `workers_fixture` starts them."""

    def worker() -> Iterator[CodegymServer]:
        env = None if add_env is None else {**os.environ, **add_env}
        with sandbox_workers(1, *extra, jails=jails, env=env, clean_stop=clean_stop) as started:
            yield started[0]

    return pytest.fixture(scope=scope)(worker)


def start_runtime(library: Path, workers: list[CodegymServer], *extra: str) -> CodegymServer:
    sandbox = ",".join(w.address for w in workers)
    args = ["serve", "runtime", "--port", "0", "--library", str(library), "--sandbox", sandbox, *extra]
    return CodegymServer(args)


def require_redis_server() -> None:
    """Fail the calling test when `redis-server` is missing, or skip it when the run opted out
    with CODEGYM_TESTS_WITHOUT_REDIS=1."""
    if shutil.which("redis-server") is not None:
        return
    if os.environ.get(WITHOUT_REDIS) == "1":
        pytest.skip(f"redis-server is not installed and {WITHOUT_REDIS}=1")
    pytest.fail(
        f"redis-server is not installed: install it (`make install` does) or set {WITHOUT_REDIS}=1 to "
        "skip the tests that need it",
        pytrace=False,
    )


class Redis(procs.RedisServer):
    """A redis-server on loopback; with `folder`, an append-only file there (a restart on the same
    port and folder keeps the sessions). A missing `redis-server` fails the test (see
    `require_redis_server`)."""

    def __init__(self, folder: Path | None = None, port: int = 0) -> None:
        require_redis_server()
        super().__init__("127.0.0.1", port=port, folder=folder)
        self._client: redis_py.Redis | None = None

    @property
    def client(self) -> redis_py.Redis:
        """A client of this server, for tests that read what the runtimes wrote."""
        if self._client is None:
            self._client = redis_py.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)
        return self._client

    def lease_held(self, session_id: str) -> bool:
        """Whether a replica holds the session's step lease (a step of it is running)."""
        return bool(self.client.exists(f"codegym:lock:{session_id}"))

    def stop(self, sig: int | None = None, timeout_s: float = 20.0) -> int | None:
        if self._client is not None:
            self._client.close()
            self._client = None
        return super().stop(timeout_s=timeout_s) if sig is None else super().stop(sig, timeout_s)


@contextmanager
def running(args: list[str]) -> Iterator[CodegymServer]:
    server = CodegymServer(args)
    try:
        yield server
    finally:
        server.stop()

"""Child processes that die with their parent, and the one way to run a server as a child process.

Every process a server or command starts must end when its parent ends, however the parent ends:
a SIGKILL or an OOM kill runs no `finally`, no signal handler, no `atexit`. The kernel's
`PR_SET_PDEATHSIG` does: set in the child, it sends the child SIGKILL when its parent dies, and it
survives `execve`. Three things decide how it is set here:

- Not in a `preexec_fn`. A `preexec_fn` makes `subprocess` (and asyncio) `fork()` instead of
  `vfork()`, which runs gRPC's fork handlers: in a process with a live channel or server the
  child restarts gRPC's poller, `close_fds` then closes the poller's epoll fd, and the child
  aborts before exec ("epoll_wait error: Bad file descriptor"; 5 of 300 spawns measured, with
  "skipping fork() handlers" noise on every one). So the child first execs a few lines of Python
  (`with_pdeathsig`) that set the flag and then exec the real program; the spawn itself stays a
  plain `vfork` + exec, and the pid the caller holds is the real program's.
- The parent may already be gone when the child sets the flag (it died between the spawn and
  the prctl): the child then sees a `getppid()` other than the pid it was spawned from and kills
  itself.
- "Parent" is the *thread* that forked, not the process: a child forked from a short-lived thread
  (a thread pool's, a test's helper thread) is killed when that thread exits. So `popen` forks from
  the main thread, and calls from any other thread are handed to one long-lived spawner thread.
  `asyncio.create_subprocess_exec` forks on the event loop's thread, which lives as long as the
  server it runs.

`ServerProcess` is the server lifecycle that `codegym up`, `codegym pipeline run`, the tests and
the benchmarks share: start a command (with the above), read its output until a
`listening on HOST:PORT` line or a deadline, keep draining its output (a server must never block
on a full pipe), stop it by pid with SIGTERM and then SIGKILL. `RedisServer` is the one
`redis-server` starter.

A `codegym` process that has not stopped in its time is asked for its threads' stacks
(`STACKS_SIGNAL`, which every `codegym` command answers through `faulthandler`) before the SIGKILL:
a hang at shutdown then names the call it hung in, in the output the caller keeps and prints.
"""

from __future__ import annotations

import contextlib
import errno
import faulthandler
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from queue import SimpleQueue
from typing import Any, TextIO

# The first address when a line names several ("runtime listening on A,B" from `codegym up`).
LISTENING = re.compile(r"listening on ([^\s,]+:\d+)")

# Run as `python -I -S -c EXEC_WITH_PDEATHSIG PARENT_PID PATH ARGV...`: set PR_SET_PDEATHSIG (1),
# die at once if PARENT_PID is no longer the parent, undo what the interpreter changed at startup
# (SIGPIPE and SIGXFSZ ignored, LC_CTYPE coerced into the environment: /proc/self/environ still
# holds the environment as it was given), and become PATH with ARGV.
EXEC_WITH_PDEATHSIG = """\
import os, signal, sys
from ctypes import CDLL
if CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0) != 0:
    sys.exit("prctl(PR_SET_PDEATHSIG) failed")
if os.getppid() != int(sys.argv[1]):
    os.kill(os.getpid(), signal.SIGKILL)
signal.signal(signal.SIGPIPE, signal.SIG_DFL)
signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
with open("/proc/self/environ", "rb") as given:
    env = dict(item.split(b"=", 1) for item in given.read().split(b"\\0") if b"=" in item)
os.execve(sys.argv[2], sys.argv[3:], env)
"""


def with_pdeathsig(argv: Sequence[str]) -> list[str]:
    """ARGV, run so that it gets SIGKILL when the thread that spawns it (now, from this process) dies.

    Spawn the result from a thread that lives as long as the child should (see the module
    docstring); the child keeps the pid of the spawn. A program that cannot be found raises
    FileNotFoundError here, as `subprocess.Popen` would.
    """
    program = argv[0]
    path = program if os.sep in program else shutil.which(program)
    if path is None or not os.access(path, os.X_OK):
        raise FileNotFoundError(errno.ENOENT, "no such program", program)
    return [sys.executable, "-I", "-S", "-c", EXEC_WITH_PDEATHSIG, str(os.getpid()), path, *argv]


class _Spawner:
    """One daemon thread that forks for callers on other threads (see the module docstring).

    It lives as long as the process, so the children it forks die with the process, not with
    the thread that asked for them.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: SimpleQueue[tuple[Callable[[], Any], Future[Any]]] | None = None

    def run(self, fn: Callable[[], Any]) -> Any:
        if threading.current_thread() is threading.main_thread():
            return fn()
        with self._lock:
            if self._queue is None:
                self._queue = SimpleQueue()
                threading.Thread(target=self._serve, args=(self._queue,), name="spawner", daemon=True).start()
            queue = self._queue
        done: Future[Any] = Future()
        queue.put((fn, done))
        return done.result()

    @staticmethod
    def _serve(queue: SimpleQueue[tuple[Callable[[], Any], Future[Any]]]) -> None:
        while True:
            fn, done = queue.get()
            try:
                done.set_result(fn())
            except BaseException as exc:
                done.set_exception(exc)

    def forget(self) -> None:
        """After os.fork(): the spawner thread does not exist in the child; start another there."""
        self._lock = threading.Lock()
        self._queue = None


_SPAWNER = _Spawner()
os.register_at_fork(after_in_child=_SPAWNER.forget)


def popen(argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
    """`subprocess.Popen(argv, **kwargs)` whose child is SIGKILLed when this process dies."""
    result: subprocess.Popen[Any] = _SPAWNER.run(lambda: subprocess.Popen(with_pdeathsig(argv), **kwargs))
    return result


# `kill -USR1 PID` makes a `codegym` process write every thread's stack to its stderr (and go on).
STACKS_SIGNAL = signal.SIGUSR1
STACKS_WAIT_S = 1.0  # for the stacks to reach the pipe before the SIGKILL


def stderr_fd() -> TextIO | None:
    """Where faulthandler can write: `sys.stderr`, or the process's own stderr when `sys.stderr`
    has no file descriptor (a test capturing a command it calls in-process)."""
    try:
        sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return sys.__stderr__
    return sys.stderr


def answer_stacks_signal() -> None:
    """Write every thread's stack to stderr on `STACKS_SIGNAL`. faulthandler writes from the signal
    itself, in C: it answers even while the main thread is blocked in a call that never returns to
    the interpreter (a server's stop, a join), which is when it is needed."""
    stream = stderr_fd()
    if stream is not None:
        faulthandler.register(STACKS_SIGNAL, file=stream, all_threads=True, chain=False)


EXIT_WAIT_S = 5.0  # after a server's orderly stop, for its interpreter to finish tearing down
EXIT_BACKSTOP_S = 10.0


def exit_within(seconds: float = EXIT_WAIT_S, code: int = 0) -> None:
    """Make sure this process ends soon after its server stopped in order.

    Everything that matters is done by then (calls drained, records written, jails killed), but the
    interpreter's own teardown runs library code that can hang: gRPC's asyncio poller can block
    in a write its event loop no longer reads (grpc/grpc#40989), and `asyncio.run` then waits for
    it. A supervisor waiting on such a process sees a server that will not stop. So a daemon thread
    waits `seconds`; if the process is still here, it says so, writes every thread's stack to
    stderr (the hang named, for a fix) and exits with `code`, the server's own outcome. If the hang
    holds the GIL, faulthandler's C watchdog does the same (exit code 1) after `EXIT_BACKSTOP_S`.
    """

    def leave() -> None:
        time.sleep(seconds)
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        print(
            f"codegym: the server stopped, but the process had not exited {seconds:g} s later "
            "(a library's teardown hung); its threads' stacks follow, then it exits",
            file=sys.stderr,
            flush=True,
        )
        if stream is not None:
            faulthandler.dump_traceback(stream, all_threads=True)
        os._exit(code)

    stream = stderr_fd()
    threading.Thread(target=leave, name="exit guard", daemon=True).start()
    if stream is not None:
        faulthandler.dump_traceback_later(max(seconds, EXIT_BACKSTOP_S), file=stream, exit=True)


def codegym_command(args: Sequence[str], python: str = sys.executable) -> list[str]:
    """The argv that runs `codegym ARGS...` with this interpreter (no reliance on PATH)."""
    return [python, "-m", "codegym_cli.cli", *args]


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now, for servers that cannot bind port 0 themselves."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        port: int = probe.getsockname()[1]
        return port


class ServerProcess:
    """A server run as a child process that prints a ready line (by default `listening on HOST:PORT`).

    The constructor returns once the ready line came (`address` is its first group), and raises
    RuntimeError with the output so far when the process exits first or `timeout_s` passes. A
    reader thread reads the output from the start and keeps draining it for the server's whole
    life: lines are kept in `output` (the last `keep`, or all) and, after the ready line, copied
    to `echo` when given. The server runs in its own session (`start_new_session`), so a
    terminal's Ctrl-C reaches only its parent, which stops it in order, and `stop` can SIGKILL its
    whole process group as a last resort.
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        name: str = "",
        ready: re.Pattern[str] = LISTENING,
        timeout_s: float = 60.0,
        stderr: int | None = subprocess.STDOUT,
        echo: TextIO | None = None,
        keep: int | None = None,
        env: dict[str, str] | None = None,
        cwd: str | Path | None = None,
        stacks: bool = False,
    ) -> None:
        self.name = name or Path(argv[0]).name
        self.address = ""
        self.stacks = stacks  # it answers STACKS_SIGNAL (a `codegym` command)
        self.killed = False  # `stop` had to SIGKILL it
        self._ready_pattern = ready
        self._echo = echo
        self._lines: deque[str] = deque(maxlen=keep)
        self._lines_lock = threading.Lock()
        self._ready = threading.Event()
        self._settled = threading.Event()  # the ready line came, or the output ended
        self.proc: subprocess.Popen[str] = popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            errors="replace",
            start_new_session=True,
            env=env,
            cwd=cwd,
        )
        self._reader = threading.Thread(target=self._read, name=f"{self.name} output", daemon=True)
        self._reader.start()
        if not self._settled.wait(timeout_s) or not self._ready.is_set():
            code = self.stop()
            why = f"exit code {code}" if self._settled.is_set() else f"no ready line in {timeout_s:.0f} s"
            said = self.text[-4000:].rstrip()
            raise RuntimeError(f"{self.name} did not start ({why})" + (f":\n{said}" if said else ""))

    def _read(self) -> None:
        assert self.proc.stdout is not None
        try:
            for line in self.proc.stdout:
                with self._lines_lock:
                    self._lines.append(line)
                if not self._ready.is_set():
                    match = self._ready_pattern.search(line)
                    if match:
                        self.address = match.group(1) if match.re.groups else ""
                        self._ready.set()
                        self._settled.set()
                elif self._echo is not None:
                    with contextlib.suppress(OSError, ValueError):
                        self._echo.write(line)
                        self._echo.flush()
        finally:
            self._settled.set()

    @property
    def output(self) -> list[str]:
        """The lines read so far (the last `keep` of them when that was given)."""
        with self._lines_lock:
            return list(self._lines)

    @property
    def text(self) -> str:
        return "".join(self.output)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 20.0) -> int | None:
        """Send `sig` to the server's pid; SIGKILL its process group if it has not exited in time.

        Returns its exit code. The output read up to its end is in `output` afterwards (unless a
        process it left behind still holds the pipe). One that had to be killed has `killed` set
        and, when it answers `STACKS_SIGNAL`, its threads' stacks at the end of its output.
        """
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.killed = True
                if self.stacks:
                    with contextlib.suppress(ProcessLookupError):
                        self.proc.send_signal(STACKS_SIGNAL)
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        self.proc.wait(STACKS_WAIT_S)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._reader.join(2.0)
        return self.proc.returncode


REDIS_READY = re.compile(r"Ready to accept connections")


class RedisServer(ServerProcess):
    """A `redis-server` on `host` (a free port unless given) that keeps no RDB snapshots.

    With `folder`, it keeps an append-only file there, so `again()` (a server on the same port and
    folder, once this one died however it died) has every acknowledged write; without, nothing is
    persisted. The file is synced on every write (`appendfsync always`), not every second: with
    `everysec`, Redis sends a reply before writing the command out whenever the last second's
    fsync is still running (for up to 2 s under a slow disk), and an acknowledged step lost that
    way would turn the client's resend, which carries its step index, into a mismatch instead of a
    replay. `always` writes and syncs before replying, once per event-loop turn for every client
    served in it, so concurrent steps share one fsync.
    Ready once it logs "Ready to accept connections" (after loading that file), not merely once
    its port accepts connections (it answers LOADING while it reads the file).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        *,
        port: int = 0,
        folder: Path | None = None,
        timeout_s: float = 20.0,
        name: str = "",
    ) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError(
                "several runtimes share sessions in Redis: install redis-server or pass --sessions"
            )
        self.host = host
        self.port = port or free_port(host)
        self.folder = folder
        self.url = f"redis://{host}:{self.port}/0"
        argv = [binary, "--bind", host, "--port", str(self.port), "--save", "", "--daemonize", "no"]
        if folder is not None:
            argv += ["--dir", str(folder), "--appendonly", "yes", "--appendfsync", "always"]
        else:
            argv += ["--appendonly", "no"]
        super().__init__(
            argv,
            name=name or f"redis-server on {host}:{self.port}",
            ready=REDIS_READY,
            timeout_s=timeout_s,
            keep=200,
        )
        self.address = f"{host}:{self.port}"

    def again(self) -> RedisServer:
        """A new server on this one's port and folder (its append-only file), under the same name."""
        return RedisServer(self.host, port=self.port, folder=self.folder, name=self.name)

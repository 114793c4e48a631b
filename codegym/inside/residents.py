"""A forked child's life, and resident sessions: a child that keeps one session's live environment
between steps.

Every child is forked before its request arrives (the spare), waits for one request and serves it
(`operations`). When the zygote asks it to stay (`keep_process`: a session's create or cold step)
and the request succeeded, the child stays: it keeps the env object and serves the session's next steps from its
request pipe, with no fork and no unpickling. One session per process, never two, so sessions
never share an interpreter.

The zygote decides whether a step may go to the resident child: only when the state the worker
sent (the runtime's committed state) is the one the child holds, compared by sha256 (the worker's
of the state it sends, the zygote's of the state it relayed from the child). Anything else
(first step, eviction, a step that failed, another worker) runs cold. A step that fails in a
resident child ends the child, so a later step restarts from the committed state: trial then
commit holds because the child's own copy is never trusted after a failure.
"""

import contextlib
import os
import resource
import select
import time

from . import frames
from .messages import REQUEST_PARTS, Request, Result
from .operations import cpu_seconds, result_frame, run_request, warm_up
from .watchdog import Watch


class Resident:
    """A resident session's process, as the zygote sees it."""

    __slots__ = ("death", "last_used", "pid", "pidfd", "req_w", "res_r", "task_fd", "uid", "version", "watch")

    def __init__(self, pid: int, req_w: int, res_r: int, version: str, uid: int, task_fd: int) -> None:
        self.pid = pid
        self.uid = uid
        self.req_w = req_w
        self.res_r = res_r
        # Its /proc/PID/task: whether it still runs one thread (`hygiene.one_thread`).
        self.task_fd = task_fd
        self.version = version
        self.last_used = time.monotonic()
        # Kept open for the session's life: readable once the process has exited.
        self.pidfd = os.pidfd_open(pid)
        # Made once, used by every step: its result pipe and pidfd (`collect`), its pidfd alone.
        self.watch = Watch(res_r, self.pidfd)
        self.death = select.poll()
        self.death.register(self.pidfd, select.POLLIN)

    def exited(self) -> bool:
        return bool(self.death.poll(0))


def limit_cpu(step_cpu_ms: int) -> None:
    """This step's CPU allowance on top of what the process used so far (RLIMIT_CPU is cumulative).

    The hard limit stays unlimited for a resident child so the soft one can move up every step;
    passing the soft limit raises SIGXCPU, which ends the child (a CPU timeout). The zygote's
    wall-clock watchdog bounds the step whatever the child does with its limits.
    """
    allowance = max(1, -(-step_cpu_ms // 1000))
    soft = int(cpu_seconds()) + allowance + 1
    resource.setrlimit(resource.RLIMIT_CPU, (soft, resource.RLIM_INFINITY))


def child_main(req_fd: int, result_fd: int, base_vm_bytes: int) -> None:
    """A spare child: wait for one request, serve it, report; exit, or stay as a resident session.

    `base_vm_bytes`: the zygote's address space, which the child inherits and its memory limit
    comes on top of."""
    devnull = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    with contextlib.suppress(Exception):
        warm_up()
    try:
        req: Request | None = frames.read(req_fd, REQUEST_PARTS)  # type: ignore[assignment]
    except ValueError:
        req = None
    if req is None:
        os._exit(0)
    limits = req["limits"]
    if req.get("keep_process"):
        limit_cpu(limits["cpu_ms"])
    else:
        cpu_s = max(1, -(-limits["cpu_ms"] // 1000))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    memory = base_vm_bytes + limits["memory_mb"] * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    result, child = run_request(req, None)
    frames.write_all(result_fd, result_frame(result))
    if not (
        req.get("keep_process")
        and result.get("status") == "ok"
        and child is not None
        and child.env is not None
    ):
        os._exit(0)
    # Resident: serve the session's steps until the zygote closes the pipe (eviction) or a step
    # fails. Idle eviction is the zygote's decision, never the child's: a child that left on its
    # own would fail the next step sent to it.
    while True:
        try:
            step_req: Request | None = frames.read(req_fd, REQUEST_PARTS)  # type: ignore[assignment]
        except ValueError:
            step_req = None
        if step_req is None:
            break
        try:
            limit_cpu(step_req["limits"]["cpu_ms"])
        except (ValueError, KeyError, TypeError) as exc:
            bad: Result = {"status": "bad_request", "message": f"bad resident request: {exc}"}
            frames.write_all(result_fd, result_frame(bad))
            break
        out, _ = run_request(step_req, child)
        frames.write_all(result_fd, result_frame(out))
        if out.get("status") != "ok":
            break
    os._exit(0)

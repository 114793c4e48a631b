"""Resident sessions: a forked child that keeps one session's live environment between steps.

Runs *inside* the jail next to zygote.py (mounted beside it; standard library only). The first
step of a session is served cold by a spare child as usual (unpickle the committed state, step);
when the request asks for residency the child then stays: it keeps the env object and serves the
session's next steps from its request pipe, with no fork and no unpickling. One session per
process, never two, so sessions never share an interpreter.

The zygote decides whether a step may go to the resident child: only when the state the worker
sent (the runtime's committed state) is the one the child holds, compared by sha256. Anything else
(first step, eviction, a step that failed, another worker) runs cold. A step that fails in a
resident child ends the child, so a later step restarts from the committed state: trial then
commit holds because the child's own copy is never trusted after a failure.
"""

import os
import resource
import struct
from collections.abc import Callable

HEADER = struct.Struct(">I")


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def limit_cpu(step_cpu_ms: int) -> None:
    """This step's CPU allowance on top of what the process used so far (RLIMIT_CPU is cumulative).

    The hard limit stays unlimited for a resident child so the soft one can move up every step;
    passing the soft limit raises SIGXCPU, which ends the child (a CPU timeout). The zygote's
    wall-clock watchdog bounds the step whatever the child does with its limits.
    """
    allowance = max(1, -(-step_cpu_ms // 1000))
    soft = int(cpu_seconds()) + allowance + 1
    resource.setrlimit(resource.RLIMIT_CPU, (soft, resource.RLIM_INFINITY))


def read_frame(fd: int) -> bytes | None:
    header = _read(fd, HEADER.size)
    if header is None:
        return None
    (length,) = HEADER.unpack(header)
    return _read(fd, length)


def _read(fd: int, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def write_frame(fd: int, body: bytes) -> None:
    view = memoryview(HEADER.pack(len(body)) + body)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def serve(req_fd: int, result_fd: int, handle: Callable[[bytes], tuple[bytes, bool]]) -> None:
    """Serve steps until the zygote closes the pipe (eviction) or a step fails.

    `handle` turns one request frame into a result frame and says whether the child may stay.
    Idle eviction is the zygote's decision (it closes the pipe or kills the child), never the
    child's: a child that left on its own would fail the next step sent to it.
    """
    while True:
        frame = read_frame(req_fd)
        if frame is None:
            return
        body, keep = handle(frame)
        write_frame(result_fd, body)
        if not keep:
            return

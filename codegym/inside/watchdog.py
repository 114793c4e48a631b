"""Waiting for a child's result within its request's limits, and saying why there is none.

The zygote's own watchdog: a child that overruns its wall-clock limit is killed here, a child that
died is reaped here and its death told apart (CPU limit, SIGKILL, another signal, an exit with no
result). The worker keeps a second watchdog on the zygote itself (`sandbox_worker/jail.py`).
"""

import contextlib
import os
import select
import signal
import time
from typing import Any

from .frames import PREFIX, decode, frame_size
from .messages import RESULT_PARTS, Limits, Result, Usage, from_child


def child_status(
    pid: int,
    started: float,
    limits: Limits,
    timed_out: bool,
    oversized: int,
    *,
    kill: bool = False,
    malformed: str = "",
) -> Result:
    """Reap a child that gave no usable result (killing it first) and say why. `oversized`: the
    result size limit it broke, or 0; `malformed`: what was wrong with the frame it wrote, if it
    wrote one whole (its failure, whatever the signal that then ended it)."""
    if timed_out or oversized or kill:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    _, status, usage = os.wait4(pid, 0)
    usage_out: Usage = {
        "wall_ms": int((time.monotonic() - started) * 1000),
        "cpu_ms": int((usage.ru_utime + usage.ru_stime) * 1000),
        "peak_rss_kb": usage.ru_maxrss,
    }
    result: Result
    if timed_out:
        result = {"status": "timeout", "message": f"wall-clock limit of {limits['wall_ms']} ms exceeded"}
    elif oversized:
        result = {"status": "output_limit", "message": f"result larger than {oversized} bytes"}
    elif malformed:
        result = {"status": "crashed", "message": f"malformed result: {malformed}"[:2000]}
    elif os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and usage_out["cpu_ms"] >= limits["cpu_ms"]):
            result = {"status": "timeout", "message": f"CPU limit of {limits['cpu_ms']} ms exceeded"}
        elif sig == signal.SIGKILL:
            result = {"status": "killed", "message": "killed by SIGKILL (memory or process limit)"}
        else:
            result = {"status": "crashed", "message": f"killed by signal {signal.Signals(sig).name}"}
        result["exit_code"] = 128 + sig
    else:
        code = os.WEXITSTATUS(status)
        result = {"status": "crashed", "message": f"process exited with code {code} without a result"}
    result["usage"] = usage_out
    return result


def shallow(message: dict[str, Any]) -> bool:
    """Whether a child's result nests values one level at most, as every honest result does (its
    `usage`, its `trajectory`). A head nested deep enough to pass the zygote's decoder could still
    break the worker's (whose stack is deeper): the jail would be taken for broken and replaced,
    and every session resident in it lost to one hostile child."""
    for value in message.values():
        if isinstance(value, dict):
            value = value.values()
        elif not isinstance(value, list):
            continue
        for item in value:
            if isinstance(item, dict | list):
                return False
    return True


class Watch:
    """What `collect` waits on for one child: its result pipe and its pidfd, in one poll object.

    A resident session keeps one for its life (`residents.Resident`), so a step registers nothing;
    a one-shot child gets one for its request, made and closed (with its pidfd) by `collect`."""

    __slots__ = ("pidfd", "poller", "res_r")

    def __init__(self, res_r: int, pidfd: int) -> None:
        self.res_r = res_r
        self.pidfd = pidfd
        self.poller = select.poll()
        # poll, not select: a jail with many resident sessions has fds past FD_SETSIZE.
        self.poller.register(res_r, select.POLLIN)
        self.poller.register(pidfd, select.POLLIN)


# A result is read in chunks of this size at most (a pipe holds 64 KiB): a child's claim of a large
# result makes no large allocation before its bytes have come.
READ_CHUNK = 1 << 16


def collect(
    pid: int,
    res_r: int,
    started: float,
    limits: Limits,
    max_result_bytes: int,
    watch: Watch | None = None,
) -> Result:
    """One result from a child within the request's wall limit, or the reason there is none.

    A result that came back has no "reaped" key, and its state part is a view of the bytes read
    (relayed as they came); otherwise the child was killed (if it overran) and reaped, and the
    result says why ("timeout", "killed", "crashed" for a malformed frame...), with "reaped": True.
    `watch`: the child's, when the caller keeps one (resident sessions); else one is made here.
    """
    deadline = started + limits["wall_ms"] / 1000.0
    buf = bytearray()
    need = 0
    timed_out = False
    oversized = 0
    # Watch the child itself too: a grandchild holding the result pipe must not hide its death.
    own_watch = watch is None
    if watch is None:
        watch = Watch(res_r, os.pidfd_open(pid))
    exited = False
    try:
        while not need or len(buf) < need:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            readable = child_gone = False
            for fd, _ in watch.poller.poll(remaining * 1000):
                if fd == res_r:
                    readable = True
                else:
                    child_gone = True
            if readable:
                chunk = os.read(res_r, min(need - len(buf), READ_CHUNK) if need else READ_CHUNK)
                if not chunk:
                    break
                buf += chunk
                if not need and len(buf) >= PREFIX.size:
                    need = frame_size(buf[: PREFIX.size])
                    if need > max_result_bytes:
                        oversized = max_result_bytes
                        break
            elif child_gone:
                if exited:
                    break
                exited = True  # read once more: the result may already sit in the pipe
    finally:
        if own_watch:
            os.close(watch.pidfd)
    malformed = ""
    if not (timed_out or oversized) and need and len(buf) >= need:
        try:
            if len(buf) > need:
                raise ValueError(f"{len(buf) - need} bytes past the end of its frame")
            sent = decode(buf, RESULT_PARTS)
            if not shallow(sent):
                raise ValueError("a value nested past one level")
        except ValueError as exc:
            malformed = str(exc) or type(exc).__name__
        else:
            # Keys only the zygote and the worker may set: a child's own say is never taken.
            return from_child(sent)  # type: ignore[arg-type]  # a child's claim, checked later
    # No usable result: whatever the child still does is of no use; make sure it is gone.
    result = child_status(pid, started, limits, timed_out, oversized, kill=True, malformed=malformed)
    result["reaped"] = True
    return result

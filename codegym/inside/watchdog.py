"""Waiting for a child's result within its request's limits, and saying why there is none.

The zygote's own watchdog: a child that overruns its wall-clock limit is killed here, a child that
died is reaped here and its death told apart (CPU limit, SIGKILL, another signal, an exit with no
result). The worker keeps a second watchdog on the zygote itself (`sandbox_worker/jail.py`).
"""

import contextlib
import json
import os
import select
import signal
import time

from .frames import HEADER
from .messages import Limits, Result, Usage, from_child


def child_status(
    pid: int,
    started: float,
    limits: Limits,
    timed_out: bool,
    oversized: int,
    *,
    kill: bool = False,
) -> Result:
    """Reap a child that gave no usable result (killing it first) and say why. `oversized`: the
    result size limit it broke, or 0."""
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


def collect(
    pid: int,
    res_r: int,
    started: float,
    limits: Limits,
    max_result_bytes: int,
    pidfd: int | None = None,
) -> Result:
    """One result from a child within the request's wall limit, or the reason there is none.

    A result that came back has no "reaped" key; otherwise the child was killed (if it overran)
    and reaped, and the result says why ("timeout", "killed", ...), with "reaped": True. `pidfd`:
    the child's, when the caller keeps one open (resident sessions); else one is opened here.
    """
    deadline = started + limits["wall_ms"] / 1000.0
    buf = bytearray()
    need = None
    timed_out = False
    oversized = 0
    # Watch the child itself too: a grandchild holding the result pipe must not hide its death.
    own_pidfd = pidfd is None
    if pidfd is None:
        pidfd = os.pidfd_open(pid)
    exited = False
    poller = select.poll()
    poller.register(res_r, select.POLLIN)
    poller.register(pidfd, select.POLLIN)
    try:
        while need is None or len(buf) < need:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            # poll, not select: a jail with many resident sessions has fds past FD_SETSIZE.
            ready = {fd for fd, _ in poller.poll(remaining * 1000)}
            if res_r in ready:
                chunk = os.read(res_r, 1 << 20)
                if not chunk:
                    break
                buf += chunk
                if need is None and len(buf) >= HEADER.size:
                    (need,) = HEADER.unpack(bytes(buf[: HEADER.size]))
                    need += HEADER.size
                    if need > max_result_bytes:
                        oversized = max_result_bytes
                        break
            elif pidfd in ready:
                if exited:
                    break
                exited = True  # read once more: the result may already sit in the pipe
    finally:
        if own_pidfd:
            os.close(pidfd)
    if not (timed_out or oversized) and need is not None and len(buf) >= need:
        try:
            sent = json.loads(bytes(buf[HEADER.size : need]))
            if isinstance(sent, dict):
                # Keys only the zygote and the worker may set: a child's own say is never taken.
                return from_child(sent)  # type: ignore[arg-type]  # a child's claim, checked later
        except ValueError:
            pass
    # No usable result: whatever the child still does is of no use; make sure it is gone.
    result = child_status(pid, started, limits, timed_out, oversized, kill=True)
    result["reaped"] = True
    return result

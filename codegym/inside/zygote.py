"""The zygote: the long-lived process inside a jail that forks one child per request.

Runs as `python -m inside.zygote SETTINGS_JSON` with `/sandbox` on the path (the package is
mounted there; see `sandbox_worker/limits.py`). It talks to the trusted worker over its
stdin/stdout with frames (`frames`: a JSON head, then raw binary parts) carrying the messages of
`messages`, and answers one request at a time. It routes by the head alone and relays the rest:
a session's state goes from the worker to a child and from a child to the worker as it came;
a resident step's request goes to the session's process as the worker encoded it. After each
request, every process of the jail that is not the zygote, the
spare or a resident session is killed and /tmp is wiped (`hygiene`), so nothing a request starts
outlives it.
"""

import collections
import contextlib
import gc
import hashlib
import os
import resource
import signal
import sys
import time

from . import frames
from .codecache import CodeCache
from .hygiene import (
    FULL_SCAN_EVERY,
    JailFacts,
    become,
    kill_leftovers,
    last_pid,
    one_thread,
    vm_bytes,
    wipe_tmp,
)
from .immortal import immortalize
from .messages import REQUEST_PARTS, Blob, Cold, EvictionReason, Hello, Request, Result, without
from .residents import Resident, child_main
from .settings import JailSettings
from .watchdog import collect

PRELOAD = (
    "gymnasium",
    "numpy",
    "ast",
    "bisect",
    "collections",
    "copy",
    "dataclasses",
    "fractions",
    "functools",
    "heapq",
    "itertools",
    "math",
    "operator",
    "random",
    "re",
    "statistics",
    "string",
    "typing",
)


def open_task(pid: int) -> int | None:
    """The fd of a child's /proc/PID/task, held while the child is a resident session: whether it
    runs one thread is read off it after each of its steps (`hygiene.one_thread`)."""
    try:
        return os.open(f"/proc/{pid}/task", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None


def version_of(state: Blob) -> str:
    """The version of a session's state a process holds: the sha256 of the state part it answered,
    hashed of the bytes relayed to the worker (never a child's claim about them), as the worker
    hashes the committed state it sends with the session's next step."""
    return hashlib.sha256(state).hexdigest()


def fd_ceiling() -> int:
    """One past the highest fd this process can hold (its RLIMIT_NOFILE, which nsjail sets)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limits = [n for n in (soft, hard) if 0 < n < (1 << 24)]
    return max(limits) if limits else 1 << 16


class Zygote:
    """Serves requests one at a time: one-shot operations in a child forked *before* the request
    arrived, steps of resident sessions in that session's own child.

    Forking a process that has numpy and gymnasium loaded costs over a millisecond; doing it (and
    reaping the previous child) after answering keeps it off the request's latency. A session's
    steps after its first skip the fork altogether (`residents`).
    """

    def __init__(self, settings: JailSettings, base_vm_bytes: int) -> None:
        self.settings = settings
        self.base_vm_bytes = base_vm_bytes
        self.code = CodeCache(settings.code_cache_bytes)
        self.spare: tuple[int, int, int] | None = None
        self.residents: collections.OrderedDict[str, Resident] = collections.OrderedDict()
        # Residency the worker's memory budget allows at the measured cost, and how long a resident
        # may sit idle (each request says both).
        self.cap = settings.resident_cap
        self.idle_s = settings.resident_idle_s
        # Residents ended since the last answer, by reason: told to the worker with the next one.
        self.evictions: collections.Counter[EvictionReason] = collections.Counter()
        # Sessions whose process ends after the answer (their episode is over).
        self.finished: list[str] = []
        # Processes killed and not yet reaped, by pidfd, with their ids (held until they are gone).
        self.dying: dict[int, int] = {}
        self.seen_last_pid = -2
        self.since_scan = 0
        self.last_uid = 0
        self.spare_uid = 0

    def allocate_uid(self) -> int:
        """An id for the next process: none a live resident session, the spare or a process not yet
        reaped holds."""
        held = {r.uid for r in self.residents.values()}
        held.update(self.dying.values())
        if self.spare is not None:
            held.add(self.spare_uid)
        for _ in range(JailFacts.id_span):
            self.last_uid = self.last_uid % (JailFacts.id_span - 1) + 1
            if self.last_uid not in held:
                return self.last_uid
        raise RuntimeError("no free id for a new process")

    def prefork(self) -> None:
        req_r, req_w = os.pipe()
        res_r, res_w = os.pipe()
        uid = self.allocate_uid() if JailFacts.isolated else 0
        pid = os.fork()
        if pid == 0:
            become(uid)
            os.close(req_w)
            os.close(res_r)
            # Other sessions' pipes must not reach code of this one: close every inherited fd but
            # stdio and our own two.
            low, high = sorted((req_r, res_w))
            os.closerange(3, low)
            os.closerange(low + 1, high)
            # Every fd above: the zygote holds four per resident session, thousands of them in a
            # large jail (closerange is one close_range call, whatever the span).
            os.closerange(high + 1, fd_ceiling())
            try:
                child_main(req_r, res_w, self.base_vm_bytes)
            finally:
                os._exit(70)
        os.close(req_r)
        os.close(res_w)
        self.spare = (pid, req_w, res_r)
        self.spare_uid = uid

    def spare_died(self) -> bool:
        """Reap the spare child if something killed it while it waited (an OOM kill, an operator):
        a request handed to it would fail for no fault of its own."""
        assert self.spare is not None
        pid, req_w, res_r = self.spare
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done = pid
        if not done:
            return False
        os.close(req_w)
        os.close(res_r)
        return True

    def serve(self, req: Request, head: bytes) -> tuple[Result, int | None]:
        """Run one request (`head`: its JSON head as the worker encoded it); return its result and
        the one-shot child to reap after answering."""
        result, pid = self._serve(req, head)
        result["residents"] = len(self.residents)
        if req.get("session") and req.get("op") in ("step", "create"):
            result["held"] = (
                str(req["session"]) in self.residents and str(req["session"]) not in self.finished
            )
        if self.evictions:
            result["evictions"] = dict(self.evictions)
            self.evictions.clear()
        self.code.report(result)
        return result, pid

    def _serve(self, req: Request, head: bytes) -> tuple[Result, int | None]:
        op = req.get("op")
        cap = req.get("cap")
        if isinstance(cap, int) and cap >= 0:
            self.cap = min(cap, self.settings.resident_cap)
        idle_ms = req.get("resident_idle_ms")
        if isinstance(idle_ms, int) and idle_ms > 0:
            self.idle_s = idle_ms / 1000
        if op == "release":
            self.evict(str(req.get("session") or ""), "release")
            return {"status": "ok"}, None
        key = str(req.get("session") or "") if op in ("step", "create") else ""
        cold: Cold | None = None
        if key and op == "create":
            # The new session lives on in the process that built it: its first step is resident.
            self.evict(key, "stale")
            req["keep_process"] = True
        elif key:
            # The worker sends the state's sha256 with every session step; none never matches.
            version = str(req.get("state_sha") or "")
            held = self.residents.get(key)
            cold = "absent"
            if held is not None:
                if held.version == version and not held.exited():
                    return self.serve_resident(key, held, req, head), None
                self.evict(key, "stale")
                cold = "stale"
            req["keep_process"] = True
        if key and not self.admit():
            req["keep_process"] = False
            if cold:
                cold = "full"
        code = self.code.check(req)
        if not isinstance(code, bytes):
            return code, None
        if self.spare is not None and self.spare_died():
            self.spare = None
        if self.spare is None:
            self.prefork()
        assert self.spare is not None
        pid, req_w, res_r = self.spare
        self.spare = None
        # spare_uid stays until the next prefork: the resident made from this child keeps it.
        started = time.monotonic()
        sent = without(req, "source")  # the child is sent the code, compiled once here
        sent["code"] = code
        with contextlib.suppress(OSError):
            frames.send(req_w, sent)
        result = collect(pid, res_r, started, req["limits"], self.settings.max_result_bytes)
        if cold:
            result["cold"] = cold
        state = result.get("state")
        if (
            key
            and req.get("keep_process")
            and not result.get("reaped")
            and result.get("status") == "ok"
            and state
            and not result.get("done")
        ):
            # A thread its code left running would go on while other sessions' steps run (filling
            # the jail's /tmp, holding ports): such a process is not kept; the answer stands and
            # the next step runs cold. Read from outside the process, so its own code cannot
            # answer for it.
            task_fd = open_task(pid)
            if task_fd is not None and one_thread(task_fd):
                try:
                    held = Resident(pid, req_w, res_r, version_of(state), self.spare_uid, task_fd)
                except OSError:  # no pidfd to be had (fds exhausted): served one-shot, not kept
                    pass
                else:
                    self.residents[key] = held
                    result["made_resident"] = True
                    return result, None
            if task_fd is not None:
                os.close(task_fd)
        os.close(req_w)
        os.close(res_r)
        return result, (None if result.pop("reaped", False) else pid)

    def serve_resident(self, key: str, held: Resident, req: Request, head: bytes) -> Result:
        """A step in the session's own process: no fork, no unpickling. The request goes as the
        worker encoded its head, without the state (the process holds it); the answer's state
        comes back as the process wrote it, hashed here for the version the process now holds."""
        self.residents.move_to_end(key)
        started = time.monotonic()
        with contextlib.suppress(OSError):
            frames.write_all(held.req_w, frames.head_only(head))
        result = collect(
            held.pid, held.res_r, started, req["limits"], self.settings.max_result_bytes, held.watch
        )
        reaped = result.pop("reaped", False)
        state = result.get("state")
        if not reaped and result.get("status") == "ok" and state and one_thread(held.task_fd):
            held.version = version_of(state)
            held.last_used = time.monotonic()
            result["from_resident"] = True
            if result.get("done"):
                # The episode is over: its process would only hold memory (a Reset runs cold).
                self.finished.append(key)
            return result
        # Failed: the child's copy is not the committed state any more; the next step runs cold.
        self.evict(key, "failed")
        return result

    def admit(self) -> bool:
        """Room for one more resident session: free, or made by evicting one idle for a while.

        When more sessions step than a jail can hold, evicting the least recently used one for
        every newcomer would make every step cold (every session comes back after all the others,
        as in a trainer's batch) and pay a process teardown on top; instead the newcomer runs
        one-shot, and the residents stay, until one has sat idle for `settings.admit_idle_s`
        (longer than an agent's turn: a session that idle has most likely been abandoned). The
        sessions that fit stay warm, the rest run cold: the hit rate is budget over working set,
        never zero.
        """
        if len(self.residents) < self.cap:
            return True
        if not self.residents:
            return False
        oldest_key, oldest = next(iter(self.residents.items()))
        if time.monotonic() - oldest.last_used < self.settings.admit_idle_s:
            return False
        self.evict(oldest_key, "room")
        return True

    def evict(self, key: str, reason: EvictionReason) -> None:
        held = self.residents.pop(key, None)
        if held is None:
            return
        self.evictions[reason] += 1
        for fd in (held.req_w, held.res_r, held.task_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.bury(held.pidfd, held.uid)

    def bury(self, pidfd: int, uid: int) -> None:
        """Kill a process and leave its reaping for later (`reap`): its exit, the teardown of its
        memory, then runs beside the next request instead of before it.

        By its pidfd, not its pid: a pid reaped meanwhile (a leftover sweep reaps any child) may
        belong to another process by now."""
        with contextlib.suppress(ProcessLookupError, OSError):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        self.dying[pidfd] = uid

    def reap(self) -> None:
        """Reap the killed processes that have exited (never waiting for one)."""
        for pidfd in list(self.dying):
            try:
                gone = os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG) is not None
            except ChildProcessError:
                gone = True  # reaped by a leftover sweep
            if gone:
                os.close(pidfd)
                del self.dying[pidfd]

    def cleanup(self, req: Request, pid: int | None) -> None:
        """After answering: reap the child, kill whatever else ran, evict idle sessions, fork the next spare."""
        if pid is not None:
            # It has answered: whatever it still does (a sleep after writing its own result) must
            # not hold the jail, so it is killed (not reaped yet: its pid cannot be reused before).
            try:
                self.bury(os.pidfd_open(pid), self.spare_uid)
            except OSError:  # no pidfd to be had (fds exhausted): kill and reap it now
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, 0)
        for key in self.finished:
            self.evict(key, "done")
        self.finished.clear()
        # Least recently used first: only the idle head of the order is looked at.
        idle_since = time.monotonic() - self.idle_s
        while self.residents:
            key, held = next(iter(self.residents.items()))
            if held.last_used > idle_since:
                break
            self.evict(key, "idle")
        while len(self.residents) > self.cap:
            self.evict(next(iter(self.residents)), "room")
        self.since_scan += 1
        # Read once, before the scan: a process a leftover forks during it makes the next cleanup
        # scan again. Only the spare forked below moves the counter on (read again then).
        seen = last_pid()
        if seen != self.seen_last_pid or self.since_scan >= FULL_SCAN_EVERY:
            keep = {held.pid for held in self.residents.values()}
            if self.spare is not None:
                keep.add(self.spare[0])
            kill_leftovers(keep)
            self.since_scan = 0
        wipe_tmp()
        self.reap()
        if self.spare is None:
            self.prefork()
            seen = last_pid()
        self.seen_last_pid = seen


def answer_frame(result: Result) -> list[Blob]:
    """The answer to the worker as its frame's chunks; one JSON could not hold (a child's values
    decode, so always encode, short of a bug here) is a crash, not the zygote's end."""
    try:
        return frames.pack(result)
    except (TypeError, ValueError, RecursionError) as exc:
        crashed: Result = {"status": "crashed", "message": f"zygote error: unrelayable answer: {exc}"}
        crashed["id"] = result.get("id")
        return frames.pack(crashed)


def main() -> None:
    settings = JailSettings.from_json(sys.argv[1] if len(sys.argv) > 1 else "")
    JailFacts.read()
    for name in PRELOAD:
        with contextlib.suppress(ImportError):
            __import__(name)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    zygote = Zygote(settings, vm_bytes())
    if settings.immortalize:
        immortalize()
    gc.collect()
    gc.freeze()
    zygote.prefork()
    in_fd, out_fd = 0, 1
    hello: Hello = {
        "ready": True,
        "pid": os.getpid(),
        "python": sys.version.split()[0],
        "isolated": JailFacts.isolated,
    }
    frames.send(out_fd, hello)
    while True:
        try:
            raw = frames.read_raw(in_fd)
            if raw is None:
                return
            req: Request = frames.parse(*raw, REQUEST_PARTS)  # type: ignore[assignment]
        except ValueError:
            return  # the worker sent what it never sends: the jail ends, and the worker replaces it
        lengths, body = raw
        pid = None
        try:
            result, pid = zygote.serve(req, body[: lengths[0]])
        except Exception as exc:
            result = {"status": "crashed", "message": f"zygote error: {type(exc).__name__}: {exc}"}
        result["id"] = req.get("id")
        frames.write_all(out_fd, answer_frame(result))
        zygote.cleanup(req, pid)


if __name__ == "__main__":
    main()

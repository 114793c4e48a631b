"""What keeps requests and sessions sharing a jail apart.

- Every process the zygote forks gets an id of its own (`become`): it cannot signal, see in /proc
  (mounted with hidepid) or read another session's process, and keeps no capability.
- After each request every process but the zygote, the spare and the resident sessions is killed
  (`kill_leftovers`; the zygote is pid 1 of the jail's pid namespace, so leftovers are reparented
  to it and show in its /proc) and /tmp is emptied (`wipe_tmp`).
"""

import contextlib
import os
import shutil
import signal
import time

# A full scan at least this often anyway, so that a step that cycled through the whole pid space
# back to the same last pid cannot keep a process alive past a few requests.
FULL_SCAN_EVERY = 16


class JailFacts:
    """Facts about the jail this process runs in, read once by the zygote at start (`read`)."""

    # Ids the jail maps from 0; the zygote is 0 and hands out 1..id_span-1.
    id_span = 1
    # Whether the zygote can give each process its own id (0 with CAP_SETUID in a mapped range).
    isolated = False
    # Mount points below /tmp (a venv or checkout under /tmp) and the folders on the way to them.
    tmp_mounts: frozenset[str] = frozenset()

    @classmethod
    def read(cls) -> None:
        cls.id_span = id_span()
        cls.isolated = cls.id_span > 1 and os.getuid() == 0
        cls.tmp_mounts = mounts_under_tmp()


def id_span() -> int:
    """How many ids the jail maps from 0 (1 when it maps one id: no room to give each process its own)."""
    try:
        with open("/proc/self/uid_map") as f:
            first, _, count = f.readline().split()
        return int(count) if first == "0" else 1
    except (OSError, ValueError):
        return 1


def become(uid: int) -> None:
    """Make this freshly forked process a stranger to every other session's: its own uid and gid,
    no supplementary group (group 0 is the one /proc's hidepid exempts), no capability left (the
    kernel clears them when every uid of a process leaves 0) and, since its uids changed, not
    dumpable: no other id can signal it, see it in /proc, or read its memory or environment.
    Files it makes are its own (umask 077)."""
    if not JailFacts.isolated:
        return
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    os.umask(0o077)


def mounts_under_tmp() -> frozenset[str]:
    """Mount points below /tmp (a venv or checkout under /tmp) and every folder on the way to them."""
    keep: set[str] = set()
    try:
        with open("/proc/self/mountinfo") as f:
            points = [line.split()[4] for line in f]
    except OSError:
        return frozenset()
    for point in points:
        if point.startswith("/tmp/"):
            path = point
            while path not in ("/tmp", "/"):
                keep.add(path)
                path = os.path.dirname(path)
    return frozenset(keep)


def in_jail() -> bool:
    """Whether this process is the init of its own pid namespace (the zygote in its jail): the
    cleanup below acts on everything it can see, which outside a jail would be the host."""
    return os.getpid() == 1


def wipe_tmp(folder: str = "/tmp") -> None:
    """Empty the jail's tmpfs so no file outlives the request that wrote it (mounts stay)."""
    if not in_jail():
        return
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        try:
            if entry.path in JailFacts.tmp_mounts:
                if entry.is_dir(follow_symlinks=False) and not os.path.ismount(entry.path):
                    wipe_tmp(entry.path)
            elif entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                os.unlink(entry.path)
        except OSError:
            pass


def kill_leftovers(keep: set[int]) -> None:
    """Kill every process in the jail but this one and `keep` (resident sessions, the spare), and reap."""
    if not in_jail():
        return
    me = os.getpid()
    victims: set[int] = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        if pid == me or pid in keep:
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
            victims.add(pid)
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid:
            victims.discard(pid)
            continue
        if not victims:
            return
        time.sleep(0.0005)


def last_pid() -> int:
    """The last pid the jail's pid namespace handed out (-1 when unreadable).

    Unchanged since the last cleanup means no process (or thread) was created since, so there is
    nothing to kill and the /proc scan, the costliest part of a resident step, can be skipped.
    """
    try:
        fd = os.open("/proc/sys/kernel/ns_last_pid", os.O_RDONLY)
        try:
            return int(os.read(fd, 32))
        finally:
            os.close(fd)
    except (OSError, ValueError):
        return -1


def vm_bytes() -> int:
    """This process's address space (the zygote's, which every child's memory limit adds to)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0

"""What keeps requests and sessions sharing a jail apart.

- Every process the zygote forks gets an id of its own (`become`): it cannot signal, see in /proc
  (mounted with hidepid) or read another session's process, and keeps no capability.
- After each request every process but the zygote, the spare and the resident sessions is killed
  (`kill_leftovers`; the zygote is pid 1 of the jail's pid namespace, so leftovers are reparented
  to it and show in its /proc) and /tmp is emptied (`wipe_tmp`).
- A session's process is kept between its steps only while it runs one thread (`one_thread`).

Most requests are resident steps that start nothing and write nothing, so each check is first
made the cheapest exact way, one system call on an fd held open: the pid counter read in place
(`last_pid`), a process's thread count and /tmp's entry count read off an `fstat` of their folders
(the kernel counts a process's threads in its /proc/PID/task link count, and tmpfs a folder's
entries in its size). Both counts are checked once at the jail's start (`JailFacts.read`): where
the kernel does not keep them, every check lists the folder as before.
"""

import contextlib
import os
import shutil
import signal
import threading
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
    # The link count of a one-thread process's /proc/PID/task (0: the kernel does not count
    # threads there; `one_thread` lists the folder).
    one_thread_links = 0
    # /tmp, held open, and its size when it holds nothing (-1: its size does not count entries, or a
    # mount lies below it; `wipe_tmp` lists it every time).
    tmp_fd = -1
    empty_tmp_size = -1
    # /proc/sys/kernel/ns_last_pid, held open (-1: not readable).
    last_pid_fd = -1

    @classmethod
    def read(cls) -> None:
        cls.id_span = id_span()
        cls.isolated = cls.id_span > 1 and os.getuid() == 0
        cls.tmp_mounts = mounts_under_tmp()
        cls.one_thread_links = thread_links()
        with contextlib.suppress(OSError):
            cls.last_pid_fd = os.open("/proc/sys/kernel/ns_last_pid", os.O_RDONLY | os.O_CLOEXEC)
        if in_jail() and not cls.tmp_mounts:
            cls.tmp_fd, cls.empty_tmp_size = tmp_entry_count()


def thread_links() -> int:
    """The link count of /proc/self/task while this process runs one thread, if the kernel adds
    the process's threads to it (seen here by starting one), else 0."""
    try:
        fd = os.open("/proc/self/task", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return 0
    try:
        alone = os.fstat(fd).st_nlink
        if len(os.listdir(fd)) != 1:
            return 0
        release = threading.Event()
        thread = threading.Thread(target=release.wait)
        thread.start()
        try:
            with_one_more = os.fstat(fd).st_nlink
        finally:
            release.set()
            thread.join()
        return alone if with_one_more == alone + 1 else 0
    except OSError:
        return 0
    finally:
        os.close(fd)


def tmp_entry_count(folder: str = "/tmp") -> tuple[int, int]:
    """`folder` held open and its size when empty, if it is empty now and its size counts its
    entries (tmpfs does: seen here by adding one), else (-1, -1)."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return -1, -1
    probe = os.path.join(folder, ".codegym-probe")
    try:
        empty = os.fstat(fd).st_size
        if os.listdir(fd):
            raise OSError("/tmp is not empty")
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        holding_one = os.fstat(fd).st_size
        os.unlink(probe)
        if holding_one != empty and os.fstat(fd).st_size == empty:
            return fd, empty
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(probe)
    os.close(fd)
    return -1, -1


def one_thread(task_fd: int) -> bool:
    """Whether the process whose /proc/PID/task `task_fd` holds runs one thread and only one (a
    process that has exited runs none)."""
    try:
        if JailFacts.one_thread_links:
            return os.fstat(task_fd).st_nlink == JailFacts.one_thread_links
        return len(os.listdir(task_fd)) == 1
    except OSError:
        return False


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


def tmp_empty() -> bool:
    """Whether the jail's /tmp holds no entry at all, known from its size alone (`JailFacts`)."""
    if JailFacts.tmp_fd < 0:
        return False
    try:
        return os.fstat(JailFacts.tmp_fd).st_size == JailFacts.empty_tmp_size
    except OSError:
        return False


def wipe_tmp(folder: str = "/tmp") -> None:
    """Empty the jail's tmpfs so no file outlives the request that wrote it (mounts stay)."""
    if not in_jail() or (folder == "/tmp" and tmp_empty()):
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
        return int(os.pread(JailFacts.last_pid_fd, 32, 0))
    except (OSError, ValueError):
        return -1


def vm_bytes() -> int:
    """This process's address space (the zygote's, which every child's memory limit adds to)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0

"""Processes as /proc shows them: parent links, a process's descendants, its CPU time and memory.

Read only, standard library only: the sandbox worker (what a resident session costs,
sandbox_worker/residency.py), the benchmarks (bench/common.py, which also runs as the bare echo
server whose footprint is the floor) and the tests' process checks (tests/helpers/processes.py)
share it. A sandbox worker's jails show up with host pids under the worker (worker → nsjail →
zygote → the zygote's forks), so a tree read here holds them too.

Two ways to find a process's children: `children_of` reads the process's own
`/proc/PID/task/*/children` files (a few reads, whatever runs on the machine), `children_by_parent`
reads every process's stat (one snapshot of every link). A walk down a few known trees (a worker's
jails, thousands of processes on a busy machine) uses the first; `children_reader` falls back to
the second where the kernel lacks the files.

A process may exit between two reads: every reader returns None (or 0, or skips it) for a
process that is gone or unreadable, never raises.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")


def pids() -> list[int]:
    """Every process now, in /proc's order."""
    return [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]


def named_stat(pid: int) -> tuple[str, list[str]] | None:
    """/proc/PID/stat as its command name (which may hold spaces and parentheses) and the fields
    after it: state is [0], ppid [1], utime stime cutime cstime [11:15] (clock ticks), start time
    [19] (clock ticks since boot)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    head, paren, rest = text.rpartition(")")
    if not paren:
        return None
    return head.partition("(")[2], rest.split()


def stat_fields(pid: int) -> list[str] | None:
    """`named_stat`'s fields alone."""
    stat = named_stat(pid)
    return stat[1] if stat else None


def cmdline(pid: int) -> str | None:
    """The command line, its arguments joined by spaces."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None


def children_by_parent() -> dict[int, list[int]]:
    """Parent pid -> its children's pids, in /proc's order."""
    children: dict[int, list[int]] = {}
    for pid in pids():
        fields = stat_fields(pid)
        if fields:
            children.setdefault(int(fields[1]), []).append(pid)
    return children


def children_of(pid: int) -> list[int] | None:
    """A process's children, from /proc/PID/task/*/children; [] when it is gone or unreadable, None
    where the kernel has no such file (built without CONFIG_PROC_CHILDREN: then scan /proc)."""
    found: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children", "rb") as f:
                found += [int(child) for child in f.read().split()]
    except FileNotFoundError:
        return [] if not os.path.exists(f"/proc/{pid}") else None
    except (OSError, ValueError):
        return []
    return found


def children_reader() -> Callable[[int], list[int]]:
    """A function from a pid to its children: read from the process's `children` files, or, where
    the kernel has none, from one scan of every process's stat, made at the first need and shared
    by every later call (a snapshot: for one walk, not to keep)."""
    scanned: dict[int, list[int]] | None = None

    def children(pid: int) -> list[int]:
        nonlocal scanned
        direct = children_of(pid)
        if direct is not None:
            return direct
        if scanned is None:
            scanned = children_by_parent()
        return scanned.get(pid, [])

    return children


def descendants(roots: Iterable[int], links: dict[int, list[int]] | None = None) -> list[int]:
    """`roots` (listed even when gone) and all their descendants now.

    `links` is a `children_by_parent()` already read, for several walks over one snapshot.
    """
    if links is None:
        links = children_by_parent()
    found: list[int] = []
    stack = list(roots)
    while stack:
        pid = stack.pop()
        found.append(pid)
        stack.extend(links.get(pid, []))
    return found


def cpu_ticks(pid: int, *, reaped: bool) -> int:
    """utime + stime of one process in clock ticks (0 when gone); with `reaped`, plus cutime +
    cstime: the CPU of the children it has already waited for."""
    fields = stat_fields(pid)
    if fields is None:
        return 0
    own = int(fields[11]) + int(fields[12])
    return own + (int(fields[13]) + int(fields[14]) if reaped else 0)


def memory_kb(pid: int) -> dict[str, int] | None:
    """/proc/PID/smaps_rollup in KiB by name ("Rss", "Pss", "Private_Clean", ...), or None."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return None
    figures: dict[str, int] = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 2 and fields[0].endswith(":") and fields[1].isdigit():
            figures[fields[0][:-1]] = int(fields[1])
    return figures


def status_kb(pid: int) -> dict[str, int] | None:
    """The figures of /proc/PID/status counted in KiB ("VmRSS", "VmPTE", ...), or None."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    figures: dict[str, int] = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) == 3 and fields[0].endswith(":") and fields[2] == "kB" and fields[1].isdigit():
            figures[fields[0][:-1]] = int(fields[1])
    return figures
